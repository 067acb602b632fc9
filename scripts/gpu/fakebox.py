#!/usr/bin/env python
"""A stand-in for the GPU machine's site-packages, for the CPU rehearsal of the kit.

    python scripts/gpu/fakebox.py /tmp/fakebox        # then: PYTHONPATH=TARGET:/tmp/fakebox python -S …

Links (symlinks) into DEST every package of this interpreter whose name is on the box's list
(``box_packages.txt``), with its dist-info, and nothing else: a python started with ``-S`` and
``PYTHONPATH=TARGET:DEST`` sees what the box would see, so a wheel the kit forgot fails here too instead
of being found in this machine's site-packages. Versions are this machine's, not the box's.
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


def link(dest: Path, box: dict) -> tuple[list[str], list[str]]:
    """Fill ``dest``; returns (linked distributions, box names this interpreter lacks)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    linked, seen = [], set()
    for dist in metadata.distributions():
        name = canon(dist.metadata["Name"] or "")
        if name not in box or name in seen:
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
    args = ap.parse_args()
    linked, lacking = link(args.dest, read_box(args.box))
    print(f"{args.dest}: {len(linked)} of the box's packages linked; this machine lacks {len(lacking)} "
          f"(the box has them, the rehearsal does not): {' '.join(lacking)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
