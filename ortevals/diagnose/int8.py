"""``ortevals diagnose --int8 PKG``: int8 as a cheaper choice for a weight group than the reference's precision.

Owns the int8 donor (the builder's ``-p int8`` export of the same checkpoint: every ``MatMulNBits`` of 8 bits,
checked to be the same model as the candidate), the naming of a group at int8 (``layers.29.down@int8``, its
nodes ``…/MatMul@int8``), and the derived package of a mixed set: the groups at the reference's precision
swapped in from the reference, then the groups at int8 swapped in from the donor
(:func:`ortevals.runtime.swap.swapped_package`, a copy of the donor's ``MatMulNBits``: bit for bit what the
builder's per-node int8 override exports), with the bytes both add. An int8 group costs about 4 bits a weight
over int4 where the reference's fp32 costs about 28, so the greedy (:func:`ortevals.diagnose.stats.greedy_steps`,
one choice per group) can buy about seven times as many groups with the same budget.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ortevals.errors import OrtEvalsError
from ortevals.package.loader import ModelPackage
from ortevals.runtime.roles import Unit
from ortevals.runtime.swap import size_delta, swapped_package

MARK = "@int8"


def split(nodes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(nodes at the reference's precision, nodes at int8, without the mark)."""
    return (tuple(n for n in nodes if not n.endswith(MARK)),
            tuple(n.removesuffix(MARK) for n in nodes if n.endswith(MARK)))


def at_int8(unit: Unit) -> Unit:
    """The group ``unit`` at int8: its name and nodes marked."""
    return replace(unit, name=unit.name + MARK, nodes=tuple(n + MARK for n in unit.nodes))


def base(unit_name: str) -> str:
    """The group a (possibly int8) unit name is of."""
    return unit_name.removesuffix(MARK)


def check_donor(cand: ModelPackage, path: Path) -> ModelPackage:
    """The ``--int8`` package, loaded and checked: the candidate's model, its quantized weights all 8-bit."""
    import onnx

    from ortevals.diagnose.inputs import check_pair

    donor = _load_donor(path)
    graph = onnx.load(str(donor.decoder.path), load_external_data=False).graph
    bits = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    if bits != {8}:
        raise OrtEvalsError(f"--int8 {donor.root}: expected the builder's int8 export (every MatMulNBits of 8 bits), "
                            f"found {'bits ' + ', '.join(map(str, sorted(bits))) if bits else 'no MatMulNBits'}")
    try:
        check_pair(cand, donor, quantized_ok=True)
    except OrtEvalsError as e:
        raise OrtEvalsError(f"--int8 {donor.root}: {e}") from None
    return donor


def _load_donor(path: Path) -> ModelPackage:
    """The ``--int8`` folder as a package, or one line naming ``--int8`` and what it should be."""
    root = Path(path).expanduser()
    build = "`python -m onnxruntime_genai.models.builder -i {} -o OUT -p int8 -e cpu`"
    if not root.is_dir():
        raise OrtEvalsError(f"--int8 {path}: no such folder; expected the builder's int8 export of the model "
                            f"({build.format('HF_DIR')})")
    try:
        return ModelPackage.load(root)
    except OrtEvalsError as e:
        if (root / "config.json").is_file():
            raise OrtEvalsError(f"--int8 {path}: a transformers checkpoint; expected the builder's int8 export of it: "
                                f"{build.format(path)}, then --int8 OUT") from None
        raise OrtEvalsError(f"--int8 {path}: {e}") from None


def mixed_package(cand: ModelPackage, ref: ModelPackage, donor: ModelPackage | None, nodes: tuple[str, ...],
                  cache: Path) -> Path:
    """The derived candidate with ``nodes`` at the reference's precision, or at int8 where marked."""
    full, eight = split(nodes)
    folder = swapped_package(cand, ref, full, cache) if full else cand.root
    if eight:
        if donor is None:
            raise OrtEvalsError(f"{eight[0]} at int8 needs --int8 (the builder's int8 export of the model)")
        folder = swapped_package(ModelPackage.load(folder), donor, eight, cache)
    return folder


def bytes_added(cand: ModelPackage, ref: ModelPackage, donor: ModelPackage | None, nodes: tuple[str, ...]) -> int:
    """Bytes ``nodes`` add to the candidate (each at its precision)."""
    full, eight = split(nodes)
    return (size_delta(cand, ref, full) if full else 0) + (size_delta(cand, donor, eight) if eight else 0)
