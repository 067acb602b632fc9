"""Stop sequences as tokens arrive: one request's output text, EOS and stop strings.

Owns :class:`TextStream` (the text of a request's generated tokens, ended at once by EOS, a
stop sequence or max_gen_toks) and :func:`first_stop`. Used by every generation path: the
onnxruntime-genai cursor and batched Generators (engine/generation.py) and the raw
shared-prompt sampler (engine/sampler.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortevals.engine.generation import GenSettings


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
