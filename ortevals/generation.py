"""Text generation for lm-eval's ``generate_until``.

Owns lm-eval's generation kwargs and their aliases (:func:`parse_gen_kwargs`),
token choice from logits (greedy, or sampling with temperature / top-k / top-p
from a seeded numpy generator: reproducible, pure), stop sequences checked as
tokens arrive (generation stops at once, the text is cut at the first stop),
EOS as a stop, and the loop over a Generator cursor (runtime/genai.py), which
rewinds to the prompt prefix shared with the previous request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ortevals.errors import OrtEvalsError

log = logging.getLogger(__name__)


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


def first_stop(text: str, until: Sequence[str], start: int = 0) -> int | None:
    """Index of the earliest stop sequence in ``text`` at or after ``start``, or None."""
    hits = [i for u in until if (i := text.find(u, start)) != -1]
    return min(hits) if hits else None


def generate(cursor, tokenizer, context: Sequence[int], s: GenSettings, eos_ids: set[int],
             rng: np.random.Generator) -> tuple[str, int]:
    """Generate after ``context``; return (text cut at the first stop, tokens generated)."""
    logits = cursor.move_to(list(context))
    out: list[int] = []
    longest = max((len(u) for u in s.until), default=0)
    text = ""
    while len(out) < s.max_gen_toks:
        tok = choose_token(logits, s, rng)
        if tok in eos_ids:
            break
        out.append(tok)
        previous = len(text)
        text = tokenizer.decode(out, skip_special_tokens=True)  # as lm-eval hf decodes
        cut = first_stop(text, s.until, max(0, previous - longest))
        if cut is not None:  # stop at once: no tokens past the stop sequence
            return text[:cut], len(out)
        if len(out) < s.max_gen_toks:
            logits = cursor.append([tok])
    return text, len(out)
