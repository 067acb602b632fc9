"""The model package: `genai_config.json` → a validated, typed description.

``ModelPackage.load(path)`` owns everything ortevals knows about a package
folder before any runtime is touched:

* parse and validate ``genai_config.json`` (every error names the field);
* resolve the decoder and the embedding model (never vision, speech or any
  other model) and their external data, refusing paths that escape the folder;
* read per-layer KV specs (name, dtype, KV heads, head size, window) from the
  decoder graph's own inputs, because layers may differ (Gemma 4: head size
  32/256 on sliding layers, 64/512 on full ones), and the recurrent and
  convolution state of hybrid decoders (LFM2, Qwen3.5: :mod:`ortevals.package.state`),
  whose attention layers alone have KV;
* cross-check the config against the graph and name both on a mismatch.

It imports ``onnx`` (protobuf only, no weights) and no runtime.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ortevals.errors import PackageError
from ortevals.package.config import (
    CONFIG_NAME,
    check_og_accepts,
    load_json_config,
    optional_int,
    read_context_length,
    read_token_ids,
    resolve_inside,
    typed_field,
)
from ortevals.package.graph import external_data_files, graph_facts, read_signature
from ortevals.package.layers import check_layers, shared_kv
from ortevals.package.manifest import PackageManifest, Variant, locate, tokenizer_folder
from ortevals.package.pipeline import refuse_pipeline
from ortevals.package.session_options import check_session_options
from ortevals.package.state import STATE_KINDS, StateSpec, layer_of, state_specs

log = logging.getLogger(__name__)

Dim = int | str | None


@dataclass(frozen=True)
class TensorInfo:
    """One graph input or output: name, numpy dtype name, shape (ints or symbols)."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]


@dataclass(frozen=True)
class KVSpec:
    """The past KV inputs of one decoder layer, as the graph declares them.

    Buffers are ``[batch, kv_heads, past_len, head_size]``. ``window`` is set
    when the graph fixes ``past_len`` (a windowed sliding-layer cache). ``layer`` is the
    decoder layer (a hybrid's KV layers skip its recurrent ones); a pass's KV is held in
    the order of ``ModelPackage.kv``.
    """

    layer: int
    key_name: str
    value_name: str
    present_key_name: str
    present_value_name: str
    dtype: str
    kv_heads: int
    head_size: int
    window: int | None = None


@dataclass(frozen=True)
class ModelFile:
    """An ONNX model of the package that ortevals may open."""

    role: str  # "decoder" or "embedding"
    path: Path
    inputs: dict[str, str]  # genai_config logical name -> graph input name
    outputs: dict[str, str]
    session_options: dict[str, Any]
    graph_inputs: tuple[TensorInfo, ...]
    graph_outputs: tuple[TensorInfo, ...]

    def input(self, name: str) -> TensorInfo | None:
        return next((t for t in self.graph_inputs if t.name == name), None)

    def output(self, name: str) -> TensorInfo | None:
        return next((t for t in self.graph_outputs if t.name == name), None)


@dataclass(frozen=True)
class ModelPackage:
    """A validated GenAI package. Build it with :meth:`load`; it holds no sessions."""

    root: Path
    model_type: str
    decoder: ModelFile
    embedding: ModelFile | None
    kv: tuple[KVSpec, ...]
    vocab_size: int
    context_length: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    skipped_models: tuple[str, ...] = ()
    states: tuple[StateSpec, ...] = ()  # recurrent/convolution state of a hybrid's recurrent layers
    # (layer, source layer) of layers attending to another layer's KV, with no KV input of their own (Gemma 4 E2B)
    shared_kv: tuple[tuple[int, int], ...] = ()
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    tokenizer_dir: Path | None = None  # where the tokenizer files are (model.tokenizer_dir resolved); None: root
    manifest: PackageManifest | None = None  # the model package (manifest.json) this folder is a variant of
    variant: Variant | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str], ep: str | None = None) -> ModelPackage:
        """Read and validate the package at ``path`` (a folder or its genai_config.json; a model package's root:
        its variant for execution provider ``ep``, package/manifest.py)."""
        return _read_package(Path(path), ep)

    @property
    def tokenizer_root(self) -> Path:
        """The folder the tokenizer files are read from (``model.tokenizer_dir``, else the package folder)."""
        return self.tokenizer_dir or self.root

    @property
    def logits_name(self) -> str:
        return self.decoder.outputs.get("logits", "logits")

    @property
    def windowed(self) -> bool:
        """Some layers keep a fixed-size sliding KV buffer: past KV cannot be reused or rewound."""
        return any(s.window for s in self.kv)

    @property
    def unwindowed(self) -> str:
        """Where ``genai_config.json`` declares a sliding window the decoder graph does not have (the builder
        drops Mistral's: every attention node attends to the whole past), one line saying so; else ""."""
        sw = self.config.get("model", {}).get("decoder", {}).get("sliding_window")
        size = sw.get("window_size") if isinstance(sw, dict) else None
        if not isinstance(size, int) or size <= 0 or graph_facts(self.decoder.path).windows:
            return ""
        return (f"{self.root / 'genai_config.json'}: model.decoder.sliding_window declares a {size}-token window "
                f"that {self.decoder.path.name}'s attention does not have (it attends to the whole past)")

    @property
    def recurrent(self) -> bool:
        """The decoder carries recurrent or convolution state: valid only at the position it was made."""
        return bool(self.states)

    @property
    def has_position_ids(self) -> bool:
        name = self.decoder.inputs.get("position_ids", "position_ids")
        return self.decoder.input(name) is not None

    @property
    def logits_width(self) -> Dim:
        out = self.decoder.output(self.logits_name)
        return out.shape[-1] if out is not None and out.shape else None

    @property
    def logits_positions(self) -> Dim:
        """The graph's declared sequence dim of logits: a symbol, or 1 for pruned heads."""
        out = self.decoder.output(self.logits_name)
        return out.shape[1] if out is not None and len(out.shape) == 3 else None

    @property
    def parameters(self) -> int:
        """The weights of the text path: the decoder's graph and the embedding model's when apart (package/graph.py's
        ``parameter_count``, from the protos the loader already read; weights never loaded)."""
        return sum(graph_facts(m.path).parameters for m in (self.decoder, self.embedding) if m is not None)

    def model_files(self) -> list[Path]:
        """Config, decoder/embedding models and their external data (the fingerprint's files; the result
        store's scope is built from what each path reads instead: package/scope.py)."""
        files = [self.root / CONFIG_NAME]
        for m in (self.embedding, self.decoder):
            if m is not None:
                files.append(m.path)
                files.extend(sorted(external_data_files(m.path)))
        return files

    def fingerprint(self) -> str:
        """A short hash of config + model files (size, mtime and head/tail bytes)."""
        h = hashlib.sha256()
        for f in self.model_files():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
            with f.open("rb") as fh:
                h.update(fh.read(1 << 16))
                if st.st_size > 1 << 16:
                    fh.seek(-(1 << 16), os.SEEK_END)
                    h.update(fh.read())
        return h.hexdigest()[:16]


def _read_package(path: Path, ep: str | None = None) -> ModelPackage:
    root, manifest, variant = locate(path.parent if path.name == CONFIG_NAME else path, ep)
    cfg = load_json_config(root)
    model = cfg["model"]
    where = root / CONFIG_NAME
    model_type = typed_field(model, "type", str, where, "model.type")
    if isinstance(model.get("decoder"), dict):
        refuse_pipeline(root, model["decoder"])  # Olive's QNN/NPU exports: stages, no decoder file
    decoder = _model_file(root, model, "decoder", required=True)
    embedding = _model_file(root, model, "embedding", required=False)
    if embedding is None and decoder.input(decoder.inputs.get("inputs_embeds", "inputs_embeds")) is not None \
            and decoder.input(decoder.inputs.get("input_ids", "input_ids")) is None:
        raise PackageError(
            f"{where}: the decoder takes inputs_embeds but field model.embedding is missing; "
            "expected an embedding model that turns input_ids into inputs_embeds"
        )
    _check_decoder_inputs(decoder, embedding, where)
    skipped = tuple(k for k, v in model.items() if isinstance(v, dict) and k not in ("decoder", "embedding")
                    and isinstance(v.get("filename"), str) and v.get("filename"))
    vocab = typed_field(model, "vocab_size", int, where, "model.vocab_size")
    states = state_specs(decoder, where)
    kv, shared = _kv_specs(decoder, model["decoder"], where, {s.layer for s in states})
    pkg = ModelPackage(
        root=root,
        model_type=model_type,
        decoder=decoder,
        embedding=embedding,
        kv=kv,
        vocab_size=vocab,
        context_length=read_context_length(model, where),
        bos_token_id=optional_int(model, "bos_token_id", where),
        eos_token_ids=read_token_ids(model.get("eos_token_id"), where),
        pad_token_id=optional_int(model, "pad_token_id", where),
        skipped_models=skipped,
        states=states,
        shared_kv=shared,
        config=cfg,
        tokenizer_dir=tokenizer_folder(root, model.get("tokenizer_dir"), manifest, where),
        manifest=manifest,
        variant=variant,
    )
    _check_logits(pkg, where)
    _check_fused_rotary(pkg)
    check_og_accepts(root)  # last: ortevals' own checks above name the field and what was expected
    if pkg.unwindowed:
        log.warning("%s; scores follow the graph (onnxruntime-genai's paths refuse it)", pkg.unwindowed)
    log.info("loaded %s: type %s, %d layers, skipped %s", root, model_type, len(pkg.kv), list(skipped) or "none")
    return pkg


def _model_file(root: Path, model: dict, role: str, *, required: bool) -> ModelFile | None:
    where = root / CONFIG_NAME
    section = model.get(role)
    if section is None and not required:
        return None
    if not isinstance(section, dict):
        raise PackageError(f"{where}: field model.{role} must be an object with a 'filename', got {section!r}")
    path = resolve_inside(root, section.get("filename"), f"model.{role}.filename")
    if path.is_dir():
        raise PackageError(f"{where}: model.{role}.filename={section['filename']!r} is a folder in {root}; "
                           "expected an ONNX model file")
    if not path.is_file():
        raise PackageError(f"{where}: model.{role}.filename={section['filename']!r} not found in {root}")
    for key in ("inputs", "outputs", "session_options"):
        if not isinstance(section.get(key, {}), dict):
            raise PackageError(f"{where}: field model.{role}.{key} must be an object, got {section[key]!r}")
    check_session_options(section.get("session_options", {}), f"{where}: field model.{role}.session_options")
    for key in ("inputs", "outputs"):
        for name, value in section.get(key, {}).items():
            if not isinstance(value, str) or not value:
                raise PackageError(f"{where}: field model.{role}.{key}.{name} must be a tensor name, got {value!r}")
    inputs, outputs, _ = read_signature(path)
    return ModelFile(
        role=role,
        path=path,
        inputs=dict(section.get("inputs", {})),
        outputs=dict(section.get("outputs", {})),
        session_options=dict(section.get("session_options", {})),
        graph_inputs=tuple(TensorInfo(*i) for i in inputs),
        graph_outputs=tuple(TensorInfo(*o) for o in outputs),
    )


def _kv_specs(decoder: ModelFile, section: dict, where: Path,
              state_layers: set[int]) -> tuple[tuple[KVSpec, ...], tuple[tuple[int, int], ...]]:
    """Per-layer KV specs from the graph, in layer order; config values only fill symbolic dims; and the layers
    sharing another's KV (package/layers.py).

    Every graph input the key pattern names is a KV layer; a hybrid's recurrent layers (``state_layers``) and
    KV-shared layers have none, so together they make the decoder's layers."""
    key_fmt = decoder.inputs.get("past_key_names", "past_key_values.%d.key")
    value_fmt = decoder.inputs.get("past_value_names", "past_key_values.%d.value")
    pkey_fmt = decoder.outputs.get("present_key_names", "present.%d.key")
    pvalue_fmt = decoder.outputs.get("present_value_names", "present.%d.value")
    _fmt(key_fmt, 0, where)
    layers = sorted(i for i in (layer_of(t.name, key_fmt) for t in decoder.graph_inputs) if i is not None)
    specs = []
    for i in layers:
        k = decoder.input(_fmt(key_fmt, i, where))
        v = decoder.input(_fmt(value_fmt, i, where))
        if v is None:
            raise PackageError(f"{decoder.path}: graph has input {k.name!r} but no {_fmt(value_fmt, i, where)!r}")
        if len(k.shape) != 4:
            raise PackageError(f"{decoder.path}: input {k.name!r} has shape {k.shape}; expected 4 dims "
                               "[batch, kv_heads, past, head_size]")
        heads = _concrete(k.shape[1], section, "num_key_value_heads", k.name, decoder.path, where)
        size = _concrete(k.shape[3], section, "head_size", k.name, decoder.path, where)
        window = k.shape[2] if isinstance(k.shape[2], int) and k.shape[2] > 0 else _window(section, i, where)
        specs.append(KVSpec(i, k.name, v.name, _fmt(pkey_fmt, i, where), _fmt(pvalue_fmt, i, where),
                            k.dtype, heads, size, window))
    shared = shared_kv(decoder, [s.layer for s in specs])
    check_layers(specs, section, decoder, where, state_layers, shared)
    return tuple(specs), shared


def _window(section: dict, layer: int, where: Path) -> int | None:
    """The builder's windowed sliding-layer cache: declared in config, a symbolic dim in the graph."""
    sw = section.get("sliding_window")
    if not isinstance(sw, dict) or layer not in (sw.get("layers") or []):
        return None
    size = sw.get("window_size")
    if not isinstance(size, int) or size <= 0:
        raise PackageError(f"{where}: model.decoder.sliding_window.window_size must be a positive int, got {size!r}")
    return size


def _fmt(pattern: str, i: int, where: Path) -> str:
    if not isinstance(pattern, str) or "%d" not in pattern:
        raise PackageError(f"{where}: KV name pattern {pattern!r} must be a string with one %d")
    try:
        return pattern % i
    except (TypeError, ValueError):
        raise PackageError(f"{where}: KV name pattern {pattern!r} must contain one %d") from None


def _concrete(dim: Dim, section: dict, key: str, name: str, model: Path, where: Path) -> int:
    if isinstance(dim, int) and dim > 0:
        return dim
    value = section.get(key)
    if not isinstance(value, int) or value <= 0:
        raise PackageError(f"{model}: input {name!r} has symbolic dim {dim!r} and {where} has no "
                           f"positive model.decoder.{key} to fill it")
    return value


SCALE_INPUTS = ("past_key_scale_names", "past_value_scale_names")  # per-token KV scales (CUDA PagedAttention)
STATIC_CACHE = ("write_indices", "nonpad_kv_seqlen")  # Mobius --static-cache: KV buffers written in place
FED_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids")  # what the decoder is fed by name
LAYER_INPUTS = (("past_key_names", "past_key_values.%d.key"), ("past_value_names", "past_key_values.%d.value"),
                *((key, None) for _, key, _ in STATE_KINDS))  # per-layer inputs ortevals feeds (state: if named)


def _check_decoder_inputs(decoder: ModelFile, embedding: ModelFile | None, where: Path) -> None:
    """Every decoder input is one genai_config.json names (``model.decoder.inputs``, or its default name) and
    ortevals feeds: onnxruntime-genai and ortevals feed inputs by those names, so an input named otherwise
    (``ids`` for ``input_ids``) would never be fed; one the config names under a key ortevals does not feed is
    refused naming that key. An output of the embedding model under the same key (Gemma 4 E2B's
    ``per_layer_inputs``: per-token, like ``inputs_embeds``) is fed from that model's pass over the same tokens."""
    names = {decoder.inputs.get(k, k): k for k in FED_INPUTS}
    patterns = [p for p in (decoder.inputs.get(k, d) for k, d in LAYER_INPUTS) if p is not None]
    static = [n for n in (decoder.inputs.get(k, k) for k in STATIC_CACHE) if decoder.input(n) is not None]
    if static:  # before the names: its key_cache.N inputs are not an input ortevals forgot to feed
        raise PackageError(f"{decoder.path}: a Mobius static-cache export (--static-cache: KV buffers written in "
                           f"place at {' and '.join(static)}, updated_* outputs), which onnxruntime-genai 0.18 cannot "
                           "load and ortevals does not feed; export it without --static-cache")
    scales = next((k for k in SCALE_INPUTS if k in decoder.inputs), None)
    if scales is not None:  # the builder writes them for per-token KV schemes, which need CUDA PagedAttention
        raise PackageError(f"{where}: model.decoder.inputs.{scales}: KV-cache scales as graph inputs (a per-token "
                           "quantized KV cache) are not fed by ortevals; build the KV cache per channel or per "
                           "tensor (scales inside the graph), e.g. kv_cache_quant_scheme=int8_per_channel")
    for inp in decoder.graph_inputs:
        if inp.name in names or any(layer_of(inp.name, p) is not None for p in patterns) \
                or _from_embedding(inp.name, decoder, embedding, where):
            continue
        named = next((k for k, v in sorted(decoder.inputs.items())
                      if v == inp.name or layer_of(inp.name, v) is not None), None)
        if named is not None:
            fed = ", ".join((*FED_INPUTS, *(k for k, _ in LAYER_INPUTS)))
            raise PackageError(f"{decoder.path}: input {inp.name!r} is model.decoder.inputs.{named} in {where.name}, "
                               f"an input ortevals does not feed (it feeds {fed})")
        mapped = ", ".join(f"{k}={v!r}" for k, v in sorted(decoder.inputs.items()))
        raise PackageError(f"{decoder.path}: input {inp.name!r} is not an input {where.name} names "
                           f"(model.decoder.inputs: {mapped or 'none, so the default names'}); expected the "
                           "graph's inputs to be the names the config gives, since inputs are fed by name")
    if not any(decoder.input(decoder.inputs.get(k, k)) for k in ("input_ids", "inputs_embeds")):
        ids = decoder.inputs.get("input_ids", "input_ids")
        raise PackageError(f"{where}: neither model.decoder.inputs.input_ids={ids!r} nor inputs_embeds is an "
                           f"input of {decoder.path.name}; config and graph must agree")


def _from_embedding(name: str, decoder: ModelFile, embedding: ModelFile | None, where: Path) -> bool:
    """Whether decoder input ``name`` is fed by the embedding model: the config names it under one key in
    ``model.decoder.inputs`` and ``model.embedding.outputs``. ortevals binds the embedding's outputs into the
    decoder by tensor name, so the two names must be one (a config that renames it between them is refused)."""
    key = next((k for k, v in decoder.inputs.items() if v == name), None)
    if embedding is None or key is None or key not in embedding.outputs:
        return False
    produced = embedding.outputs[key]
    if produced != name or embedding.output(produced) is None:
        raise PackageError(f"{where}: model.decoder.inputs.{key}={name!r} but model.embedding.outputs.{key}="
                           f"{produced!r}{'' if embedding.output(produced) else ' (not an output of the model)'}; "
                           "expected one tensor name, an output of the embedding model that the decoder takes")
    return True


def _check_fused_rotary(pkg: ModelPackage) -> None:
    """Refuse a decoder whose GroupQueryAttention rotates inside the kernel with a rotary cache the kernel
    refuses: onnxruntime (1.32, CPU and CUDA, ``group_query_attention_helper.h``) takes a ``cos_cache`` width
    (half the rotary dim) only as a multiple of 8 and at most ``head_size / 16 * 8``. The builder fuses
    rotary into the kernel on CPU and CUDA, so a small head with partial rotary (Phi, head size 16, rotary
    factor 0.5: width 4) gives a package that neither onnxruntime nor onnxruntime-genai can run."""
    for node, size, width in graph_facts(pkg.decoder.path).fused_rotary:
        if size and (width % 8 or width > size // 16 * 8):  # size 0: undeclared (the probe pass finds out)
            raise PackageError(
                f"{pkg.decoder.path}: GroupQueryAttention node {node!r} rotates inside the kernel with a cos_cache of "
                f"width {width} (rotary dim {2 * width}) on head size {size}; onnxruntime's kernel takes only widths "
                f"that are multiples of 8 up to {size // 16 * 8}, so neither onnxruntime nor onnxruntime-genai can "
                "run this package (re-export a model whose rotary dim is a multiple of 16)")


def _check_logits(pkg: ModelPackage, where: Path) -> None:
    if pkg.decoder.output(pkg.logits_name) is None:
        raise PackageError(f"{pkg.decoder.path}: graph has no output {pkg.logits_name!r} "
                           f"(model.decoder.outputs.logits in {where.name})")
    width = pkg.logits_width
    if isinstance(width, int) and width != pkg.vocab_size:
        raise PackageError(f"{where}: model.vocab_size={pkg.vocab_size} but {pkg.decoder.path.name} "
                           f"returns logits of width {width}; config and graph must agree")
