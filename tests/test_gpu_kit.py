"""The GPU kit (scripts/gpu/): parts and manifest, install into a fresh target that shadows the
site-packages' onnxruntime, its one-line errors, and the plan's call 6 run on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def fake_wheel_folder(root: Path, dist: str, version: str) -> None:
    """A folder as pip leaves it: the ``onnxruntime`` package and one wheel's dist-info (never imported)."""
    (root / "onnxruntime").mkdir(parents=True, exist_ok=True)
    (root / "onnxruntime" / "__init__.py").write_text(f"WHO = {dist!r}\n")
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


def check_install(*path: Path) -> subprocess.CompletedProcess:
    code = "from ortevals.install import check_install, installed, ORT_WHEELS\ncheck_install()\n" \
           "print(installed(ORT_WHEELS, 'onnxruntime'))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, REPO]))}
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env)


def test_a_shadowed_cpu_onnxruntime_is_not_a_mixed_install(tmp_path):
    """The box keeps onnxruntime 1.30 (CPU) in site-packages; the kit puts onnxruntime-gpu in a folder
    first on sys.path. Only the GPU wheel owns the module that gets imported: no error. The two wheels
    in one folder (one overwrote the other's files) are still refused."""
    target, site = tmp_path / "target", tmp_path / "site"
    fake_wheel_folder(target, "onnxruntime-gpu", "1.31.1")
    fake_wheel_folder(site, "onnxruntime", "1.30.0")
    ok = check_install(target, site)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "['onnxruntime-gpu']"
    fake_wheel_folder(tmp_path / "both", "onnxruntime", "1.30.0")
    (tmp_path / "both" / "onnxruntime_gpu-1.31.1.dist-info").mkdir()
    (tmp_path / "both" / "onnxruntime_gpu-1.31.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: onnxruntime-gpu\nVersion: 1.31.1\n")
    mixed = check_install(tmp_path / "both")
    assert mixed.returncode != 0
    assert "onnxruntime and onnxruntime-gpu are both installed" in mixed.stderr


# ---- parts, manifest, join and their errors (scripts/gpu/pack.py through kit.py) -------------------------
KIT = REPO / "scripts" / "gpu" / "kit.py"
sys.path.insert(0, str(REPO / "scripts" / "gpu"))


def kit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(KIT), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


def kit_dir(root: Path, files: dict[str, bytes], part_mib: int, commit: str | None = None) -> Path:
    """A kit folder as 'prepare' leaves it (wheels/ + manifest, its ortevals wheel built from ``commit``), cut by
    'kit.py split'."""
    from pack import sha256, write_manifest

    (root / "wheels").mkdir(parents=True)
    wheels = []
    for name, data in files.items():
        (root / "wheels" / name).write_bytes(data)
        wheels.append({"file": name, "sha256": sha256(root / "wheels" / name), "bytes": len(data)})
    write_manifest(root, {"kind": "test", "wheels": wheels, "parts": [], "ortevals_commit": commit})
    proc = kit("split", str(root), "--part-mib", str(part_mib), "--pack", "none", "--repo", str(REPO))
    assert proc.returncode == 0, proc.stderr
    return root


def test_parts_fill_each_call_and_join_back_to_every_wheel(tmp_path):
    import numpy as np
    from pack import join, load_manifest

    rng = np.random.default_rng(0)
    files = {f"w{i}-1.0-py3-none-any.whl": rng.bytes(n) for i, n in enumerate([2_600_000, 300_000, 1_250_000])}
    src = kit_dir(tmp_path / "src", files, part_mib=1)
    manifest = load_manifest(src)
    total = sum(map(len, files.values()))
    assert [p["bytes"] for p in manifest["parts"]] == [1 << 20] * (total >> 20) + [total % (1 << 20)]
    assert [c["call"] for c in manifest["calls"]] == list(range(1, len(manifest["parts"]) + 1))
    box = tmp_path / "box"  # what the GPU machine holds: the parts and the manifest, no wheels
    proc = kit("receive", str(src), str(box))
    assert proc.returncode == 0 and "parts 01, 02, 03, 04 of 4 received" in proc.stdout, proc.stderr
    got = join(box, load_manifest(box), box / "wheels")
    assert {p.name: p.read_bytes() for p in got} == files


def test_xz_packed_parts_join_back_to_every_wheel(tmp_path):
    """--pack xz: the compressed bytes travel (fewer of them for compressible wheels), the join unpacks and
    checks each wheel's own sha256; a wrong byte in a packed wheel is caught before pip sees it."""
    import numpy as np
    from pack import join, load_manifest

    rng = np.random.default_rng(3)
    files = {"text-1.0-py3-none-any.whl": b"import os\n" * 300_000, "rand-1.0-py3-none-any.whl": rng.bytes(900_000)}
    src = kit_dir(tmp_path / "src", files, part_mib=1)
    assert kit("split", str(src), "--part-mib", "1", "--pack", "xz", "--repo", str(REPO)).returncode == 0
    manifest = load_manifest(src)
    assert manifest["pack"] == "xz" and sum(p["bytes"] for p in manifest["parts"]) < sum(map(len, files.values())) / 2
    box = tmp_path / "box"
    assert kit("receive", str(src), str(box)).returncode == 0
    assert {p.name: p.read_bytes() for p in join(box, load_manifest(box), box / "wheels")} == files
    data = bytearray((src / "part-01.bin").read_bytes())
    data[-10] ^= 0xFF  # inside the second (random) wheel's compressed bytes; the part's own check is bypassed
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "part-01.bin").write_bytes(bytes(data))
    bad = load_manifest(src)
    bad["parts"][0]["sha256"] = __import__("pack").sha256(tmp_path / "bad" / "part-01.bin")
    with pytest.raises(Exception, match="bad sha256 after joining"):
        join(tmp_path / "bad", bad, tmp_path / "bad" / "wheels")


def test_missing_part_bad_hash_and_no_manifest_are_one_line_errors(tmp_path):
    import numpy as np

    files = {"a-1.0-py3-none-any.whl": np.random.default_rng(1).bytes(2_500_000)}
    box = kit_dir(tmp_path / "box", files, part_mib=1)
    (box / "wheels" / "a-1.0-py3-none-any.whl").unlink()  # the box has parts only
    (box / "part-02.bin").rename(tmp_path / "part-02.bin")
    one_line_error(kit("install", str(box), "--target", str(tmp_path / "t")), "missing 1 of 3 parts",
                   "part-02.bin", "call(s) 2")
    (tmp_path / "part-02.bin").rename(box / "part-02.bin")
    data = bytearray((box / "part-03.bin").read_bytes())
    data[100] ^= 0xFF
    (box / "part-03.bin").write_bytes(bytes(data))
    one_line_error(kit("install", str(box), "--target", str(tmp_path / "t")), "part-03.bin", "bad sha256")
    one_line_error(kit("receive", str(box), str(tmp_path / "dest")), "part-03.bin", "bad sha256")
    one_line_error(kit("install", str(tmp_path), "--target", str(tmp_path / "t")), "no manifest")


# ---- a real onnxruntime installed into a fresh target, shadowing the "box's" CPU onnxruntime ------------
def repack(out: Path, dist_name: str = "onnxruntime", as_name: str = "onnxruntime-gpu") -> Path:
    """This machine's ``dist_name`` (a real, working module) as a wheel named ``as_name``: onnxruntime as
    onnxruntime-gpu, the GPU wheel's name, must shadow the onnxruntime left in the (fake) box."""
    import zipfile
    from importlib import metadata

    dist = metadata.distribution(dist_name)
    site, version, top = Path(dist.locate_file("")), dist.version, dist_name.replace("-", "_")
    info = f"{as_name.replace('-', '_')}-{version}.dist-info"
    wheel = out / f"{as_name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        names = [f for f in dist.files if f.parts[0] == top and "__pycache__" not in f.parts]
        for f in names:
            z.write(site / f, str(f))
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {as_name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "".join(f"{f},,\n" for f in [*map(str, names), f"{info}/METADATA",
                                                                       f"{info}/WHEEL", f"{info}/RECORD"]))
    return wheel


def test_install_shadows_the_box_onnxruntime_and_proves_the_provider(tmp_path):
    """kit.py install with a python that sees only the target, the fake box (this machine's packages on
    the box's list: its own onnxruntime too) and the repo: the target's onnxruntime is the one imported,
    a session really runs on the expected provider, ortevals accepts the install; a provider the wheel
    cannot give is a one-line error."""
    import json

    from pack import sha256, write_manifest
    from resolve import read_box

    from tests.fixtures.fakebox import link

    box = tmp_path / "fakebox"
    linked, _ = link(box, read_box(REPO / "scripts" / "gpu" / "box_packages.txt"))
    assert "onnxruntime" in linked and "numpy" in linked and "onnx" in linked
    (box / "nvidia" / "cu13" / "lib").mkdir(parents=True)  # where torch's CUDA 13 wheels put their libraries
    (box / "nvidia" / "cu13" / "lib" / "libcudart.so.13").write_bytes(b"")
    (tmp_path / "kit" / "wheels").mkdir(parents=True)
    wheels = [repack(tmp_path / "kit" / "wheels"),
              repack(tmp_path / "kit" / "wheels", "onnxruntime-genai", "onnxruntime-genai-cuda")]
    write_manifest(tmp_path / "kit", {"kind": "test", "parts": [], "wheels": [
        {"file": w.name, "sha256": sha256(w), "bytes": w.stat().st_size} for w in wheels]})
    # plain parts: the xz join is test_xz_packed_parts_join_back_to_every_wheel's (packing this machine's
    # onnxruntime would take most of this test's time)
    split = kit("split", str(tmp_path / "kit"), "--part-mib", "16", "--pack", "none", "--repo", str(REPO))
    assert split.returncode == 0, split.stderr
    for wheel in wheels:
        wheel.unlink()  # the box gets parts only
    env = {"PYTHONPATH": os.pathsep.join([str(box), str(REPO)])}
    target = tmp_path / "site"
    ok = kit("install", str(tmp_path / "kit"), "--target", str(target), "--expect-provider", "CPUExecutionProvider",
             "--no-site", "--modules", "ortevals.runtime", "--no-og-check", env=env)
    assert ok.returncode == 0, ok.stderr
    report = json.loads((target / "kit-install.json").read_text())
    assert report["session_providers"] == ["CPUExecutionProvider"] and "og_generator" not in report
    # one token of onnxruntime-genai's Generator on the tiny package the install builds with the kit's builder
    # (site-packages seen: this machine's transformers needs more than the box's list holds, e.g. httpx2)
    og = kit("install", str(tmp_path / "kit"), "--target", str(target), "--expect-provider", "CPUExecutionProvider",
             "--modules", "", env=env)
    assert og.returncode == 0, og.stderr
    generator = json.loads((target / "kit-install.json").read_text())["og_generator"]
    assert generator["provider"] == "cpu" and generator["logits_shape"][-1] == 512
    # checked with the LD_LIBRARY_PATH that 'kit.py env' exports (the box's CUDA 13 libraries first)
    assert report["env"]["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(box / "nvidia" / "cu13" / "lib")
    assert (target / "onnxruntime" / "__init__.py").is_file() and (box / "onnxruntime").is_symlink()
    assert (target / "nvidia").resolve() == (box / "nvidia").resolve()  # preload_dlls looks beside onnxruntime
    shell = kit("env", "--target", str(target), env=env).stdout
    assert f"export LD_LIBRARY_PATH={box / 'nvidia' / 'cu13' / 'lib'}" in shell and f"PYTHONPATH={target}" in shell
    bad = kit("install", str(tmp_path / "kit"), "--target", str(target), "--expect-provider",
              "CUDAExecutionProvider", "--no-site", "--modules", "", "--no-og-check", env=env)
    one_line_error(bad, "CUDAExecutionProvider")


# ---- make_model.py: real shapes, sized by transformers' own count; the package equals PyTorch ----------
@pytest.mark.parametrize("arch,params,layers", [("qwen3", 1.72e9, 28), ("gemma3", 1.0e9, 26), ("llama", 1.236e9, 16),
                                                 ("smollm2", 1.35e8, 30), ("qwen3", 1.5e9, 24),
                                                 ("qwen3-0.6b", 5.96e8, 28)])
def test_sized_configs_have_the_real_shapes_and_the_asked_size(arch, params, layers):
    """At the real models' sizes the real layer counts come back (Qwen3-1.7B 28, Gemma-3-1B 26,
    Llama-3.2-1B 16, SmolLM2-135M 30, Qwen3-0.6B 28); the parameter count is transformers' own (meta device)."""
    import make_model
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    c = make_model.size_config(arch, params, 32768)
    assert c["num_hidden_layers"] == layers
    config = AutoConfig.for_model(**{k: v for k, v in c.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    numel = sum(p.numel() for p in model.parameters())
    assert numel == sum(make_model.count_params(c)[:1]) + make_model.count_params(c)[1] * layers
    assert abs(numel - params) < make_model.count_params(c)[1]  # within one layer of the size asked for


def test_make_model_gemma3_package_equals_pytorch_and_the_check_can_fail(fixture_cache, tmp_path):
    """A tiny Gemma-3-shaped model (a sliding-window layer and a global one; the builder shim's RoPE):
    the fp32 package's log-softmax equals PyTorch's within 1e-4 over texts longer than the window;
    the same check on a package with a damaged weight fails with exit 1."""
    import json
    import shutil

    import numpy as np

    out = fixture_cache / "gpu-kit-models" / "gemma3-1e6"
    cmd = [sys.executable, str(REPO / "scripts/gpu/make_model.py"), str(out), "--arch", "gemma3", "--params", "1e6",
           "--precision", "fp32", "--ep", "cpu", "--check"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["max_abs_dlogprob"] <= 1e-4
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 512
    import make_model

    bad = tmp_path / "bad"
    shutil.copytree(out / "fp32-cpu", bad)
    data = next(bad.glob("*.onnx.data"))
    raw = np.fromfile(data, dtype=np.float32)
    raw[len(raw) // 2: len(raw) // 2 + 4096] = np.random.default_rng(0).normal(0, 1, 4096)
    raw.tofile(data)
    assert make_model.check(out / "hf", bad) > 1e-2


# ---- call 6 of the plan end to end on CPU (the tiny package make_model.py builds) ----------------------------
def samples(folder: Path) -> dict[int, list[float]]:
    """doc_id -> each choice's log-likelihood, read straight from a run's lm-eval samples files."""
    import json

    out = {}
    for f in folder.glob("samples_*.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            out[s["doc_id"]] = [float(r[0][0]) for r in s["resps"]]
    return out


def test_gpu_plan_runs_on_cpu_and_ortevals_answers_equal_hf(fixture_cache, tmp_path):
    """Call 6 with ``cpu`` for ``cuda`` on a tiny model: make_model.py, ``ortevals bench`` (two ortevals rows, hf
    as the reference, lm-eval's onnxruntime-genai), oracle.py on the first row's run (its requests through
    onnxruntime-genai's Generator) and ortprofile.py on one ortevals command. ortevals' log-likelihoods, read back
    from the runs' samples (not from the bench's own comparison), equal hf's on the same weights."""
    import json

    models = fixture_cache / "gpu-kit-models" / "llama-1e+06"  # the folder the earlier bench script built here
    built = subprocess.run([sys.executable, str(REPO / "scripts/gpu/make_model.py"), str(models), "--arch", "llama",
                            "--params", "1e6", "--precision", "fp32", "--ep", "cpu"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    pkg, hf, out = models / "fp32-cpu", models / "hf", tmp_path / "f32"
    bench = [sys.executable, "-m", "ortevals.cli", "bench", "--pkg", f"batched={pkg}:shared_prefix_batch=on",
             "--pkg", f"batch1={pkg}:shared_prefix_batch=off", "--hf", f"hf={hf}:dtype=float32,batch_size=8",
             "--backends", "ortevals,hf,onnxruntime-genai", "--limit", "5", "--peer-limit", "5", "--output", str(out)]
    proc = subprocess.run(bench, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["machine"]["versions"]["lm_eval"] and "onnxruntime==" in result["machine"]["versions"]["onnxruntime"]
    assert "device" in result["machine"]
    rows = {r["label"]: r for r in result["rows"]}
    assert list(rows) == ["batched", "batch1", "hf", "onnxruntime-genai fp32-cpu"] and rows["hf"]["is_ref"]
    for label, row in rows.items():
        assert row["status"] == "ok", (label, row["note"])
    runs = {label: Path(r[0]["output"]) for label, r in result["runs"].items()}
    assert runs["batched"] == out / "runs" / "01-batched" / "run1"  # the path the plan hands oracle.py
    ref = samples(runs["hf"])
    assert len(ref) == 5
    for label in ("batched", "batch1"):
        ours = samples(runs[label])
        assert ours.keys() == ref.keys()
        delta = max(abs(a - b) for q in ref for a, b in zip(ours[q], ref[q], strict=True))
        assert delta <= 1e-4 and rows[label]["paired"]["max_abs_dll"] == pytest.approx(delta, abs=1e-9)
    modes = {label: json.loads((runs[label] / "results.json").read_text())["ortevals"]["mode"] for label in runs
             if label in ("batched", "batch1")}
    assert "shared-prefix batches: 5 inputs in" in modes["batched"] and "shared-prefix" not in modes["batch1"]
    # the oracle: the batched row's first 30 requests, encoded as ortevals encodes them, through og's Generator
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/oracle.py"), str(runs["batched"]), str(pkg),
                           "--requests", "30"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    oracle = json.loads(proc.stdout.strip().splitlines()[-1])
    assert oracle["requests"] == 30 and oracle["within_tolerance"] == 30 and oracle["outside"] == []
    assert 0 < oracle["max_abs_delta"] <= 1e-5 and oracle["activations"] == "float32"
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/ortprofile.py"), str(tmp_path / "prof"), "--",
                           "mmlu-pro", "--pkg", str(pkg), "--data", "bundled", "--limit", "2", "--no-resume",
                           "--output", str(tmp_path / "prof" / "run")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    prof = json.loads((tmp_path / "prof" / "profile.json").read_text())
    assert prof["session_runs"] > 0 and 0 < prof["inside_ort_run_s"] < prof["scored_s"]


# ---- transfer calls: stage on a fresh clone, and the measured kit against the tree as tracked ---------------
def fresh_clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    return clone


def head(repo: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()


def test_stage_refuses_a_kit_whose_ortevals_is_not_the_checkouts(tmp_path):
    """The box imports ortevals from the kit's wheel: a kit prepared at another commit (the H200 run's kit was
    prepared before the flash-attention fix), or a checkout with uncommitted library changes, would measure
    other code than the one reported. One line, exit 2, nothing staged."""
    clone = fresh_clone(tmp_path)
    files = {"w0-1.0-py3-none-any.whl": b"x" * 1000}
    kit_dir(tmp_path / "old", files, part_mib=8, commit="5ec537324091202e2d2909a6db8ee3ca85b703ee")
    proc = kit("stage", str(tmp_path / "old"), "--repo", str(clone))
    one_line_error(proc, "built from commit 5ec5373", f"is at {head(clone)[:7]}", "prepare")
    kit_dir(tmp_path / "now", files, part_mib=8, commit=head(clone))
    (clone / "ortevals" / "version.py").write_text((clone / "ortevals" / "version.py").read_text() + "# edited\n")
    proc = kit("stage", str(tmp_path / "now"), "--repo", str(clone))
    one_line_error(proc, "uncommitted change", "ortevals/version.py", "commit, then prepare again")
    assert not (clone / ".gpukit").exists()
    subprocess.run(["git", "checkout", "-q", "--", "ortevals"], cwd=clone, check=True)
    assert kit("stage", str(tmp_path / "now"), "--repo", str(clone)).returncode == 0


def test_stage_on_a_fresh_clone_prints_its_transfer_calls_and_each_fits_a_call(tmp_path):
    """A kit cut for another tree is cut again for this one (the largest part the call allows), every call
    carries the tree plus one part within the 64 MiB, and the count printed is the folders staged."""
    import re

    import numpy as np
    from kit import CALL_MIB, part_mib_for, tree_bytes
    from pack import MIB, load_manifest

    clone = fresh_clone(tmp_path)
    sizes = [45 << 20, 25 << 20]
    files = {f"w{i}-1.0-py3-none-any.whl": np.random.default_rng(i).bytes(n) for i, n in enumerate(sizes)}
    kit_dir(tmp_path / "kit", files, part_mib=8, commit=head(clone))
    proc = kit("stage", str(tmp_path / "kit"), "--repo", str(clone))
    assert proc.returncode == 0, proc.stderr
    calls = int(re.search(r": (\d+) transfer calls", proc.stdout).group(1))
    staged = sorted(p.name for p in (clone / ".gpukit").iterdir())
    part = part_mib_for(tree_bytes(clone))
    assert staged == [f"c{i:02d}" for i in range(1, calls + 1)] and calls == -(-(70 << 20) // (part * MIB)) > 1
    assert load_manifest(tmp_path / "kit")["part_mib"] == part
    tree = tree_bytes(clone)
    assert all(tree + sum(f.stat().st_size for f in (clone / ".gpukit" / c).glob("part-*")) <= CALL_MIB * MIB
               for c in staged)
    assert "/.gpukit/" in (clone / ".git" / "info" / "exclude").read_text()  # only carry sends the parts


def test_the_measured_gpu_kit_takes_five_calls_once_raw_bench_outputs_leave_the_tree(tmp_path):
    """The GPU kit as measured (kit.py MEASURED_KIT), beside a fresh clone's tree as tracked and beside the
    same tree without the raw benchmark outputs under docs/bench*/ (*.json, *.jsonl): at most 5 transfer
    calls for the latter, with xz where plain parts would need more."""
    from kit import MEASURED_KIT, TARGET_CALLS, calls_for, part_mib_for, tree_bytes

    clone = fresh_clone(tmp_path)
    raw = [p for p in clone.glob("docs/bench*/**/*") if p.suffix in (".json", ".jsonl") and p.is_file()]
    tracked = tree_bytes(clone)
    without_raw = tracked - sum(p.stat().st_size for p in raw)

    def calls(tree: int) -> tuple[int, int]:
        return tuple(calls_for(MEASURED_KIT[k], part_mib_for(tree)) for k in ("plain", "xz"))

    plain, packed = calls(without_raw)
    assert min(plain, packed) <= TARGET_CALLS, (tracked / 2**20, without_raw / 2**20, calls(tracked), plain, packed)
    proc = kit("calls", "--repo", str(clone))
    assert proc.returncode == 0 and f"= {calls(tracked)[0]} transfer calls" in proc.stdout, proc.stdout + proc.stderr


def test_oracle_tolerance_is_the_stated_bound_and_requests_past_it_are_listed():
    """2 * n * 16 * u * max(1, max|z|), by hand: fp16, 2 tokens, largest logit 10 -> 0.3125; bf16 8x that."""
    from oracle import compare, tolerance

    assert tolerance(2, 10.0, "float16") == 0.3125 and tolerance(2, 10.0, "bfloat16") == 2.5
    assert tolerance(1, 0.25, "float16") == 2 * 16 * 2.0 ** -11  # logits below 1: the scale is 1
    rows = [{"ll": -1.0, "oracle": -1.3, "cont": [1, 2], "zmax": 10.0},
            {"ll": -2.0, "oracle": -2.4, "cont": [1, 2], "zmax": 10.0},
            {"ll": float("nan"), "oracle": -1.0, "cont": [1], "zmax": 1.0}]
    got = compare(rows, "float16")
    assert got["within_tolerance"] == 1 and [o["request"] for o in got["outside"]] == [1, 2]
    assert got["max_ratio"] == pytest.approx(0.4 / 0.3125)
