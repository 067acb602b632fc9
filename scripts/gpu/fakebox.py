#!/usr/bin/env python
"""A stand-in for the GPU machine's site-packages, for the CPU rehearsal of the kit.

    python scripts/gpu/fakebox.py /tmp/fakebox        # then: PYTHONPATH=TARGET:/tmp/fakebox python -S …

Links (symlinks) into DEST every package of this interpreter whose name is on the box's list
(``box_packages.txt``), with its dist-info, and nothing else: a python started with ``-S`` and
``PYTHONPATH=TARGET:DEST`` sees what the box would see, so a wheel the kit forgot fails here too instead
of being found in this machine's site-packages. Versions are this machine's, not the box's;
``--with-needs`` also links what those versions need beyond the box's list (a newer huggingface_hub here
needs httpx2; the box's own versions run without it), so the box's own code (torch, transformers) runs
in the rehearsal before the kit is installed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from resolve import canon, read_box  # noqa: E402


def needs(box: dict) -> set[str]:
    """Names this interpreter's versions of the box's packages require (transitively, no extras) that the
    box's list lacks: the box's own (older) versions do without them, this machine's do not (e.g.
    huggingface_hub here needs httpx2)."""
    from packaging.requirements import Requirement

    installed = {canon(d.metadata["Name"] or ""): d for d in metadata.distributions()}
    todo, found = [n for n in box if n in installed], set()
    while todo:
        for text in installed[todo.pop()].requires or []:
            req = Requirement(text)
            name = canon(req.name)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if name in installed and name not in box and name not in found:
                found.add(name)
                todo.append(name)
    return found


def link(dest: Path, box: dict, with_needs: bool = False) -> tuple[list[str], list[str]]:
    """Fill ``dest``; returns (linked distributions, box names this interpreter lacks)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    linked, seen = [], set()
    wanted = set(box) | (needs(box) if with_needs else set())
    for dist in metadata.distributions():
        name = canon(dist.metadata["Name"] or "")
        if name not in wanted or name in seen:
            continue
        seen.add(name)
        site = Path(dist.locate_file("")).resolve()
        tops = {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "bin", "__pycache__")}
        for top in tops:
            src = site / top
            if src.exists() and not (dest / top).exists():
                (dest / top).symlink_to(src, target_is_directory=src.is_dir())
        linked.append(name)
    return sorted(linked), sorted(set(box) - seen)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--box", type=Path, default=HERE / "box_packages.txt")
    ap.add_argument("--with-needs", action="store_true", help="also link what this machine's versions of the "
                                                                "box's packages need that the box's list lacks")
    args = ap.parse_args()
    box = read_box(args.box)
    linked, lacking = link(args.dest, box, args.with_needs)
    extra = sorted(set(linked) - set(box))
    print(f"{args.dest}: {len(linked) - len(extra)} of the box's packages linked"
          + (f", and {len(extra)} that this machine's versions of them need: {' '.join(extra)}" if extra else "")
          + f"; this machine lacks {len(lacking)} (the box has them, the rehearsal does not): {' '.join(lacking)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
