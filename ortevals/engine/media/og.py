"""Log-likelihood and generation for requests that carry images or audio.

Owns :class:`MediaRequest` (a context, an optional continuation, its media and
decoding settings) and :class:`MediaEngine`, which answers them through
onnxruntime-genai's own processor and pipeline (:mod:`ortevals.runtime.media`):

* requests with the same context and media form one group: the processor, the
  vision/speech models and the prefill run once per group, on one Generator;
* ``loglikelihood``: a one-token continuation is scored from the prefill logits;
  a longer one appends its tokens, then ``rewind_to`` the context length, exact
  in og 0.18 on a full KV cache (tests/test_multimodal.py). A windowed sliding KV
  cache is not exact after a rewind (measured 0.03 logit error on the fixture),
  so there every further continuation gets a fresh Generator;
* ``generate``: stops, EOS, sampling (penalties over prompt + output, Mirostat) and
  seeds (``sample_rng``) as on the text path, through the same loop
  (:func:`ortevals.engine.generate.og.loops.generate`), one request at a time (batch 1: og's
  Gemma-4 processor ignores a list of prompts); repeats of a group reuse its
  prefill by rewinding, or a fresh Generator where rewinding is not exact.

Continuations are tokenized as lm-eval's ``_encode_pair`` does (trailing spaces
of the context move to the continuation; the continuation's ids are those of
context + continuation past the context's). Markers are placed by
:func:`ortevals.package.multimodal.place_markers`. A prompt longer than the
context limit is an error: an image cannot be left-truncated.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ortevals.engine.generate.choice.seeds import sample_rng
from ortevals.engine.generate.choice.settings import GenSettings
from ortevals.engine.generate.og.loops import generate
from ortevals.engine.score.scoring import NonFiniteScore, check_finite, continuation_logprob, describe_request
from ortevals.errors import OrtEvalsError
from ortevals.package.loader import ModelPackage
from ortevals.package.media import Media
from ortevals.package.multimodal import MultimodalSpec, multimodal_spec, place_markers
from ortevals.runtime.providers import from_package

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MediaRequest:
    """One request with media. ``continuation`` is set for loglikelihood, ``gen`` for generation."""

    context: str
    continuation: str | None = None
    media: tuple[Media, ...] = ()
    gen: GenSettings | None = None

    def describe(self) -> str:
        kinds = [m.kind for m in self.media]
        return (f"{describe_request(self.context, self.continuation or '')} with "
                f"{kinds.count('image')} image(s), {kinds.count('audio')} audio clip(s)")


def split_context(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's rule: trailing whitespace of the context belongs to the continuation."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


class MediaEngine:
    """Answers :class:`MediaRequest` lists; opens onnxruntime-genai on the first one. Build with :meth:`open`."""

    def __init__(self, package: ModelPackage, tokenizer, spec: MultimodalSpec, provider, max_length: int,
                 eos_ids: set[int]) -> None:
        self.package = package
        self.tokenizer = tokenizer
        self.spec = spec
        self.provider = provider
        self.max_length = max_length
        self.eos_ids = eos_ids
        self.rewind_ok = not package.windowed and not package.recurrent  # recurrent: og rewinds to a snapshot only
        self._runner = None
        self.bos_text = _bos_text(tokenizer)

    @classmethod
    def open(cls, package: ModelPackage, tokenizer, provider=None, max_length: int | None = None,
             eos_ids: set[int] | None = None, spec: MultimodalSpec | None = None) -> MediaEngine:
        """Validate the package for media (one-line errors naming the field); no model is opened yet.

        Which class serves a package (``media_path``) is :func:`ortevals.engine.media.paths.open_media`'s
        choice; ``spec``: the package's checked media spec when the caller has it."""
        spec = spec if spec is not None else multimodal_spec(package)
        provider = provider or from_package(package.decoder.session_options)
        eos = set(eos_ids or ()) | set(package.eos_token_ids)
        if tokenizer.special.eos_id is not None:
            eos.add(tokenizer.special.eos_id)
        return cls(package, tokenizer, spec, provider, max_length or package.context_length or 2048, eos)

    @property
    def runner(self):
        """The og model with vision and speech (opened on first use)."""
        if self._runner is None:
            from ortevals.runtime.media import MediaRunner

            self._runner = MediaRunner.open(self.package, self.provider)
            if not self.rewind_ok:
                log.info("media path: fresh Generator per continuation (%s keeps %s)", self.package.root,
                         "recurrent state" if self.package.recurrent else "a windowed sliding KV cache")
        return self._runner

    def prompt(self, context: str, media: Sequence[Media]) -> str:
        """The text handed to og's processor: BOS where the text path adds it, then markers and context."""
        kinds = [m.kind for m in media]
        body = context[len(self.bos_text):] if self.bos_text and context.startswith(self.bos_text) else context
        return self.bos_text + place_markers(self.spec, body, kinds.count("image"), kinds.count("audio"))

    def continuation_ids(self, context: str, continuation: str) -> list[int]:
        """The continuation's token ids, as lm-eval's ``_encode_pair`` cuts them."""
        whole = self.tokenizer.encode(context + continuation, add_special_tokens=False)
        ctx = self.tokenizer.encode(context, add_special_tokens=False)
        return whole[len(ctx):]

    # --- loglikelihood ---------------------------------------------------------------------
    def loglikelihood(self, reqs: Sequence[MediaRequest],
                      on_done: Callable[[int, tuple[float, bool]], None] | None = None) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) per request, in order; ``on_done(index, result)`` as each finishes."""
        out: list[tuple[float, bool] | None] = [None] * len(reqs)
        for key, members in _groups(reqs, lambda r: split_context(r.context, r.continuation or "")[0]).items():
            context, media = key
            conts = []
            for i in members:
                if reqs[i].continuation is None:
                    raise OrtEvalsError(f"loglikelihood request {reqs[i].describe()} has no continuation")
                ids = self.continuation_ids(*split_context(reqs[i].context, reqs[i].continuation))
                if not ids:
                    raise OrtEvalsError(f"loglikelihood request {reqs[i].describe()}: the continuation is empty "
                                        "after tokenization")
                conts.append(ids)
            for i, result in zip(members, self._score_group(context, media, conts, reqs[members[0]]), strict=True):
                out[i] = result
                if on_done is not None:
                    on_done(i, result)
        return out  # type: ignore[return-value]

    def _score_group(self, context: str, media: tuple[Media, ...], conts: list[list[int]],
                     first: MediaRequest) -> list[tuple[float, bool]]:
        name = f"loglikelihood request {first.describe()}"
        processed = self.runner.process(self.prompt(context, media), media, name)
        n = len(processed.input_ids)
        self._check_length(n + max(len(c) for c in conts) - 1, name)
        width = n + max(len(c) for c in conts)
        gen = self.runner.generator(processed, width, name)
        prefill = self.runner.last_logits(gen).copy()  # predicts each continuation's first token
        results, clean = [], True
        for cont in conts:
            rows = [prefill[None]]
            if len(cont) > 1:
                if not clean:  # the last continuation moved a windowed cache: start again from the media
                    gen = self.runner.generator(processed, width, name)
                rows.append(self.runner.append(gen, cont[:-1]))
                if self.rewind_ok:
                    gen.rewind_to(n)
                else:
                    clean = False
            logprob, greedy = continuation_logprob(np.concatenate(rows), cont)
            results.append((check_finite(logprob, name), greedy))
        return results

    # --- generation ------------------------------------------------------------------------
    def generate(self, reqs: Sequence[MediaRequest], keys: Sequence[list] | None = None,
                 on_done: Callable[[int, str, int], None] | None = None) -> list[str]:
        """Generated text per request; ``keys`` seed sampling per request (default: its text, media and
        occurrence); ``on_done(index, text, n_tokens)`` as each finishes."""
        keys = list(keys) if keys is not None else _default_keys(reqs)
        out = [""] * len(reqs)
        for (context, media), members in _groups(reqs, lambda r: r.context).items():
            settings = [reqs[i].gen or GenSettings() for i in members]
            name = f"generate_until request {reqs[members[0]].describe()}"
            processed = self.runner.process(self.prompt(context, media), media, name)
            n = len(processed.input_ids)
            longest = max(s.max_gen_toks for s in settings)
            self._check_length(n + longest, name)
            gen = self.runner.generator(processed, n + longest, name)
            prefill = self.runner.last_logits(gen).copy()
            for j, (i, s) in enumerate(zip(members, settings, strict=True)):
                if j and self.rewind_ok:
                    gen.rewind_to(n)
                elif j:
                    gen = self.runner.generator(processed, n + longest, name)
                text, count = generate(_PrefilledCursor(self.runner, gen, prefill), self.tokenizer,
                                       processed.input_ids, s, self.eos_ids, sample_rng(s.seed, keys[i]),
                                       f"generate_until request {reqs[i].describe()}")
                out[i] = text
                if on_done is not None:
                    on_done(i, text, count)
        return out

    def _check_length(self, tokens: int, name: str) -> None:
        if tokens > self.max_length:
            raise OrtEvalsError(f"{name}: {tokens} tokens (prompt with image/audio tokens + continuation or "
                                f"max_gen_toks) exceed max_length={self.max_length}; a prompt with media cannot be "
                                "left-truncated")


def _bos_text(tokenizer) -> str:
    """The BOS text to put in front of a media prompt: og's processor adds none, the text path may."""
    bos_id, bos_text = tokenizer.special.bos_id, tokenizer.special.bos_text
    if bos_id is None or not bos_text:
        return ""
    ids = tokenizer.encode("a")
    return bos_text if ids and ids[0] == bos_id else ""


def _groups(reqs: Sequence[MediaRequest], context_of) -> dict[tuple[str, tuple[Media, ...]], list[int]]:
    """Request indices by (context, media), in first-seen order."""
    groups: dict[tuple[str, tuple[Media, ...]], list[int]] = {}
    for i, r in enumerate(reqs):
        if not r.media:
            raise OrtEvalsError(f"request {r.describe()} has no media; text requests go to the text path")
        groups.setdefault((context_of(r), tuple(r.media)), []).append(i)
    return groups


def media_digest(media: Sequence[Media]) -> list[str]:
    """Short content hashes of the media, for store keys and seeds."""
    return [f"{m.kind}:{hashlib.sha256(m.data).hexdigest()[:16]}" for m in media]


def _default_keys(reqs: Sequence[MediaRequest]) -> list[list]:
    seen: dict[tuple, int] = {}
    keys = []
    for r in reqs:
        k = (r.context, tuple(media_digest(r.media)), r.gen)
        seen[k] = seen.get(k, -1) + 1
        keys.append([r.context, list(k[1]), seen[k]])
    return keys


class _PrefilledCursor:
    """engine/generate/og/loops.py's cursor on a Generator already holding the prompt and media: ``move_to``
    returns the prefill logits ``[V]`` (the prompt ids are only the penalties' history), ``append``
    the logits ``[V]`` after new tokens."""

    def __init__(self, runner, gen, prefill: np.ndarray) -> None:
        self.runner, self.gen, self.prefill = runner, gen, prefill

    def move_to(self, tokens) -> np.ndarray:
        return self.prefill

    def append(self, new: list[int]) -> np.ndarray:
        return self.runner.append(self.gen, list(new))[-1]


__all__ = ["MediaEngine", "MediaRequest", "NonFiniteScore", "split_context", "media_digest"]
