"""One request's decoding settings: lm-eval's gen_kwargs, normalised and checked.

Owns :class:`GenSettings`, :func:`parse_gen_kwargs` (lm-eval's aliases, each bad value or
combination a one-line error naming the field) and the decoding policy :data:`SEARCH_POLICY`:
the request's gen_kwargs alone decide the tokens, as in lm-eval (docs/decoding.md lists them).
The package's ``search`` section in genai_config.json (repetition_penalty, min_length,
no_repeat_ngram_size, ...) is applied on neither path: the single-row path chooses tokens from
raw logits, and the batched path runs og's search with those options neutralised
(runtime/genai.py ``NEUTRAL_SEARCH``) and checks every token it picks against the logits.
Below every other module of engine/generate/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ortevals.errors import OrtEvalsError

# Part of the result-store scope: a change of policy must never serve stored generations.
# v2: the gen_kwargs grew (min_p, typical_p, Mirostat, repetition penalty, no-repeat n-gram, beam
# search, diverse beam search, MBR); see docs/decoding.md.
SEARCH_POLICY = "gen_kwargs-only/v2"


@dataclass(frozen=True)
class GenSettings:
    """One request's decoding options, normalised from lm-eval gen_kwargs (docs/decoding.md).

    Off values: top_k 0, top_p 1, min_p 0, typical_p 1, mirostat_tau 0, repetition_penalty 1,
    no_repeat_ngram_size 0, num_beams 1, num_beam_groups 1, mbr_samples 0."""

    until: tuple[str, ...] = ()
    max_gen_toks: int = 256
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234
    min_p: float = 0.0
    typical_p: float = 1.0
    mirostat_tau: float = 0.0
    mirostat_eta: float = 0.1
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    mbr_samples: int = 0
    mbr_metric: str = "chrf"

    @property
    def plain(self) -> bool:
        """Plain greedy or plain sampling: no penalty, no search, no MBR (what og's batched
        greedy Generator may serve)."""
        return (self.repetition_penalty == 1.0 and self.no_repeat_ngram_size == 0 and self.num_beams == 1
                and self.mbr_samples < 2 and self.mirostat_tau == 0.0)


ALIASES = {"max_new_tokens": "max_gen_toks", "max_tokens": "max_gen_toks", "stop": "until",
           "random_seed": "seed"}
MBR_METRICS = ("exact", "chrf", "rouge")
# field: (parser, default, check, what the check expects)
_NUMERIC = {
    "top_k": (int, 0, lambda v: v >= 0, "an integer >= 0"),
    "top_p": (float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (float, 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "typical_p": (float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "mirostat_tau": (float, 0.0, lambda v: v >= 0, "a number >= 0 (target surprise in bits; 0 = off)"),
    "mirostat_eta": (float, 0.1, lambda v: v > 0, "a number > 0"),
    "repetition_penalty": (float, 1.0, lambda v: v > 0, "a number > 0"),
    "no_repeat_ngram_size": (int, 0, lambda v: v >= 0, "an integer >= 0"),
    "num_beams": (int, 1, lambda v: v >= 1, "an integer >= 1"),
    "length_penalty": (float, 1.0, lambda v: np.isfinite(v), "a finite number"),
    "num_beam_groups": (int, 1, lambda v: v >= 1, "an integer >= 1"),
    "diversity_penalty": (float, 0.0, lambda v: v >= 0, "a number >= 0"),
    "mbr_samples": (int, 0, lambda v: v >= 0, "an integer >= 0"),
    "max_gen_toks": (int, 256, lambda v: v > 0, "an integer > 0"),
}


def _field(kw: dict, key: str, default=None):
    """Pop one numeric gen_kwarg, parsed and range-checked; a bad value is a one-line error."""
    parse, fallback, ok, expect = _NUMERIC[key]
    value = kw.pop(key, None)
    if value is None:
        return fallback if default is None else default
    try:
        if isinstance(value, bool) or (parse is int and float(value) != int(float(value))):
            raise ValueError
        parsed = parse(float(value)) if parse is int else parse(value)
    except (TypeError, ValueError, OverflowError):
        raise OrtEvalsError(f"gen_kwargs {key}={value!r}: expected {expect}") from None
    if not ok(parsed) or not np.isfinite(parsed):  # inf passed "> 0" checks: random tokens, or none at all
        raise OrtEvalsError(f"gen_kwargs {key}={value!r}: expected {expect}{'' if 'finite' in expect else ', finite'}")
    return parsed


def _temperature(value) -> float:
    """A finite number >= 0 (0: greedy); inf would draw uniformly random tokens, nan none."""
    try:
        t = float(value)
    except (TypeError, ValueError):
        t = float("nan")
    if isinstance(value, bool) or not (np.isfinite(t) and t >= 0):
        raise OrtEvalsError(f"gen_kwargs temperature={value!r}: expected a finite number >= 0 (0 = greedy)")
    return t


def _seed(value) -> int:
    try:
        if not isinstance(value, bool) and float(value) == int(float(value)):
            return int(float(value))
    except (TypeError, ValueError, OverflowError):
        pass
    raise OrtEvalsError(f"gen_kwargs seed={value!r}: expected an integer")


def _mirostat(kw: dict) -> tuple[float, float]:
    """(tau, eta); llama.cpp's ``mirostat`` switch (0 or 2) is accepted, tau 5 when only it is given."""
    mode = kw.pop("mirostat", None)
    if mode not in (None, 0, 2, "0", "2"):
        raise OrtEvalsError(f"gen_kwargs mirostat={mode!r}: expected 0 (off) or 2 (Mirostat v2; v1 is not "
                            "implemented)")
    tau = _field(kw, "mirostat_tau", 5.0 if mode in (2, "2") else None)
    return tau, _field(kw, "mirostat_eta")


def _early_stopping(kw: dict) -> bool | str:
    value = kw.pop("early_stopping", False)
    if value in (True, False, "never"):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise OrtEvalsError(f"gen_kwargs early_stopping={value!r}: expected true, false or \"never\"")


def parse_gen_kwargs(kwargs: dict[str, Any], default_max: int, eot_text: str | None = None,
                     seed: int = 1234) -> GenSettings:
    """lm-eval gen_kwargs → GenSettings; unknown keys and bad values are one-line errors naming the field."""
    from lm_eval.models.utils import normalize_gen_kwargs  # lm-eval's own alias priorities

    if "temperature" in kwargs:  # lm-eval's normalizing calls float() on it: named here first
        _temperature(kwargs["temperature"])
    try:
        normalized = normalize_gen_kwargs(dict(kwargs), default_max)
    except (TypeError, ValueError, OverflowError):  # its int() of max_gen_toks and its aliases
        token_keys = [k for k in kwargs if k in ("max_gen_toks", "max_completion_tokens", *ALIASES)]
        shown = ", ".join(f"{k}={kwargs[k]!r}" for k in token_keys) or repr(kwargs)
        raise OrtEvalsError(f"gen_kwargs {shown}: expected an integer > 0") from None
    kw = {ALIASES.get(k, k): v for k, v in normalized.items()}
    until = kw.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    if eot_text and eot_text not in until:
        until.append(eot_text)
    temperature = _temperature(kw.pop("temperature", 1.0 if kw.get("do_sample") else 0.0))
    do_sample = bool(kw.pop("do_sample", temperature > 0)) and temperature > 0
    tau, eta = _mirostat(kw)
    fields = {key: _field(kw, key) for key in _NUMERIC if key not in ("mirostat_tau", "mirostat_eta", "max_gen_toks")}
    fields["max_gen_toks"] = _field(kw, "max_gen_toks", default_max)
    metric = str(kw.pop("mbr_metric", "chrf")).lower()
    settings = GenSettings(
        until=tuple(u for u in until if u), do_sample=do_sample, temperature=temperature if do_sample else 1.0,
        seed=_seed(kw.pop("seed", seed)), mirostat_tau=tau, mirostat_eta=eta,
        early_stopping=_early_stopping(kw), mbr_metric=metric, **fields)
    kw.pop("min_length", None)
    if kw:
        raise OrtEvalsError(f"unknown gen_kwargs {sorted(kw)}; expected until, max_gen_toks, do_sample, temperature, "
                            "seed, " + ", ".join(k for k in _NUMERIC if k != "max_gen_toks")
                            + ", mirostat, early_stopping, mbr_metric")
    _check_combination(settings)
    return settings


def _check_combination(s: GenSettings) -> None:
    """Options that cannot go together: one line naming them."""
    if s.mbr_metric not in MBR_METRICS:
        raise OrtEvalsError(f"gen_kwargs mbr_metric={s.mbr_metric!r}: expected one of {', '.join(MBR_METRICS)}")
    if s.num_beams % s.num_beam_groups:
        raise OrtEvalsError(f"gen_kwargs num_beam_groups={s.num_beam_groups}: expected a divisor of "
                            f"num_beams={s.num_beams}")
    if s.diversity_penalty > 0 and s.num_beam_groups == 1:
        raise OrtEvalsError(f"gen_kwargs diversity_penalty={s.diversity_penalty} needs num_beam_groups > 1")
    if s.num_beams > 1 and (s.do_sample or s.mbr_samples > 1):
        raise OrtEvalsError(f"gen_kwargs num_beams={s.num_beams}: beam search is deterministic; it does not go "
                            "with do_sample/temperature > 0 or mbr_samples")
    for key, on in (("mirostat_tau", s.mirostat_tau > 0), ("mbr_samples", s.mbr_samples > 1)):
        if on and not s.do_sample:
            raise OrtEvalsError(f"gen_kwargs {key}={getattr(s, key)} samples: set do_sample=True or temperature > 0")
    if s.mirostat_tau > 0 and (s.top_k or s.top_p < 1 or s.min_p > 0 or s.typical_p < 1):
        raise OrtEvalsError("gen_kwargs mirostat_tau replaces top_k/top_p/min_p/typical_p: give one or the other")
