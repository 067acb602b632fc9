"""Stop sequences as tokens arrive: one request's output text, EOS and stop strings.

Owns :class:`TextStream` (the text of a request's generated tokens, ended at once by EOS, a
stop sequence or max_gen_toks) and :func:`first_stop`. Used by every generation path: the
onnxruntime-genai cursor and batched Generators (engine/generate/og/loops.py) and the raw
shared-prompt sampler (engine/generate/rows/sampler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortevals.engine.generate.choice.settings import GenSettings

log = logging.getLogger(__name__)


def first_stop(text: str, until: Sequence[str], start: int = 0) -> int | None:
    """Index of the earliest stop sequence in ``text`` at or after ``start``, or None."""
    hits = [i for u in until if (i := text.find(u, start)) != -1]
    return min(hits) if hits else None


class TextStream:
    """One request's output as tokens arrive: EOS, a stop sequence or max_gen_toks end it at once.

    As lm-eval's hf backend: stop sequences are looked for in the text decoded with special
    tokens **kept** (its stopping criteria decode that way), so a stop that is a special token
    (``<|im_start|>``, ``<end_of_turn>``) fires; the result is the text decoded with special
    tokens **skipped** (its output decode), cut at the first stop.

    Decoding is incremental (issue 20 §1): each token decodes only a window from the last
    committed chunk (context, so leading-space rules see the token before) to the end, and the
    new text is the window's text past the chunk's; while the text ends inside a character (a
    trailing U+FFFD: byte-fallback or byte-level pieces of a multi-byte character) it is not
    committed and the window grows. Where a decoder rewrites earlier text the window steps back
    (:meth:`_extend`, counted in ``resyncs``). ``decoded`` counts the token ids handed to the
    tokenizer: a few per token, so the work is linear in the output where re-decoding
    everything at every token was quadratic. The text equals a full decode at every token
    (tests/test_stops.py); the stream checks itself once at the end against one."""

    HOLD = 8  # tokens held back (a character is at most 4 bytes) before text ending in U+FFFD is committed

    def __init__(self, tokenizer, s: GenSettings, eos_ids: set[int]) -> None:
        self.tokenizer, self.s, self.eos_ids = tokenizer, s, eos_ids
        self.longest = max((len(u) for u in s.until), default=0)
        self.out: list[int] = []
        self.shown = ""  # decode(out[:committed]) with special tokens kept, built incrementally
        self.text = ""  # decode(out) with special tokens kept (shown + what is held back)
        self._marks: list[tuple[int, int]] = [(0, 0)]  # commit points: (tokens, len(shown) then)
        self.done = self.eos = False  # eos: ended by an EOS token (it is not in ``out``)
        self.stop: int | None = None  # where the first stop starts in the kept-specials text
        self.decoded = self.resyncs = 0
        self._result: tuple[str, int] | None = None

    def _decode(self, ids: Sequence[int], skip: bool = False) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def push(self, tok: int) -> bool:
        """Take the next token; True once the request is finished."""
        if self.done:
            return True
        if tok in self.eos_ids:
            self.done = self.eos = True
            return True
        self.out.append(tok)
        self.text, changed = self._extend()  # the text can only have changed from ``changed`` on
        self.stop = first_stop(self.text, self.s.until, max(0, changed - self.longest))
        self.done = self.stop is not None or len(self.out) >= self.s.max_gen_toks
        return self.done

    def _extend(self) -> tuple[str, int]:
        """(the kept-specials text of ``out`` now, where it may differ from the last one); the text is
        committed to ``shown`` unless it ends inside a character.

        The new text is ``decode(out[a:])`` past ``decode(out[a:b])``, for commit points a < b (the
        last two by default). A decoder may rewrite text before b (ByteFallback decodes a run of byte
        tokens only as a whole: one more byte can turn a finished character back into U+FFFD), so
        when the window's text does not extend its head, a and b step back over earlier commit
        points (1, 2, 4, … of them), down to a full decode at worst."""
        back = 1
        while True:
            b = max(len(self._marks) - back, 0)
            (a_tok, _), (b_tok, b_len) = self._marks[max(b - 1, 0)], self._marks[b]
            head = self._decode(self.out[a_tok:b_tok]) if b > 0 else ""
            full = self._decode(self.out[a_tok:]) if b > 0 else self._decode(self.out)
            if full.startswith(head) and (head or b == 0):  # an empty head (stripped space) proves nothing
                break
            self.resyncs += 1
            back *= 2
        text = self.shown[:b_len] + full[len(head):]
        if not text.endswith("\ufffd") or len(self.out) - self._marks[-1][0] >= self.HOLD:
            self.shown = text
            self._marks = [*self._marks[:b + 1], (len(self.out), len(text))]
        return text, b_len

    @property
    def result(self) -> tuple[str, int]:
        """(text with special tokens skipped, cut at the first stop; tokens generated), as lm-eval hf."""
        if self._result is None or not self.done:
            text = self._decode(self.out, skip=True)
            cut = first_stop(text, self.s.until)
            self._result = (text if cut is None else text[:cut]), len(self.out)
            if self.done:
                self._check()
        return self._result

    def _check(self) -> None:
        """Once: the incremental text equals a full decode, and the stop was found where it is."""
        full = self._decode(self.out)
        if not full.startswith(self.shown) or first_stop(full, self.s.until) != self.stop:
            log.warning("incremental decoding disagreed with a full decode (%d tokens, stop at %s vs %s): the "
                        "stop check may have fired a token late; please report the tokenizer", len(self.out),
                        self.stop, first_stop(full, self.s.until))
