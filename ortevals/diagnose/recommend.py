"""How to build the recommended mixed-precision package: the builder's command line and the Olive pass.

Owns reading the candidate's quantization settings back from its graph (``MatMulNBits``'
``bits``, ``block_size``, ``accuracy_level``; zero points mean asymmetric; the quantizer's weight
names tell the default method from ``rtn``/``k_quant``, which the graph cannot tell apart) and
the provider from its ``genai_config.json``, and writing them with the excluded nodes as

* the onnxruntime-genai model builder's command:
  ``python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p int4 -e cpu --extra_options
  nodes_to_exclude=A,B …`` (the builder splits the value on commas; a setting the candidate was
  built with at the builder's default is left out);
* with groups at int8 (``diagnose --int8``), every per-node choice goes in the builder's ``--target_options``
  instead: ``{"quant_config": {"weights": {"op_types": [...], "overrides": [{"match": {"name": A}, "exclude":
  true}, {"match": {"name": B}, "type": "int8"}]}}}`` (builder 0.18 drops ``nodes_to_exclude`` when
  ``--target_options`` carries overrides, so both kinds are given there, and quantizes only MatMul there unless
  told the op types); no Olive pass is written for such a set (ortevals' pass hands the builder
  ``extra_options`` only);
* Olive's pass: ``{"type": "OrtEvalsModelBuilder", "precision": "int4", "extra_options":
  {"nodes_to_exclude": "A,B", …}}``. Olive's ``ModelBuilder`` hands ``extra_options`` to the
  builder as they are; ortevals' mended pass (:mod:`ortevals.integrations.olive_builder`) turns
  each into the same ``KEY=VALUE`` the command line passes. (Olive's own ``int4_nodes_to_exclude``
  list reaches builder 0.18 under a name it no longer reads, so it is not used.)
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from ortevals.diagnose.int8 import split
from ortevals.package.loader import ModelPackage

BUILDER = ("python", "-m", "onnxruntime_genai.models.builder")
# the builder's names for providers (its -e), from ortevals' short names
BUILDER_EP = {"cpu": "cpu", "cuda": "cuda", "dml": "dml", "webgpu": "webgpu", "nvtensorrtrtx": "NvTensorRtRtx"}


@dataclass(frozen=True)
class BuildSettings:
    """What the builder was (most likely) told for the candidate."""

    precision: str  # "int4", "int8"
    ep: str  # the builder's -e
    extra: tuple[str, ...]  # KEY=VALUE beyond the builder's defaults
    notes: tuple[str, ...]  # what the graph cannot say
    op_types: tuple[str, ...] = ("MatMul",)  # the ops quantized (Gather too: the tied int4 embedding table)


def build_settings(package: ModelPackage) -> BuildSettings:
    """The candidate's quantization settings, read from its decoder graph and its config."""
    import onnx

    from ortevals.runtime.graph_nodes import attrs
    from ortevals.runtime.providers import from_package

    graph = onnx.load(str(package.decoder.path), load_external_data=False).graph
    quant = [n for n in graph.node if n.op_type == "MatMulNBits"]
    ep_name = from_package(package.decoder.session_options, None).name
    ep = BUILDER_EP.get(ep_name, ep_name)
    if not quant:
        return BuildSettings("int4", ep, (), ("the candidate has no MatMulNBits nodes: its quantization settings "
                                              "cannot be read from the graph",))
    a = attrs(quant[0])
    bits, block, level = int(a.get("bits", 4)), int(a.get("block_size", 32)), int(a.get("accuracy_level", 0))
    extra = []
    if block != 32:
        extra.append(f"block_size={block}")
    if level != (4 if ep in ("cpu", "webgpu") else 0):
        extra.append(f"accuracy_level={level}")
    if any(len(n.input) > 3 and n.input[3] for n in quant):
        extra.append("is_symmetric=false")
    notes = []
    ops = ("MatMul", "Gather") if any(n.op_type == "GatherBlockQuantized" for n in graph.node) else ("MatMul",)
    if any("G" in n.input[1].rsplit("_Q", 1)[-1] for n in quant if "_Q" in n.input[1]):
        notes.append("the weights are named by the rtn/k_quant quantizer: add algo_config=rtn or algo_config=k_quant "
                     "as the candidate was built (the graph does not say which)")
    return BuildSettings(f"int{bits}", ep, tuple(extra), tuple(notes), ops)


def extra_options(settings: BuildSettings, nodes: tuple[str, ...]) -> list[str]:
    """The builder's ``--extra_options`` values: ``nodes_to_exclude=A,B`` first (none where groups are at int8:
    :func:`target_options` carries them), then the settings."""
    full, eight = split(nodes)
    return ([f"nodes_to_exclude={','.join(full)}"] if full and not eight else []) + list(settings.extra)


def target_options(settings: BuildSettings, nodes: tuple[str, ...]) -> list[str]:
    """``["--target_options", JSON]`` where groups are at int8 (module docstring), else ``[]``. The candidate's
    quantized op types go there too: without them the builder's structured path quantizes MatMul only, and a
    tied int4 embedding table (GatherBlockQuantized) comes out in fp32 (SmolLM2: +118 MB)."""
    full, eight = split(nodes)
    if not eight:
        return []
    overrides = [{"match": {"name": n}, "exclude": True} for n in full] + \
        [{"match": {"name": n}, "type": "int8"} for n in eight]
    weights = {"op_types": list(settings.op_types), "overrides": overrides}
    return ["--target_options", json.dumps({"quant_config": {"weights": weights}}, separators=(",", ":"))]


def builder_command(settings: BuildSettings, nodes: tuple[str, ...], checkpoint: str | None, out: str) -> list[str]:
    """The builder's command line as a list of arguments."""
    cmd = [*BUILDER, "-i", checkpoint or "HF_DIR", "-o", out, "-p", settings.precision, "-e", settings.ep]
    extra = extra_options(settings, nodes)
    return cmd + (["--extra_options", *extra] if extra else []) + target_options(settings, nodes)


def shell(cmd: list[str]) -> str:
    """A command list as one shell line."""
    return " ".join(shlex.quote(c) for c in cmd)


def olive_pass(settings: BuildSettings, nodes: tuple[str, ...]) -> dict | None:
    """The Olive pass (``passes.<name>`` of a workflow) that builds the same package; None with groups at int8."""
    if split(nodes)[1]:
        return None
    options = dict(item.split("=", 1) for item in extra_options(settings, nodes))
    return {"type": "OrtEvalsModelBuilder", "precision": settings.precision,
            **({"extra_options": options} if options else {})}
