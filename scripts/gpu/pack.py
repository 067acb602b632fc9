"""The kit's parts: wheels cut into parts that each fit one device call, the manifest, and the join.

Every wheel is laid end to end in one byte stream (in the manifest's order) and the stream is cut every
``part_bytes``, so the transfer takes ceil(total / part_bytes) calls and no call travels half empty. Packed
(``kit.py split --pack xz``), each wheel travels LZMA-compressed and is unpacked after the join (lzma is in
the standard library). The manifest (``manifest.json`` beside the parts) gives each wheel's sha256 and
where its bytes lie (part, offset, length, in order), each part's sha256 and the device call that carries it.

Standard library only: this runs on the GPU machine's python before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1
MIB = 1 << 20


class KitError(Exception):
    """A one-line user error: the CLI prints it and exits 2."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MIB):
            h.update(chunk)
    return h.hexdigest()


def part_name(i: int) -> str:
    return f"part-{i:02d}.bin"


def xz(wheel_dir: Path, w: dict) -> dict:
    """``wheel_dir/<file>.xz`` (made once, LZMA preset 6) as a manifest entry: file, sha256, bytes."""
    packed = wheel_dir / (w["file"] + ".xz")
    if not packed.is_file() or packed.stat().st_mtime < (wheel_dir / w["file"]).stat().st_mtime:
        tmp = packed.with_suffix(".xz.tmp")
        with open(wheel_dir / w["file"], "rb") as src, lzma.open(tmp, "wb", preset=6) as dst:
            shutil.copyfileobj(src, dst, 4 * MIB)
        tmp.replace(packed)
    return {"file": packed.name, "sha256": sha256(packed), "bytes": packed.stat().st_size}


def split(wheels: list[dict], wheel_dir: Path, out: Path, part_bytes: int,
          pack: bool = False) -> tuple[list[dict], list[dict]]:
    """Cut the wheels (``{"file", "sha256", ...}`` dicts, in order) into ``out/part-NN.bin``; with ``pack``
    each wheel travels xz-compressed (``packed``: its .xz file's name, sha256 and size).

    Returns ``(wheels, parts)``: the wheel dicts with their ``pieces`` added and the parts' dicts."""
    if part_bytes < MIB:
        raise KitError(f"part size must be at least 1 MiB, got {part_bytes} bytes")
    for old in out.glob("part-*.bin"):
        old.unlink()
    parts, current, filled = [], None, part_bytes
    placed = []
    for w in wheels:
        w = {k: v for k, v in w.items() if k not in ("pieces", "packed")}
        if pack:
            w["packed"] = xz(wheel_dir, w)
        name = w["packed"]["file"] if pack else w["file"]
        pieces, left = [], (wheel_dir / name).stat().st_size
        with open(wheel_dir / name, "rb") as src:
            while left:
                if filled == part_bytes:
                    if current:
                        current.close()
                    parts.append(part_name(len(parts) + 1))
                    current, filled = open(out / parts[-1], "wb"), 0
                n = min(left, part_bytes - filled)
                pieces.append({"part": parts[-1], "offset": filled, "bytes": n})
                current.write(src.read(n))
                filled, left = filled + n, left - n
        placed.append({**w, "pieces": pieces})
    if current:
        current.close()
    part_info = [{"file": p, "sha256": sha256(out / p), "bytes": (out / p).stat().st_size, "call": i + 1}
                 for i, p in enumerate(parts)]
    return placed, part_info


def write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **manifest}, indent=1) + "\n")
    tmp.replace(out / MANIFEST)


def load_manifest(kit: Path) -> dict:
    path = kit / MANIFEST
    if not path.is_file():
        raise KitError(f"{path}: no manifest (expected the {MANIFEST} that 'kit.py prepare' writes)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise KitError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise KitError(f"{path}: field 'format' must be {FORMAT}, got {manifest.get('format')!r}")
    for field in ("wheels", "parts"):
        if not isinstance(manifest.get(field), list):
            raise KitError(f"{path}: field {field!r} must be a list")
    return manifest


def check_part(path: Path, entry: dict) -> None:
    got = sha256(path)
    if got != entry["sha256"]:
        raise KitError(f"{path}: bad sha256 {got[:16]}…, the manifest says {entry['sha256'][:16]}… "
                       f"(re-send call {entry['call']})")


def receive(src: Path, dest: Path) -> list[str]:
    """Copy the parts in ``src`` (and its manifest) to ``dest``, each checked; returns the parts now in ``dest``."""
    manifest = load_manifest(src)
    dest.mkdir(parents=True, exist_ok=True)
    by_name = {p["file"]: p for p in manifest["parts"]}
    for path in sorted(src.glob("part-*.bin")):
        if path.name not in by_name:
            raise KitError(f"{path}: not a part of this kit's manifest")
        check_part(path, by_name[path.name])
        shutil.copyfile(path, dest / path.name)
    shutil.copyfile(src / MANIFEST, dest / MANIFEST)
    return sorted(p.name for p in dest.glob("part-*.bin"))


def join(kit: Path, manifest: dict, wheel_dir: Path) -> list[Path]:
    """Every wheel of the manifest under ``wheel_dir``, checked: a whole wheel already there with the right
    sha256 is kept, the others are joined from their parts (each part checked first)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    parts = {p["file"]: p for p in manifest["parts"]}
    need = [w for w in manifest["wheels"] if not _whole(wheel_dir / w["file"], w)]
    wanted = sorted({piece["part"] for w in need for piece in w["pieces"]})
    missing = [p for p in wanted if not (kit / p).is_file()]
    if missing:
        calls = ", ".join(str(parts[p]["call"]) for p in missing)
        raise KitError(f"{kit}: missing {len(missing)} of {len(parts)} parts: {', '.join(missing)} "
                       f"(send call(s) {calls} again)")
    for p in wanted:
        check_part(kit / p, parts[p])
    for w in need:
        tmp = wheel_dir / (w["file"] + ".part")
        packed = w.get("packed")
        joined = tmp.with_name(w["file"] + ".xz.part") if packed else tmp
        with open(joined, "wb") as out:
            for piece in w["pieces"]:
                with open(kit / piece["part"], "rb") as src:
                    src.seek(piece["offset"])
                    out.write(src.read(piece["bytes"]))
        if packed:  # the compressed bytes were checked with their parts; their sha256 too, then unpacked
            if sha256(joined) != packed["sha256"]:
                joined.unlink()
                raise KitError(f"{packed['file']}: bad sha256 after joining (the manifest says "
                               f"{packed['sha256'][:16]}…)")
            with lzma.open(joined, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 4 * MIB)
            joined.unlink()
        got = sha256(tmp)
        if got != w["sha256"]:
            tmp.unlink()
            raise KitError(f"{w['file']}: bad sha256 after joining ({got[:16]}…, the manifest says "
                           f"{w['sha256'][:16]}…)")
        tmp.replace(wheel_dir / w["file"])
    return [wheel_dir / w["file"] for w in manifest["wheels"]]


def _whole(path: Path, wheel: dict) -> bool:
    return path.is_file() and path.stat().st_size == wheel["bytes"] and sha256(path) == wheel["sha256"]
