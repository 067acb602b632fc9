#!/usr/bin/env python
"""The GPU kit: the wheels an offline GPU machine lacks, carried in parts through the device tool.

    python scripts/gpu/kit.py prepare /work/gpu-kit            # here: resolve, download, split (manifest.json)
    python scripts/gpu/kit.py calls                            # here: transfer calls beside this working tree
    python scripts/gpu/kit.py stage /work/gpu-kit              # here: one ignored folder per device call
    python3 scripts/gpu/kit.py receive .gpukit/c01 /root/kit   # there, once per call: copy + check the part
    python3 scripts/gpu/kit.py install /root/kit --target /root/site --expect-provider CUDAExecutionProvider
    eval "$(python3 scripts/gpu/kit.py env --target /root/site)"   # PYTHONPATH and LD_LIBRARY_PATH for later commands

The wheels are cut into parts as large as a call allows beside the working tree (``stage`` cuts them again
for the tree it stages from) and travel xz-compressed where that saves a call over five (``--pack``).
``install`` checks the result with the environment ``env`` exports, including one token of
onnxruntime-genai's Generator on a tiny package built there (scripts/gpu/tinypkg.py).
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
TARGET_CALLS = 5  # the 15-minute plan's transfer (scripts/gpu/README.md)
# the GPU kit as prepared on 2026-11-27 (23 wheels; onnxruntime-gpu 1.31.1 is 243.7 MiB of it), plain and with
# each wheel xz-compressed (LZMA preset 6): what 'kit.py calls' plans with when no kit folder is given
MEASURED_KIT = {"plain": 289_395_253, "xz": 247_375_816}


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
    return part_mib_for(tree_bytes(repo), repo)


def part_mib_for(tree: int, repo: Path | str = "the checkout") -> int:
    """The largest part (whole MiB, at most 60) a call can carry beside ``tree`` bytes of working tree."""
    part = min(60, int(CALL_MIB - tree / MIB - 2))  # 2 MiB for the tree growing a little before the transfer
    if part < 8:
        raise KitError(f"{repo}: the working tree already takes {tree / MIB:.1f} of the {CALL_MIB} MiB a call carries")
    return part


def calls_for(total_bytes: int, part_mib: int) -> int:
    """Transfer calls for ``total_bytes`` of wheels cut every ``part_mib`` MiB (pack.split)."""
    return -(-total_bytes // (part_mib * MIB))


def choose_pack(manifest: dict, wheel_dir: Path, part_mib: int, pack: str) -> bool:
    """``xz``: pack; ``none``: not; ``auto``: pack only where plain parts would take more than
    :data:`TARGET_CALLS` calls and xz takes fewer (it costs a few seconds of unpacking on the box)."""
    if pack != "auto":
        return pack == "xz"
    plain = calls_for(sum(w["bytes"] for w in manifest["wheels"]), part_mib)
    if plain <= TARGET_CALLS:
        return False
    from pack import xz

    packed = calls_for(sum(xz(wheel_dir, w)["bytes"] for w in manifest["wheels"]), part_mib)
    print(f"plain: {plain} calls, xz: {packed} calls at {part_mib} MiB a part", flush=True)
    return packed < plain


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
    pack = choose_pack(manifest, args.dir / "wheels", part_mib, getattr(args, "pack", "auto"))
    wheels, parts = split(manifest["wheels"], args.dir / "wheels", args.dir, part_mib * MIB, pack)
    manifest.update(wheels=wheels, parts=parts, part_mib=part_mib, pack="xz" if pack else "none",
                    calls=[{"call": p["call"], "parts": [p["file"]], "bytes": p["bytes"]} for p in parts])
    manifest.pop("format")
    write_manifest(args.dir, manifest)
    total = sum(w["bytes"] for w in wheels)
    sent = sum(p["bytes"] for p in parts)
    print(f"{len(wheels)} wheels, {total / MIB:.1f} MiB" + (f" ({sent / MIB:.1f} MiB with xz)" if pack else "") +
          f" in {len(parts)} parts of at most {part_mib} MiB = {len(parts)} device calls; "
          f"manifest {args.dir / 'manifest.json'}")


def cmd_stage(args) -> None:
    """Copy each part into ``REPO/.gpukit/cNN/`` (git-ignored through .git/info/exclude) and print the calls.
    Where the wheels are at hand and this tree leaves room for larger parts, the kit is cut again first."""
    manifest = load_manifest(args.dir)
    same_code(manifest, args.dir, args.repo)
    tree = tree_bytes(args.repo)
    best = default_part_mib(args.repo)
    if (args.dir / "wheels").is_dir() and manifest.get("part_mib") != best and not args.keep_parts:
        print(f"working tree {tree / MIB:.1f} MiB: parts of {best} MiB (were {manifest.get('part_mib')})", flush=True)
        cmd_split(argparse.Namespace(dir=args.dir, part_mib=best, repo=args.repo, pack="auto"))
        manifest = load_manifest(args.dir)
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
    print(f"working tree {tree / MIB:.1f} MiB + parts of at most {manifest.get('part_mib')} MiB"
          f"{' (xz)' if manifest.get('pack') == 'xz' else ''}: {len(manifest['parts'])} transfer calls, "
          "each carrying one folder:")
    for part in manifest["parts"]:
        c = f"{STAGE}/c{part['call']:02d}"
        print(f"  call {part['call']}: carry=[\"{c}\"]  command: python3 scripts/gpu/kit.py receive {c} /root/kit")


def same_code(manifest: dict, kit_dir: Path, repo: Path) -> None:
    """The box imports ortevals from the kit's wheel, and runs the scripts of the tree that travels: both must be
    this checkout's committed HEAD, or the GPU run measures other code than the one it is reported for."""
    def git(*cmd: str) -> str:  # porcelain lines start with a status column that may be blank: no strip
        return subprocess.run(["git", *cmd], cwd=repo, capture_output=True, text=True).stdout

    head, built = git("rev-parse", "HEAD").strip(), manifest.get("ortevals_commit") or ""
    if built != head:
        raise KitError(f"{kit_dir / 'manifest.json'}: its ortevals wheel was built from commit "
                       f"{built[:7] or '(none recorded)'}, {repo} is at {head[:7]}: the box would run that code; "
                       f"run 'python scripts/gpu/kit.py prepare {kit_dir}' again")
    changed = git("status", "--porcelain", "--", "ortevals", "scripts", "pyproject.toml").splitlines()
    if changed:
        raise KitError(f"{repo}: {len(changed)} uncommitted change(s) under ortevals/, scripts/ or pyproject.toml "
                       f"(e.g. {changed[0][3:]}): the kit's wheel holds HEAD's code; commit, then prepare again")


def cmd_calls(args) -> None:
    """How many transfer calls the kit takes beside this working tree, plain and with xz (no data read: the
    kit's sizes come from its manifest, or the GPU kit's measured ones)."""
    tree = tree_bytes(args.repo)
    part = part_mib_for(tree, args.repo)
    plain, packed = MEASURED_KIT["plain"], MEASURED_KIT["xz"]
    if args.dir is not None:
        manifest = load_manifest(args.dir)
        plain = sum(w["bytes"] for w in manifest["wheels"])
        packed = sum(w["packed"]["bytes"] for w in manifest["wheels"]) if manifest.get("pack") == "xz" else None
    print(f"working tree {tree / MIB:.1f} MiB, parts of {part} MiB: kit {plain / MIB:.1f} MiB = "
          f"{calls_for(plain, part)} transfer calls" +
          (f"; {packed / MIB:.1f} MiB with xz = {calls_for(packed, part)} calls" if packed else ""))


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
    python = [sys.executable, *(["-S"] if args.no_site else [])]
    env = {**os.environ, **env_vars(args.target)}  # exactly what 'kit.py env' exports for later commands
    cmd = [*python, str(HERE / "verify.py"), "--target", str(args.target), "--expect-provider", args.expect_provider,
           "--modules", modules]
    if (args.target / "onnxruntime_genai").is_dir() and not args.no_og_check:
        cmd += ["--og-package", str(tiny_package(python, args.target, args.expect_provider, env))]
    check = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in check.stdout.splitlines() if ln.startswith("VERIFY ")), None)
    if check.returncode != 0 or line is None:
        err = [ln for ln in check.stderr.splitlines() if ln.strip()][-1:] or ["verify printed nothing"]
        raise KitError(f"installed into {args.target}, but the check failed: {err[0].removeprefix('error: ')}")
    (args.target / "kit-install.json").write_text(line[7:] + "\n")
    print(f"installed {len(wheels)} wheels into {args.target}" + (f" (nvidia -> {nvidia})" if nvidia else ""))
    print(line)


def tiny_package(python: list[str], target: Path, provider: str, env: dict) -> Path:
    """The tiny package onnxruntime-genai's install check runs (scripts/gpu/tinypkg.py), built with the
    kit's builder: fp16 for CUDA, fp32 for the CPU."""
    precision, ep = ("fp16", "cuda") if provider == "CUDAExecutionProvider" else ("fp32", "cpu")
    proc = subprocess.run([*python, str(HERE / "tinypkg.py"), str(target / ".kit-tiny"), "--precision", precision,
                           "--ep", ep], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
        raise KitError(f"installed into {target}, but the tiny package for the Generator check failed: "
                       f"{tail[0].removeprefix('error: ')}")
    return Path(proc.stdout.strip().splitlines()[-1])


def env_vars(target: Path) -> dict[str, str]:
    """PYTHONPATH with the target first, and LD_LIBRARY_PATH with the box's nvidia libraries (CUDA 13,
    cuDNN) first where there are any: what later commands export (``kit.py env``) and what install checks with."""
    out = {"PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    nvidia = nvidia_dir(target)
    if nvidia:
        out["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [*map(str, nvidia_libs(nvidia)),
                                                                os.environ.get("LD_LIBRARY_PATH")]))
    return out


def cmd_env(args) -> None:
    """Shell lines for later commands: the target first on PYTHONPATH, the nvidia libraries on LD_LIBRARY_PATH
    (the values :func:`env_vars` gives install's own check)."""
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
    p.add_argument("--pack", choices=["auto", "xz", "none"], default="auto",
                   help=f"xz-compress the wheels (auto: only where it saves a call over {TARGET_CALLS})")
    p = sub.add_parser("split", help="cut the downloaded wheels into parts again (another part size)")
    p.add_argument("dir", type=Path)
    p.add_argument("--part-mib", type=int, default=None)
    p.add_argument("--repo", type=Path, default=REPO)
    p.add_argument("--pack", choices=["auto", "xz", "none"], default="auto")
    p = sub.add_parser("stage", help="one git-ignored folder per device call in the checkout (REPO/.gpukit/cNN)")
    p.add_argument("dir", type=Path)
    p.add_argument("--repo", type=Path, default=REPO)
    p.add_argument("--keep-parts", action="store_true", help="stage the parts as cut (no re-split for this tree)")
    p = sub.add_parser("calls", help="transfer calls the kit takes beside this working tree (plain and xz)")
    p.add_argument("dir", type=Path, nargs="?", default=None, help="a kit folder (default: the measured GPU kit)")
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
    p.add_argument("--no-og-check", action="store_true", help="skip onnxruntime-genai's one-token Generator check")
    p = sub.add_parser("env", help="print the PYTHONPATH / LD_LIBRARY_PATH exports for the installed target")
    p.add_argument("--target", type=Path, default=Path("/root/site"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        {"prepare": cmd_prepare, "split": cmd_split, "stage": cmd_stage, "calls": cmd_calls, "receive": cmd_receive,
         "install": cmd_install, "env": cmd_env}[args.cmd](args)
    except KitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
