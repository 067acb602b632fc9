#!/usr/bin/env python
"""The GPU kit: the wheels an offline GPU machine lacks, carried in parts through the device tool.

    python scripts/gpu/kit.py prepare /work/gpu-kit            # here: resolve, download, split (manifest.json)
    python scripts/gpu/kit.py stage /work/gpu-kit              # here: one ignored folder per device call
    python3 scripts/gpu/kit.py receive .gpukit/c01 /root/kit   # there, once per call: copy + check the part
    python3 scripts/gpu/kit.py install /root/kit --target /root/site --expect-provider CUDAExecutionProvider
    eval "$(python3 scripts/gpu/kit.py env --target /root/site)"   # PYTHONPATH and LD_LIBRARY_PATH for later commands

``prepare --cpu-rehearsal`` makes the same kit with the CPU wheels (onnxruntime, onnxruntime-genai) for
this machine's python, so the whole flow runs here (scripts/gpu/README.md). Every bad input ends in one
line and exit status 2. receive, install and env use the standard library only until pip has installed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from pack import MIB, KitError, load_manifest, receive, split, write_manifest  # noqa: E402

REPO = HERE.parent.parent
CALL_MIB = 64  # the device tool's limit for one call: working tree + carried paths
GPU_MODULES = ("onnxruntime_genai,lm_eval,lm_eval.models.huggingface,lm_eval.models.onnxruntime_genai,datasets,"
               "evaluate,ortevals.integrations.lm")
STAGE = ".gpukit"


def tree_bytes(repo: Path) -> int:
    """Bytes of what the device tool sends from ``repo``: tracked and untracked-not-ignored files, shared/."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=repo, capture_output=True)
    if out.returncode != 0:
        raise KitError(f"{repo}: not a git checkout ({out.stderr.decode().strip()[:120]})")
    files = [repo / f for f in out.stdout.decode().split("\0") if f]
    shared = repo / "shared"
    if shared.is_dir():
        files += [p for p in shared.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())


def default_part_mib(repo: Path) -> int:
    tree = tree_bytes(repo) / MIB
    part = min(60, int(CALL_MIB - tree - 2))  # 2 MiB for the tree growing a little before the transfer
    if part < 8:
        raise KitError(f"{repo}: the working tree already takes {tree:.1f} of the {CALL_MIB} MiB a call carries")
    return part


def cmd_prepare(args) -> None:
    from resolve import ROOTS, build_ortevals, canon, download, installed_versions, read_box, resolve

    kind = "cpu-rehearsal" if args.cpu_rehearsal else "gpu"
    py = args.python_version or ("3.12" if kind == "gpu" else f"{sys.version_info[0]}.{sys.version_info[1]}")
    box = read_box(args.box)
    if kind == "cpu-rehearsal":  # the rehearsal's box is this machine, limited to the box's names
        box = {n: v for n, v in installed_versions(box).items() if v}
    args.dir.mkdir(parents=True, exist_ok=True)
    local = args.dir / "built"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir()
    wheel, commit = build_ortevals(args.repo, local)
    roots = [*ROOTS[kind], "ortevals==" + wheel.name.split("-")[1]]
    root_names = {canon(r.split("==")[0]) for r in roots}
    pins = {n: v for n, v in box.items() if v and n not in root_names}
    print(f"resolving {' '.join(roots)} for cp{py.replace('.', '')} manylinux x86-64 …", flush=True)
    entries = resolve(roots, pins, local, py)
    kit = [e for e in entries if canon(e["metadata"]["name"]) not in box or canon(e["metadata"]["name"]) in root_names]
    print(f"{len(entries)} wheels resolved, {len(kit)} missing on the box: downloading …", flush=True)
    shutil.rmtree(args.dir / "wheels", ignore_errors=True)
    wheels = download(kit, local, args.dir / "wheels", py)
    meta = {"kind": kind, "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "python_version": py, "roots": roots, "ortevals_commit": commit, "box_list": args.box.name,
            "resolved_on_box": sorted(f"{e['metadata']['name']}=={e['metadata']['version']}" for e in entries
                                      if e not in kit)}
    write_manifest(args.dir, {**meta, "wheels": wheels, "parts": []})
    args.part_mib = args.part_mib or default_part_mib(args.repo)
    cmd_split(args)


def cmd_split(args) -> None:
    manifest = load_manifest(args.dir)
    part_mib = args.part_mib or default_part_mib(args.repo)
    if not 1 <= part_mib <= 60:
        raise KitError(f"--part-mib must be between 1 and 60, got {part_mib}")
    wheels, parts = split(manifest["wheels"], args.dir / "wheels", args.dir, part_mib * MIB)
    manifest.update(wheels=wheels, parts=parts, part_mib=part_mib,
                    calls=[{"call": p["call"], "parts": [p["file"]], "bytes": p["bytes"]} for p in parts])
    manifest.pop("format")
    write_manifest(args.dir, manifest)
    total = sum(w["bytes"] for w in wheels)
    print(f"{len(wheels)} wheels, {total / MIB:.1f} MiB in {len(parts)} parts of at most {part_mib} MiB "
          f"= {len(parts)} device calls; manifest {args.dir / 'manifest.json'}")


def cmd_stage(args) -> None:
    """Copy each part into ``REPO/.gpukit/cNN/`` (git-ignored through .git/info/exclude) and print the calls."""
    manifest = load_manifest(args.dir)
    tree = tree_bytes(args.repo)
    stage = args.repo / STAGE
    shutil.rmtree(stage, ignore_errors=True)
    exclude = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=args.repo,
                                  capture_output=True, text=True).stdout.strip())
    exclude = exclude if exclude.is_absolute() else args.repo / exclude
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if f"/{STAGE}/" not in (exclude.read_text().split() if exclude.is_file() else []):
        with open(exclude, "a") as f:
            f.write(f"/{STAGE}/\n")
    for part in manifest["parts"]:
        size = (tree + part["bytes"]) / MIB
        if size > CALL_MIB:
            raise KitError(f"call {part['call']} would carry {size:.1f} MiB (tree {tree / MIB:.1f} + part): "
                           f"re-split with 'kit.py split {args.dir} --part-mib {int(CALL_MIB - tree / MIB - 1)}'")
        folder = stage / f"c{part['call']:02d}"
        folder.mkdir(parents=True)
        shutil.copyfile(args.dir / part["file"], folder / part["file"])
        shutil.copyfile(args.dir / "manifest.json", folder / "manifest.json")
    print(f"working tree {tree / MIB:.1f} MiB; {len(manifest['parts'])} calls, each carrying one folder:")
    for part in manifest["parts"]:
        c = f"{STAGE}/c{part['call']:02d}"
        print(f"  call {part['call']}: carry=[\"{c}\"]  command: python3 scripts/gpu/kit.py receive {c} /root/kit")


def cmd_receive(args) -> None:
    have = receive(args.src, args.dest)
    total = len(load_manifest(args.dest)["parts"])
    print(f"{args.dest}: parts {', '.join(p[5:7] for p in have)} of {total} received and checked")


def nvidia_dir(target: Path) -> Path | None:
    """The site-packages ``nvidia`` folder (the CUDA and cuDNN libraries of torch's wheels) outside ``target``."""
    from importlib import util

    spec = util.find_spec("nvidia")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc).resolve()
        if not path.is_relative_to(target.resolve()) and nvidia_libs(path):
            return path
    return None


def nvidia_libs(nvidia: Path) -> list[Path]:
    """Its library folders: ``cu13/lib`` and ``cudnn/lib`` (CUDA 13's layout) or one per component (CUDA 12's)."""
    return sorted({p.parent for p in nvidia.glob("*/lib/lib*.so*")})


def cmd_install(args) -> None:
    from pack import join

    manifest = load_manifest(args.dir)
    wheels = join(args.dir, manifest, args.dir / "wheels")
    args.target.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--upgrade", "--target", str(args.target), *map(str, wheels)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
        raise KitError(f"pip install --target {args.target} failed: {tail[0]}")
    nvidia = nvidia_dir(args.target)
    if nvidia and not (args.target / "nvidia").exists():  # preload_dlls() looks beside the onnxruntime package
        (args.target / "nvidia").symlink_to(nvidia, target_is_directory=True)
    modules = GPU_MODULES if args.modules is None else args.modules
    cmd = [sys.executable, *(["-S"] if args.no_site else []), str(HERE / "verify.py"), "--target", str(args.target),
           "--expect-provider", args.expect_provider, "--modules", modules]
    path = os.pathsep.join(filter(None, [str(args.target), os.environ.get("PYTHONPATH")]))
    check = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    line = next((ln for ln in check.stdout.splitlines() if ln.startswith("VERIFY ")), None)
    if check.returncode != 0 or line is None:
        err = [ln for ln in check.stderr.splitlines() if ln.strip()][-1:] or ["verify printed nothing"]
        raise KitError(f"installed into {args.target}, but the check failed: {err[0].removeprefix('error: ')}")
    (args.target / "kit-install.json").write_text(line[7:] + "\n")
    print(f"installed {len(wheels)} wheels into {args.target}" + (f" (nvidia -> {nvidia})" if nvidia else ""))
    print(line)


def cmd_env(args) -> None:
    """Shell lines for later commands: the target first on PYTHONPATH, the nvidia libraries on LD_LIBRARY_PATH."""
    lines = [f"export PYTHONPATH={args.target}${{PYTHONPATH:+:$PYTHONPATH}}"]
    nvidia = nvidia_dir(args.target)
    if nvidia:
        libs = ":".join(map(str, nvidia_libs(nvidia)))
        lines.append(f"export LD_LIBRARY_PATH={libs}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}")
    print("\n".join(lines))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="resolve, download and split the wheels the box lacks (needs PyPI)")
    p.add_argument("dir", type=Path)
    p.add_argument("--cpu-rehearsal", action="store_true", help="CPU wheels for this machine's python instead")
    p.add_argument("--python-version", default=None, help="the box's python (default 3.12; rehearsal: this one)")
    p.add_argument("--box", type=Path, default=HERE / "box_packages.txt", help="what the box already has")
    p.add_argument("--part-mib", type=int, default=None, help="part size (default: 64 MiB - working tree - 2)")
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose tree travels with each call")
    p = sub.add_parser("split", help="cut the downloaded wheels into parts again (another part size)")
    p.add_argument("dir", type=Path)
    p.add_argument("--part-mib", type=int, default=None)
    p.add_argument("--repo", type=Path, default=REPO)
    p = sub.add_parser("stage", help="one git-ignored folder per device call in the checkout (REPO/.gpukit/cNN)")
    p.add_argument("dir", type=Path)
    p.add_argument("--repo", type=Path, default=REPO)
    p = sub.add_parser("receive", help="on the box: copy one call's part(s) to DEST and check them")
    p.add_argument("src", type=Path)
    p.add_argument("dest", type=Path)
    p = sub.add_parser("install", help="on the box: join, check, pip install --target, prove the provider")
    p.add_argument("dir", type=Path)
    p.add_argument("--target", type=Path, default=Path("/root/site"))
    p.add_argument("--expect-provider", default="CUDAExecutionProvider")
    p.add_argument("--modules", default=None, help=f"modules that must import (default: {GPU_MODULES})")
    p.add_argument("--no-site", action="store_true", help="check with 'python -S' (no site-packages but PYTHONPATH)")
    p = sub.add_parser("env", help="print the PYTHONPATH / LD_LIBRARY_PATH exports for the installed target")
    p.add_argument("--target", type=Path, default=Path("/root/site"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        {"prepare": cmd_prepare, "split": cmd_split, "stage": cmd_stage, "receive": cmd_receive,
         "install": cmd_install, "env": cmd_env}[args.cmd](args)
    except KitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
