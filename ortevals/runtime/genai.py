"""onnxruntime-genai for the incremental path: one Model, reusable Generators.

Owns building ``og.Config`` from the package with the providers and thread
counts set explicitly (og's defaults were 1.7x slower here), and a
:class:`Cursor`: a Generator plus the token ids it holds, which moves to a new
token sequence by ``rewind_to`` the common prefix and ``append_tokens`` of the
rest, or by a fresh Generator where rewinding is not exact (windowed sliding
KV caches, multimodal packages). A hybrid decoder's recurrent state (LFM2,
Qwen3.5) is the state of exactly the position it was made: og can rewind it only
to a position saved with ``snapshot_state`` first (0.15+), so the cursor saves
one where it is told the next sequence branches off (``keep_at``) and rewinds
there or nowhere; where og cannot (no ``snapshot_state``, or a model type whose
rewind og refuses, found by a probe at open), a fresh Generator per sequence.

Also owns two guarantees on what og is handed: a multimodal package is opened
text-only (its vision and speech models are never loaded, see
:func:`text_only`), and og's own search runs with every option that could
change a token at its neutral value (:data:`NEUTRAL_SEARCH`), so the package's
``search`` section never decides a token: decoding is defined by the request's
gen_kwargs alone (``generation.SEARCH_POLICY``), batched or not.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import numpy as np

from ortevals.errors import PackageError, ProviderError, first_line
from ortevals.install import import_og, load_cuda_libraries
from ortevals.package.graph import external_data_files
from ortevals.package.loader import CONFIG_NAME, ModelPackage, resolve_inside
from ortevals.package.reuse import MIN_PASS_TOKENS, ReusePolicy, reuse_policy
from ortevals.package.scope import Reads
from ortevals.runtime.plugins import find_plugin, plugin_distribution, register, with_plugin
from ortevals.runtime.providers import ProviderConfig
from ortevals.tokens import common_prefix

log = logging.getLogger(__name__)

# og's search options that can change which token is chosen, at the values under which og's
# search is plain greedy argmax. Set explicitly on every Generator: og otherwise starts from the
# package's `search` section (repetition_penalty, min_length, no_repeat_ngram_size, ...), which
# the single-row path (our own choose_token on get_logits) never applies. Checked after setting
# with get_search_options(); og 0.18 accepts every key here (it has no frequency/presence penalty).
NEUTRAL_SEARCH = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
                  "min_length": 0, "no_repeat_ngram_size": 0, "length_penalty": 1.0, "diversity_penalty": 0.0,
                  "temperature": 1.0, "top_k": 0, "top_p": 1.0, "early_stopping": True}
STUB_VISION = "ortevals-text-only-vision-stub.onnx"  # a name no package file has; held in memory only
# files og 0.18 opens in the package folder whenever it builds a Config, when they are present (strace:
# tests/test_scope.py::test_every_file_a_run_opens_is_in_its_scope)
OG_CONFIG_FILES = (CONFIG_NAME, "manifest.json", "virtual_model.onnx")
TEXT_SECTIONS = ("decoder", "embedding")


def og_settings(package: ModelPackage, provider: ProviderConfig, sections: tuple[str, ...]) -> dict:
    """Everything og is handed that can change a number (:func:`og_config` and the openers pass exactly
    this): the provider and every option of it (og gets them all; on CPU none is appended), the thread
    overlay of ``sections`` and the neutral search options."""
    model = package.config["model"]
    threads = {"intra_op_num_threads": provider.intra_op_threads, "inter_op_num_threads": 1}
    overlay = {s: {"session_options": threads} for s in sections
               if isinstance(model.get(s), dict) and (s in TEXT_SECTIONS or model[s].get("filename"))}
    if str(model.get("tokenizer_dir") or "").startswith("sha256:"):
        # og opens the variant folder as a plain package (this og has no model-package support, and og 0.18
        # refuses a sha256: reference there): the shared asset it would resolve, as a path from the folder
        overlay["tokenizer_dir"] = os.path.relpath(package.tokenizer_root, package.root)
    return {"provider": provider.name,
            "provider_options": dict(provider.options) if provider.name != "cpu" else {},
            "overlay": {"model": overlay}, "search": NEUTRAL_SEARCH}


def og_files(package: ModelPackage, sections: tuple[str, ...], extra: tuple[str, ...] = ()) -> list:
    """The package files og opens for a Config over ``sections``: the config files it probes, each
    section's model and external data, and each section's ``extra`` keys (``config_filename``).
    A name that does not resolve inside the package is left out (the opener refuses it)."""
    model = package.config["model"]
    files = [package.root / n for n in OG_CONFIG_FILES]
    for section in sections:
        part = model.get(section)
        if not isinstance(part, dict):
            continue
        for key in ("filename", *extra):
            name = part.get(key)
            if not name:
                continue
            try:
                path = resolve_inside(package.root, name, f"model.{section}.{key}")
            except PackageError:
                continue
            files.append(path)
            if key == "filename" and path.suffix == ".onnx" and path.is_file():
                files.extend(sorted(external_data_files(path)))
    return files


def genai_reads(package: ModelPackage, provider: ProviderConfig) -> Reads:
    """What :meth:`GenaiRunner.open` reads: the text-only Config (vision held in memory, speech blanked)."""
    return Reads("onnxruntime-genai", tuple(og_files(package, TEXT_SECTIONS)),
                 {**og_settings(package, provider, TEXT_SECTIONS), "text_only": bool(text_only(package)[0])},
                 with_plugin(provider.name, ("onnxruntime-genai", "onnxruntime")))


def text_only(package: ModelPackage) -> tuple[dict, dict[str, bytes]]:
    """The og.Config overlay and in-memory models that open ``package`` for text requests only.

    og 0.18 builds a model whose type is multimodal (gemma4, phi4mm, gemma3, phi3v, ...) with a
    vision session whatever the request, and a text-only type name (gemma4_text) refuses a
    separate embedding model outside og's Engine ("Decoder-only CPU embedding requires the
    dynamic-batching Engine"). An empty vision filename makes og load the package folder itself.
    So the vision model is replaced by a stub held in memory (``Config.add_model_data``): one
    Constant per vision output, ``[0, hidden]``, never run because text requests carry no image.
    Speech loads only when ``speech.filename`` and ``speech.config_filename`` are both set, so
    both are blanked. og then never opens the package's vision or speech files (ortevals has no
    image or audio requests). Returns ``({}, {})`` for a text-only package.
    """
    model = package.config["model"]
    if package.embedding is None and not any(isinstance(model.get(k), dict) for k in ("vision", "speech")):
        return {}, {}
    vision = model.get("vision") if isinstance(model.get("vision"), dict) else {}
    overlay = {"vision": {"filename": STUB_VISION}, "speech": {"filename": "", "config_filename": ""}}
    return {"model": overlay}, {STUB_VISION: _stub_vision(package, vision)}


def _stub_vision(package: ModelPackage, vision: dict) -> bytes:
    """An ONNX model with no inputs whose outputs are empty ``[0, hidden]`` features."""
    import onnx
    from onnx import helper, numpy_helper

    hidden = int(package.config["model"]["decoder"].get("hidden_size") or 1)
    dtype = np.float32
    if package.embedding is not None:
        info = package.embedding.input(package.embedding.inputs.get("image_features", "image_features"))
        if info is not None:
            dtype = np.dtype(info.dtype)
            hidden = info.shape[-1] if info.shape and isinstance(info.shape[-1], int) else hidden
    names = [n for n in (vision.get("outputs") or {"image_features": "image_features"}).values()]
    empty = np.zeros((0, hidden), dtype=dtype)
    graph = helper.make_graph(
        [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(empty)) for n in names],
        "ortevals_text_only_vision_stub", [],
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(empty.dtype), [0, hidden])
         for n in names])
    stub = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="ortevals")
    stub.ir_version = 8
    onnx.checker.check_model(stub)
    return stub.SerializeToString()


def rewind_is_exact(package: ModelPackage) -> tuple[bool, str]:
    """Whether ``rewind_to`` gives exact logits on this package, and why not (recurrent state: only to a
    snapshot, :func:`snapshot_rewinds`)."""
    if package.windowed:
        return False, "a windowed sliding KV cache is silently wrong after rewinding past the window"
    if package.embedding is not None or package.skipped_models:
        return False, "multimodal rewind is a no-op on some onnxruntime-genai versions"
    if any(s.dtype == "uint8" for s in package.kv):  # og 0.18: "Requested length of rewind is greater than ..."
        return False, "onnxruntime-genai refuses to rewind an int4 (two values a byte) KV cache"
    return True, ""


def snapshot_rewinds(og, model, package: ModelPackage) -> tuple[bool, str]:
    """Whether og rewinds this hybrid model's recurrent state to a snapshot, and why not: og 0.15+ has
    ``Generator.snapshot_state``; model types whose rewind it refuses even then (og 0.18: lfm2, "RewindTo is
    currently not supported") are found by a probe (2 tokens, a snapshot, 2 more, a rewind) on a token that
    is none of the config's special ids (og's Qwen position ids take an unset image/vision-start id as 0)."""
    if not hasattr(og.Generator, "snapshot_state"):
        return False, "this onnxruntime-genai has no snapshot_state to rewind recurrent state"
    special = {0, *(v for k, v in package.config["model"].items() if k.endswith("_token_id") and isinstance(v, int))}
    ids = np.full((1, 2), min(set(range(len(special) + 1)) - special), dtype=np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=8, batch_size=1, **NEUTRAL_SEARCH)
    gen = og.Generator(model, params)
    try:
        gen.append_tokens(ids)
        gen.snapshot_state()
        gen.append_tokens(ids)
        gen.rewind_to(2)
    except Exception as e:  # og's RuntimeError: its words say why
        return False, f"onnxruntime-genai does not rewind its recurrent state ({first_line(e)})"
    return True, ""


def og_config(og, package: ModelPackage, provider: ProviderConfig, sections: tuple[str, ...]):
    """An ``og.Config`` handed exactly :func:`og_settings` (CPU: no provider appended), after refusing a
    package whose ``sections`` name a native custom-ops library (never loaded from a package)."""
    model = package.config["model"]
    for section in sections:
        opts = model[section].get("session_options", {}) if isinstance(model.get(section), dict) else {}
        if isinstance(opts, dict) and opts.get("custom_ops_library"):
            raise PackageError(f"{package.root / 'genai_config.json'}: model.{section}.session_options."
                               "custom_ops_library is set; ortevals does not load native libraries "
                               "named by a package")
    if package.model_type == "gemma4_text" and package.embedding is not None:  # og 0.18: "Decoder-only CPU ..."
        raise PackageError(f"{package.root / 'genai_config.json'}: model.type is 'gemma4_text' but the package has "
                           "an embedding model (model.embedding), which onnxruntime-genai runs only for type "
                           "'gemma4' (Mobius 0.1.0 writes 'gemma4_text' for a multimodal export of a local "
                           "checkpoint): set model.type to 'gemma4'; path=prefill and gen_path=raw run the package "
                           "as it is")
    settings = og_settings(package, provider, sections)
    if provider.name == "cuda":  # before og's CUDA provider loads (every Generator's model, text or media)
        load_cuda_libraries()
    config = og.Config(str(package.root))
    config.clear_providers()
    if settings["provider"] != "cpu":
        plugin = find_plugin(provider.ort_name) if plugin_distribution(provider.name) else None
        if plugin is not None:  # a plugin provider: og keeps its own onnxruntime environment (runtime/plugins.py)
            register(og, plugin, "onnxruntime-genai")
        try:
            config.append_provider(settings["provider"])
            for key, value in settings["provider_options"].items():
                config.set_provider_option(settings["provider"], key, value)
        except Exception as e:
            raise ProviderError(f"onnxruntime-genai cannot use provider {provider.name!r}: {first_line(e)}; pass --ep "
                                "cpu (model_args ep=cpu) to run on the CPU, or install the onnxruntime-genai "
                                "package built for it") from None
    config.overlay(json.dumps(settings["overlay"]))
    return config


class GenaiRunner:
    """An ``og.Model`` opened on one provider. Build with :meth:`open`."""

    def __init__(self, package: ModelPackage, model, og, rewind_ok: bool, reuse: ReusePolicy | None = None) -> None:
        self.package = package
        self.model = model
        self.og = og
        self.rewind_ok = rewind_ok
        self.reuse = reuse or ReusePolicy()  # what held KV a cursor may keep (package/reuse.py)
        self.snapshots = package.recurrent  # rewinding only to a snapshot position (recurrent state)
        # a batched Generator right-pads its prompts, and a recurrent layer runs the padding into its state
        # (Qwen3.5 on og 0.18: another token from the second step on): batches only without recurrent state
        self.batches_exact = not package.recurrent
        self.generators_created = 0
        self.adapter = None  # a LoRA adapter set active on every Generator (runtime/adapters.py)

    @classmethod
    def open(cls, package: ModelPackage, provider: ProviderConfig, adapter=None) -> GenaiRunner:
        if package.unwindowed:  # og sizes its KV cache to the declared window; the graph then fails past it
            raise PackageError(f"{package.unwindowed}; onnxruntime-genai sizes its KV cache to that window and "
                               "fails past it: path=prefill and gen_path=raw run the graph as it is")
        og = import_og()
        config = og_config(og, package, provider, TEXT_SECTIONS)
        mm_overlay, stubs = text_only(package)
        if mm_overlay:
            config.overlay(json.dumps(mm_overlay))
            for name, data in stubs.items():
                config.add_model_data(name, data)
            log.info("onnxruntime-genai opens %s text-only: %s not loaded", package.root,
                     ", ".join(k for k in ("vision", "speech") if k in package.config["model"]) or "nothing")
        try:
            model = og.Model(config)
        except Exception as e:
            raise PackageError(f"{package.root}: onnxruntime-genai could not load the package: "
                               f"{first_line(e)}") from None
        ok, why = rewind_is_exact(package)
        if ok and package.recurrent:
            ok, why = snapshot_rewinds(og, model, package)
        if not ok:
            log.info("incremental path: fresh Generator per input (%s)", why)
        runner = cls(package, model, og, ok, reuse_policy(package))
        runner.adapter = adapter
        return runner

    def cursor(self, max_length: int) -> Cursor:
        """A cursor whose Generators reserve KV for ``max_length`` tokens (never the whole context)."""
        return Cursor(self, max_length)

    def greedy_steps(self, prompts: list[list[int]], max_new: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """og's greedy search over a right-padded batch; yields each step's ``(tokens [B], logits [B,V])``.

        A batched Generator takes one ``append_tokens`` (og 0.18), so decoding is og's own
        ``generate_next_token`` (with :data:`NEUTRAL_SEARCH`); og masks the trailing pad ids, so
        no prompt may end in one. ``logits`` are the ones og chose from (read before each step:
        get_logits computes them, generate_next_token then reuses them), so the caller can check
        that each token is their argmax and that they are finite.
        """
        pad = self.package.pad_token_id
        width = max(len(p) for p in prompts)
        gen = self._new_generator(width + max_new, len(prompts))
        gen.append_tokens(np.asarray([p + [pad] * (width - len(p)) for p in prompts], dtype=np.int32))
        while not gen.is_done():
            logits = np.asarray(gen.get_logits())[:, -1]
            gen.generate_next_token()
            yield np.asarray(gen.get_next_tokens()), logits

    def _generator(self, max_length: int):
        # our own token choice reads get_logits(); og's search stays unused (and neutral)
        return self._new_generator(max_length, 1)

    def _new_generator(self, max_length: int, batch_size: int):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, batch_size=batch_size, **NEUTRAL_SEARCH)
        got = params.get_search_options()
        wrong = {k: got.get(k) for k, v in NEUTRAL_SEARCH.items() if k in got and got[k] != v}
        if wrong:  # og ignored an option: its search would not be plain greedy
            raise PackageError(f"{self.package.root}: onnxruntime-genai kept search options {wrong} "
                               f"after they were set to {NEUTRAL_SEARCH}")
        self.generators_created += 1
        gen = self.og.Generator(self.model, params)
        if self.adapter is not None:
            self.adapter.activate(self.og, self.model, gen)
        return gen


class Cursor:
    """A Generator and the tokens it holds; moves to new sequences as cheaply as is exact.

    What is exact is the package's :class:`~ortevals.package.reuse.ReusePolicy`, the rule the prefill path
    follows too: a move runs at least ``MIN_PASS_TOKENS`` new tokens on a kept past, and keeps only KV made by
    passes of the target's length class (LongRoPE); ``made`` records each pass's end and class.
    """

    def __init__(self, runner: GenaiRunner, max_length: int) -> None:
        self.runner = runner
        self.max_length = max_length
        self.gen = None
        self.tokens: list[int] = []
        self.tokens_run = 0
        self.reuse = getattr(runner, "reuse", None) or ReusePolicy()
        self.made: list[tuple[int, int]] = []  # (end position, length class) of each pass over the held tokens
        self.snapshot: int | None = None  # where the Generator's recurrent state was saved (runner.snapshots)

    def move_to(self, tokens: list[int] | tuple[int, ...], own: int = MIN_PASS_TOKENS,
                keep_at: int | None = None) -> np.ndarray:
        """Hold exactly ``tokens``, running at least ``own`` of them (all of them in a fresh Generator);
        return the logits ``[V]`` that predict the next token.

        ``keep_at``: where the next sequence branches off these tokens. On a package with recurrent state the
        cursor saves the state there (``snapshot_state``) and later rewinds only there (or not at all: its
        state elsewhere is not the one a sequence of those tokens has)."""
        tokens = list(tokens)
        if len(tokens) > self.max_length:
            raise ValueError(f"{len(tokens)} tokens exceed the cursor's max_length {self.max_length}")
        keep = common_prefix(self.tokens, tokens) if self.gen is not None and self.runner.rewind_ok else 0
        keep = min(keep, len(tokens) - max(own, 1), self._valid(len(tokens)))
        if self.runner.snapshots:  # the live state (all tokens held) or the saved one, nothing between
            keep = len(self.tokens) if keep == len(self.tokens) else (
                self.snapshot if self.snapshot is not None and self.snapshot <= keep else 0)
        if self.gen is None or keep <= 0:
            self.gen, self.tokens, self.made, keep = self.runner._generator(self.max_length), [], [], 0
            self.snapshot = None
        elif keep < len(self.tokens):
            self._call(self.gen.rewind_to, keep)
            self.tokens = self.tokens[:keep]
            self.made = [(min(end, keep), c) for i, (end, c) in enumerate(self.made)
                         if i == 0 or self.made[i - 1][0] < keep]
        if keep_at is not None and self.runner.snapshots and self.runner.rewind_ok:
            keep = self._snapshot(tokens, keep, keep_at, max(own, MIN_PASS_TOKENS))
        return self._run(tokens[keep:])

    def _snapshot(self, tokens: list[int], keep: int, at: int, own: int) -> int:
        """Run ``tokens[keep:at]`` and save the recurrent state there, where both passes keep their own tokens
        (``at - keep`` on a kept past, ``own`` after it); returns where the rest starts."""
        if at + own > len(tokens) or not (at - keep >= MIN_PASS_TOKENS or keep == 0 < at):
            return keep
        self._run(tokens[keep:at], logits=False)
        self._call(self.gen.snapshot_state)
        self.snapshot = at
        return at

    def append(self, new: list[int]) -> np.ndarray:
        """Append ``new`` tokens (a decode step); logits ``[V]`` after the last one. Where the held KV was made
        for the other length class than the longer sequence's (a LongRoPE switch crossed), the whole sequence
        runs again in a fresh Generator, as transformers' Phi-3 generation drops its cache there."""
        if self.tokens and self._valid(len(self.tokens) + len(new)) < len(self.tokens):
            held = self.tokens
            self.gen, self.tokens, self.made, self.snapshot = self.runner._generator(self.max_length), [], [], None
            return self._run(held + list(new))
        return self._run(new)

    def _run(self, new: list[int], logits: bool = True) -> np.ndarray | None:
        self._call(self.gen.append_tokens, np.asarray([new], dtype=np.int32))
        self.tokens.extend(new)
        self.tokens_run += len(new)
        self.made.append((len(self.tokens), self.reuse.length_class(len(self.tokens))))
        return np.asarray(self.gen.get_logits())[0, -1] if logits else None

    def _call(self, call, *args) -> None:
        """One Generator call; og's failure (its RuntimeError) becomes one line naming the package."""
        try:
            call(*args)
        except RuntimeError as e:
            raise PackageError(f"{self.runner.package.root}: onnxruntime-genai failed in "
                               f"{getattr(call, '__name__', 'a Generator call')}: {first_line(e)}") from None

    def _valid(self, total: int) -> int:
        """Held tokens whose KV a ``total``-token sequence may keep: those before the first pass of another
        length class."""
        start, want = 0, self.reuse.length_class(total)
        for end, kind in self.made:
            if kind != want:
                return start
            start = end
        return len(self.tokens)

    def tail_logits(self, n: int) -> np.ndarray | None:
        """Logits ``[n, V]`` of the last append's last n positions, if og returns all positions."""
        out = np.asarray(self.gen.get_output(self.runner.package.logits_name))
        if out.ndim != 3 or out.shape[1] < n:
            return None  # pruned LM head or fixed window: only the last position
        return out[0, -n:]
