"""``decoder-pipeline`` packages (Olive's QNN/NPU exports): ``model.decoder.pipeline[]`` stages, no decoder file.

onnxruntime-genai runs such a package stage by stage (embeddings, the transformer split into context and
iterator graphs, often compiled into ``EPContext`` nodes for one NPU provider, the LM head). ortevals' sessions
score one decoder graph and its onnxruntime-genai path opens a single decoder, so a pipeline package is refused
at load in one line (:func:`refuse_pipeline`) naming its stages and the one that blocks: a stage compiled into
an ``EPContext`` node runs only on the provider it was compiled for (its ``source``), and otherwise the stage
split itself. Reads the stages' protobufs (no weights); no runtime.
"""

from __future__ import annotations

from pathlib import Path

from ortevals.errors import PackageError
from ortevals.package.config import CONFIG_NAME, resolve_inside


def refuse_pipeline(root: Path, section: dict) -> None:
    """Raise the one-line refusal for a decoder section with ``pipeline`` stages; return where there are none."""
    stages = section.get("pipeline")
    if not stages or section.get("filename"):
        return
    where = root / CONFIG_NAME
    if not isinstance(stages, list) or not all(isinstance(s, dict) and len(s) == 1 for s in stages):
        raise PackageError(f"{where}: field model.decoder.pipeline must be a list of {{stage name: {{filename, ...}}}} "
                           f"objects, got {stages!r}")
    names = [next(iter(s)) for s in stages]
    blocking = next(((n, ep) for n, body in (next(iter(s.items())) for s in stages)
                     if (ep := _compiled_for(root, n, body)) is not None), None)
    why = (f"stage {blocking[0]!r} is an EPContext node compiled for {blocking[1]}, which runs only on that provider"
           if blocking else "its transformer is split into stages that no single decoder graph holds")
    raise PackageError(f"{where}: model.decoder.pipeline has {len(names)} stages ({', '.join(names)}) and no "
                       f"model.decoder.filename: a decoder-pipeline package (Olive's QNN/NPU export), which ortevals "
                       f"does not score ({why}); run it with onnxruntime-genai, or export a single-decoder package "
                       "(the onnxruntime-genai builder, Olive's ModelBuilder) to score it here")


def _compiled_for(root: Path, name: str, body) -> str | None:
    """The provider a stage's EPContext node was compiled for (its ``source``), None for a plain graph."""
    import onnx

    filename = body.get("filename") if isinstance(body, dict) else None
    path = resolve_inside(root, filename, f"model.decoder.pipeline.{name}.filename")
    if not path.is_file():
        raise PackageError(f"{root / CONFIG_NAME}: model.decoder.pipeline.{name}.filename={filename!r} not found in "
                           f"{root}")
    graph = onnx.load(str(path), load_external_data=False).graph
    for node in graph.node:
        if node.op_type == "EPContext":
            source = next((a.s.decode() for a in node.attribute if a.name == "source"), "")
            return source or "another execution provider"
    return None
