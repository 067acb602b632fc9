"""What ``ortevals diagnose`` is given, checked before any work: one line per bad input.

Owns the options at the boundary (:class:`DiagnoseOptions`) and :func:`check_inputs`: both
packages loaded (config and graph protobufs only, no weights, no sessions) and found comparable
(the same architecture, vocabulary, layer count and tokenizer; a candidate whose nodes carry the
builder's layer names; a reference that is not itself quantized), the options in range, the output
folder writable, the text readable, a ``--checkpoint`` that is a transformers folder. A reference
given as a transformers checkpoint is checked against the candidate by its ``config.json``, then
built once into the cache as the builder's fp32 package (:func:`reference_package`), keyed by the
checkpoint's files and the builder's version.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ortevals.errors import OrtEvalsError
from ortevals.package.loader import ModelPackage
from ortevals.runtime.adapters import warn_base_model

log = logging.getLogger(__name__)
DEFAULT_TOKENS = 2048
DEFAULT_CANDIDATES = 12
DEFAULT_QUESTIONS = 50
DEFAULT_BUDGET = 10.0  # percent of the candidate package's size
MAX_BUDGET = 1000.0  # percent of the candidate's size


@dataclass(frozen=True)
class DiagnoseOptions:
    pkg: Path | None
    ref: str | None
    checkpoint: Path | None = None
    text: Path | None = None
    data: str | None = None
    tokens: int | None = None  # None: DEFAULT_TOKENS scored tokens (fidelity's windows)
    ctx: int | None = None
    budget: float = DEFAULT_BUDGET
    candidates: int = DEFAULT_CANDIDATES
    questions: int = DEFAULT_QUESTIONS
    verify: bool = False
    output: Path = Path("ortevals-diagnose")
    ep: str | None = None
    int8: Path | None = None  # the builder's int8 export of the model: int8 as a choice per group (diagnose/int8.py)


@dataclass(frozen=True)
class Inputs:
    cand: ModelPackage
    ref: ModelPackage | None  # None: built from ``ref_checkpoint``
    ref_checkpoint: Path | None
    checkpoint: Path | None  # for --verify (the reference's checkpoint when it is one)
    quantized: bool = True  # the candidate holds quantized weights (MatMulNBits, …): groups to keep to measure


def _check_numbers(o: DiagnoseOptions) -> None:
    if o.pkg is None:
        raise OrtEvalsError("pass --pkg PATH (the candidate GenAI package folder)")
    if not o.ref:
        raise OrtEvalsError("pass --ref PATH (the same model in higher precision: a GenAI package or a transformers "
                            "checkpoint folder)")
    if o.text is not None and o.data is not None:
        raise OrtEvalsError("pass --text FILE or --data, not both")
    for flag, value, low in (("--tokens", o.tokens, 1), ("--candidates", o.candidates, 1),
                             ("--questions", o.questions, 0)):
        if value is not None and value < low:
            raise OrtEvalsError(f"{flag} must be >= {low}, got {value}")
    if o.ctx is not None and (o.ctx < 4 or o.ctx % 2):
        raise OrtEvalsError(f"--ctx must be an even number >= 4, got {o.ctx}")
    if not 0 < o.budget <= MAX_BUDGET:
        raise OrtEvalsError(f"--budget must be a percentage of the candidate's size above 0 and at most "
                            f"{MAX_BUDGET:g}, got {o.budget:g}")
    if o.text is not None:
        try:
            Path(o.text).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise OrtEvalsError(f"{o.text}: cannot read the text as UTF-8 ({e})") from None


def _checkpoint_config(path: Path, flag: str) -> dict:
    cfg = Path(path).expanduser() / "config.json"
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise OrtEvalsError(f"{flag} {path}: expected a transformers checkpoint folder with a readable config.json "
                            f"({type(e).__name__})") from None
    return data.get("text_config") or data


def check_inputs(o: DiagnoseOptions) -> Inputs:
    """Every check that needs no model run; the first problem is one line (:class:`OrtEvalsError`)."""
    from ortevals.fidelity.run import reference_kind
    from ortevals.files import MIN_FREE, cache_root, check_writable_folder
    from ortevals.runtime.roles import quantized_ops

    _check_numbers(o)
    check_writable_folder(Path(o.output), "--output")
    cache_root()
    cand = ModelPackage.load(Path(o.pkg).expanduser())
    warn_base_model(cand, "diagnose")  # a LoRA package: its base model is diagnosed
    if o.verify:  # --verify builds the recommended package into --output: about the candidate's size more
        check_writable_folder(Path(o.output), "--output",
                              need=MIN_FREE + sum(f.stat().st_size for f in cand.model_files()))
    if not Path(o.ref).expanduser().exists():
        raise OrtEvalsError(f"--ref {o.ref}: no such folder; expected the same model in higher precision (a GenAI "
                            "package folder or a transformers checkpoint folder)")
    kind = reference_kind(o.ref)
    if kind == "file":
        raise OrtEvalsError(f"--ref {o.ref}: a saved fidelity reference holds only top-k log-probs; diagnose needs "
                            "the reference model itself (a GenAI package or a transformers checkpoint folder)")
    checkpoint = Path(o.checkpoint).expanduser() if o.checkpoint is not None else None
    if checkpoint is not None:  # --verify builds from it: another model is refused now, not after the build
        _check_against_config(cand, _checkpoint_config(checkpoint, "--checkpoint"), checkpoint, "--checkpoint")
    ref_path = Path(o.ref).expanduser()
    _check_candidate(cand)
    if kind == "package":
        ref = ModelPackage.load(ref_path)
        warn_base_model(ref, "diagnose")
        check_pair(cand, ref)
        check_distinct(cand, ref)
        ref_checkpoint = None
    else:
        ref, ref_checkpoint = None, ref_path
        _check_against_config(cand, _checkpoint_config(ref_path, "--ref"), ref_path, "--ref")
        checkpoint = checkpoint or ref_path
    if o.verify and checkpoint is None:
        raise OrtEvalsError("--verify builds the recommended package with the onnxruntime-genai builder: pass "
                            "--checkpoint HF_DIR (the transformers checkpoint the candidate was built from)")
    quantized = bool(quantized_ops(decoder_graph(cand)))
    if o.verify and not quantized:
        raise OrtEvalsError(f"--verify: the candidate {cand.root} holds no quantized weights, so there is nothing to "
                            "keep in higher precision and no recommendation to build; drop --verify")
    return Inputs(cand, ref, ref_checkpoint, checkpoint, quantized)


def decoder_graph(package: ModelPackage):
    """The decoder's graph protobuf (no weights)."""
    import onnx

    return onnx.load(str(package.decoder.path), load_external_data=False).graph


def _check_candidate(cand: ModelPackage) -> None:
    from ortevals.runtime.roles import named_layers

    if cand.recurrent:  # its convolution / linear-attention layers have no attention block to tap
        raise OrtEvalsError(f"--pkg {cand.root}: a hybrid decoder with recurrent state ({len(cand.states)} "
                            "convolution or linear-attention state inputs); diagnose compares each layer's attention "
                            "and MLP blocks, which its recurrent layers do not have; ortevals fidelity measures its "
                            "token KL against the reference")

    if not named_layers(decoder_graph(cand)):
        raise OrtEvalsError(f"--pkg {cand.root}: no node of {cand.decoder.path.name} carries the builder's layer names "
                            "(/model/layers.N/…); diagnose reads the layers of onnxruntime-genai builder graphs only")


def check_pair(cand: ModelPackage, ref: ModelPackage, quantized_ok: bool = False) -> None:
    """The two packages are the same model in two precisions, or one line saying how they differ
    (``quantized_ok``: ``ref`` may be quantized, as ``--int8``'s package is)."""
    from ortevals.fidelity.reference import tokenizer_hash
    from ortevals.runtime.roles import quantized_ops

    ops = quantized_ops(decoder_graph(ref))
    if ops and not quantized_ok:
        raise OrtEvalsError(f"--ref {ref.root}: the reference is itself quantized ({', '.join(sorted(ops))}); "
                            "diagnose needs it in higher precision (the builder's fp32/fp16/bf16 output, or the "
                            "transformers checkpoint)")
    if cand.model_type != ref.model_type:
        raise OrtEvalsError(f"different architectures: candidate {cand.root} is {cand.model_type!r}, reference "
                            f"{ref.root} is {ref.model_type!r}; diagnose compares one model in two precisions")
    if cand.vocab_size != ref.vocab_size:
        raise OrtEvalsError(f"different vocabularies: candidate {cand.root} has {cand.vocab_size} tokens, reference "
                            f"{ref.root} has {ref.vocab_size}")
    if len(cand.kv) != len(ref.kv):
        raise OrtEvalsError(f"different layer counts: candidate {cand.root} has {len(cand.kv)} layers, reference "
                            f"{ref.root} has {len(ref.kv)}")
    a, b = tokenizer_hash(cand.tokenizer_root), tokenizer_hash(ref.tokenizer_root)
    if a != b:
        raise OrtEvalsError(f"different tokenizers: candidate {cand.root} has tokenizer.json {a[:12]}, reference "
                            f"{ref.root} has {b[:12]}; diagnose needs the same tokens on both sides")


def check_distinct(cand: ModelPackage, ref: ModelPackage) -> None:
    """The reference is not the candidate itself (the same folder, or a copy: model files of the same names and
    bytes), which would measure nothing but zeros. Files are read only where every name and size match."""
    same = ("the same package folder as --pkg" if os.path.realpath(cand.root) == os.path.realpath(ref.root) else
            _same_files(cand, ref))
    if same:
        raise OrtEvalsError(f"--ref {ref.root}: {same}, so every difference would be zero; diagnose compares the "
                            "candidate with the same model in higher precision (the builder's fp32/fp16/bf16 "
                            "output, or the transformers checkpoint)")


def _same_files(cand: ModelPackage, ref: ModelPackage) -> str | None:
    """``the same model files as --pkg …`` where the two packages' graph and weight files are a copy of each
    other."""
    def files(p: ModelPackage) -> list[tuple[str, int, Path]]:
        return sorted((f.relative_to(p.root).as_posix(), f.stat().st_size, f) for f in p.model_files()[1:])

    a, b = files(cand), files(ref)
    if [x[:2] for x in a] != [x[:2] for x in b] or not all(_same_bytes(x[2], y[2]) for x, y in zip(a, b)):
        return None
    return f"the same model files as --pkg {cand.root} ({', '.join(x[0] for x in a)}: every byte equal)"


def _same_bytes(a: Path, b: Path, block: int = 1 << 22) -> bool:
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            x, y = fa.read(block), fb.read(block)
            if x != y:
                return False
            if not x:
                return True


def _check_against_config(cand: ModelPackage, cfg: dict, path: Path, flag: str) -> None:
    """A checkpoint (``--ref`` or ``--checkpoint``) against the candidate, by its config.json, before it is built:
    the vocabulary, the layer count, and the hidden size and head counts the candidate's genai_config.json
    declares."""
    decoder = (cand.config.get("model") or {}).get("decoder") or {}
    fields = [("vocabularies", cand.vocab_size, cfg.get("vocab_size")),
              ("layer counts", decoder.get("num_hidden_layers", len(cand.kv)), cfg.get("num_hidden_layers"))]
    fields += [(f"{key.replace('_', ' ')}s", decoder.get(key), cfg.get(key))
               for key in ("hidden_size", "num_attention_heads", "num_key_value_heads")]
    for what, ours, theirs in fields:
        if ours is not None and theirs is not None and ours != theirs:
            raise OrtEvalsError(f"{flag} {path}: different {what}: candidate {cand.root} has {ours}, the checkpoint "
                                f"(config.json) has {theirs}; expected the checkpoint the candidate was built from")


def reference_package(checkpoint: Path, cache: Path) -> ModelPackage:
    """The builder's fp32 package of a transformers checkpoint, built once into the cache."""
    from ortevals.files import atomic_write
    from ortevals.package.examples import build_genai_package
    from ortevals.package.scope import Reads, Scope

    files = tuple(p for p in sorted(Path(checkpoint).rglob("*")) if p.is_file())
    reads = Reads("fp32 reference build", files, {"precision": "fp32", "ep": "cpu",
                                                   "checkpoint": os.path.realpath(checkpoint)}, ("onnxruntime-genai",))
    scope = Scope.build("derived", Path(checkpoint), [reads])
    folder = cache / "derived" / scope.digest[:32] / "fp32"
    if not (folder / "genai_config.json").is_file():
        log.info("building the fp32 reference package of %s into %s", checkpoint, folder)
        build_genai_package(Path(checkpoint), folder, "fp32", cache / "builder-cache")
        atomic_write(folder.parent / "scope.json", json.dumps(scope.describe(), indent=1))
    return ModelPackage.load(folder)
