"""Text generation for lm-eval's ``generate_until``.

Owns lm-eval's generation kwargs and their aliases (:func:`parse_gen_kwargs`),
token choice from logits (greedy, or sampling with temperature / top-k / top-p
from a seeded numpy generator: reproducible, pure), stop sequences checked as
tokens arrive (generation stops at once, the text is cut at the first stop),
EOS as a stop, and the loop over a Generator cursor (runtime/genai.py), which
rewinds to the prompt prefix shared with the previous request.

Decoding policy (:data:`SEARCH_POLICY`): the request's gen_kwargs alone decide
the tokens, as in lm-eval. The package's ``search`` section in
genai_config.json (repetition_penalty, min_length, no_repeat_ngram_size, ...)
is not applied on either path: the single-row path chooses tokens here from raw
logits, and the batched path runs og's search with those options neutralised
(runtime/genai.py ``NEUTRAL_SEARCH``) and checks every token it picks against
the logits. Logits that are not finite end the run with an error naming the
request and the step (:func:`check_logits`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ortevals.engine.scoring import describe_request
from ortevals.errors import OrtEvalsError

log = logging.getLogger(__name__)

# Part of the result-store scope: a change of policy must never serve stored generations.
SEARCH_POLICY = "gen_kwargs-only/v1"


@dataclass(frozen=True)
class GenSettings:
    """One request's decoding options, normalised from lm-eval gen_kwargs."""

    until: tuple[str, ...] = ()
    max_gen_toks: int = 256
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234


ALIASES = {"max_new_tokens": "max_gen_toks", "max_tokens": "max_gen_toks", "stop": "until",
           "random_seed": "seed"}
IGNORED = {"num_beams", "repetition_penalty"}  # accepted only at their no-op values


def parse_gen_kwargs(kwargs: dict[str, Any], default_max: int, eot_text: str | None = None,
                     seed: int = 1234) -> GenSettings:
    """lm-eval gen_kwargs → GenSettings; unknown keys and bad values are one-line errors."""
    from lm_eval.models.utils import normalize_gen_kwargs  # lm-eval's own alias priorities

    kw = {ALIASES.get(k, k): v for k, v in normalize_gen_kwargs(dict(kwargs), default_max).items()}
    until = kw.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    if eot_text and eot_text not in until:
        until.append(eot_text)
    for key in IGNORED & set(kw):
        value = kw.pop(key)
        if value not in (1, 1.0, None):
            raise OrtEvalsError(f"gen_kwargs {key}={value!r} is not supported (only greedy/sampling decoding)")
    temperature = float(kw.pop("temperature", 1.0 if kw.get("do_sample") else 0.0))
    do_sample = bool(kw.pop("do_sample", temperature > 0)) and temperature > 0
    settings = GenSettings(
        until=tuple(u for u in until if u), max_gen_toks=int(kw.pop("max_gen_toks", default_max)),
        do_sample=do_sample, temperature=temperature if do_sample else 1.0,
        top_k=int(kw.pop("top_k", 0) or 0), top_p=float(kw.pop("top_p", 1.0) or 1.0),
        seed=int(kw.pop("seed", seed)),
    )
    kw.pop("min_length", None)
    if kw:
        raise OrtEvalsError(f"unknown gen_kwargs {sorted(kw)}; expected until, max_gen_toks, do_sample, "
                            "temperature, top_k, top_p, seed")
    if settings.max_gen_toks <= 0 or not 0 < settings.top_p <= 1 or settings.top_k < 0:
        raise OrtEvalsError(f"gen_kwargs out of range: {settings}")
    return settings


def choose_token(logits: np.ndarray, s: GenSettings, rng: np.random.Generator) -> int:
    """Greedy argmax, or a sample after temperature, top-k and top-p (logits: ``[V]``)."""
    if not s.do_sample:
        return int(np.argmax(logits))
    x = np.asarray(logits, dtype=np.float64) / s.temperature
    if s.top_k and s.top_k < x.shape[0]:
        kth = np.partition(x, -s.top_k)[-s.top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if s.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < s.top_p  # smallest set whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.shape[0], p=p))


def check_logits(logits: np.ndarray, step: int, request: str) -> None:
    """Raise if ``logits [V]`` hold a NaN or +inf, or no finite value (all -inf).

    One reduction: max() is NaN if any value is, +inf if any is, -inf only if all are.
    ``step`` counts generated tokens from 1; ``request`` names the request.
    """
    top = float(np.max(logits))
    if np.isfinite(top):
        return
    what = "NaN" if np.isnan(top) else ("+inf" if top > 0 else "all -inf")
    raise OrtEvalsError(f"non-finite logits ({what}) at generated token {step} for {request}; "
                        "the model overflowed (fp16?) or its weights hold NaN/inf")


def request_name(index: int, request=None, context: Sequence[int] = (), tokenizer=None) -> str:
    """``request #3 (task gsm8k, doc 7; prompt 'The capital of…')``, on one line.

    ``request``: lm-eval's Instance (its task, doc id and prompt text); without it the prompt is
    decoded from ``context`` (which may be left-truncated)."""
    task, doc = getattr(request, "task_name", None), getattr(request, "doc_id", None)
    if request is not None:
        text = str(request.args[0])
    else:
        text = tokenizer.decode(list(context[:24]), skip_special_tokens=True) if tokenizer else ""
    where = f"task {task}, doc {doc}; " if task is not None else ""
    return f"request #{index} ({where}prompt {describe_request(' '.join(text.split()))})"


def first_stop(text: str, until: Sequence[str], start: int = 0) -> int | None:
    """Index of the earliest stop sequence in ``text`` at or after ``start``, or None."""
    hits = [i for u in until if (i := text.find(u, start)) != -1]
    return min(hits) if hits else None


class TextStream:
    """One request's output as tokens arrive: EOS and stop sequences end it at once."""

    def __init__(self, tokenizer, s: GenSettings, eos_ids: set[int]) -> None:
        self.tokenizer, self.s, self.eos_ids = tokenizer, s, eos_ids
        self.longest = max((len(u) for u in s.until), default=0)
        self.out: list[int] = []
        self.text = ""
        self.done = False

    def push(self, tok: int) -> bool:
        """Take the next token; True once the request is finished."""
        if self.done:
            return True
        if tok in self.eos_ids:
            self.done = True
            return True
        self.out.append(tok)
        previous = len(self.text)
        self.text = self.tokenizer.decode(self.out, skip_special_tokens=True)  # as lm-eval hf decodes
        cut = first_stop(self.text, self.s.until, max(0, previous - self.longest))
        if cut is not None:  # stop at once: no tokens past the stop sequence
            self.text = self.text[:cut]
            self.done = True
        self.done = self.done or len(self.out) >= self.s.max_gen_toks
        return self.done

    @property
    def result(self) -> tuple[str, int]:
        return self.text, len(self.out)


def generate(cursor, tokenizer, context: Sequence[int], s: GenSettings, eos_ids: set[int],
             rng: np.random.Generator, name: str | None = None) -> tuple[str, int]:
    """Generate after ``context``; return (text cut at the first stop, tokens generated).

    ``name`` (see :func:`request_name`) names the request in errors."""
    stream = TextStream(tokenizer, s, eos_ids)
    logits = cursor.move_to(list(context))
    while True:
        if not np.isfinite(np.max(logits)):
            check_logits(logits, len(stream.out) + 1, name or request_name(0, None, context, tokenizer))
        if stream.push(choose_token(logits, s, rng)):
            return stream.result
        logits = cursor.append([stream.out[-1]])


def can_batch(context: Sequence[int], s: GenSettings, pad_id: int | None) -> bool:
    """Whether a request may join a batched Generator: greedy (og's own search picks the
    tokens), and not ending in the pad id (og masks trailing pad ids as padding)."""
    return not s.do_sample and len(context) > 0 and pad_id is not None and context[-1] != pad_id


def generate_batch(runner, tokenizer, contexts: Sequence[Sequence[int]], settings: Sequence[GenSettings],
                   eos_ids: set[int], names: Sequence[str] | None = None) -> list[tuple[str, int]]:
    """Greedy generation for several requests in one batched Generator; each row stops on its
    own EOS, stop sequence or max_gen_toks, and the batch ends when every row has.

    og's search picks the tokens; each row that is still running is checked: finite logits,
    and a token that attains their maximum (what choose_token's argmax would pick), so no
    search option og applies can make batched output differ from single-row output unseen."""
    streams = [TextStream(tokenizer, s, eos_ids) for s in settings]
    steps = runner.greedy_steps([list(c) for c in contexts], max(s.max_gen_toks for s in settings))
    try:
        for tokens, logits in steps:  # tokens: [B], logits: [B,V]
            for row, stream in enumerate(streams):
                if not stream.done:
                    _check_row(logits[row], int(tokens[row]), len(stream.out) + 1,
                               lambda r=row: names[r] if names else request_name(r, None, contexts[r], tokenizer))
            # a list, not a generator: every row must take its token before all() decides
            if all([stream.push(int(t)) for stream, t in zip(streams, tokens, strict=True)]):
                break
    finally:
        steps.close()
    return [stream.result for stream in streams]


def _check_row(logits: np.ndarray, token: int, step: int, name) -> None:
    """One batched row's step: finite logits (else the NaN error), and og's token at their max."""
    top = np.max(logits)
    if not np.isfinite(top):
        check_logits(logits, step, name())
    if logits[token] != top:
        raise OrtEvalsError(f"onnxruntime-genai's search chose token {token} (logit {float(logits[token]):.6g}) "
                            f"over the maximum {float(top):.6g} at generated token {step} for {name()}; its "
                            f"search is not plain greedy here: run with gen_batch_size=1")
