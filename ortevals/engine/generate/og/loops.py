"""onnxruntime-genai's generation loops for lm-eval's ``generate_until``.

Owns the loop over a Generator cursor (runtime/genai.py), which rewinds to the prompt
prefix shared with the previous request, and batched greedy Generators (og's search
with every token-changing option neutral, each token checked against the logits);
token choice from logits (delegated to :mod:`ortevals.engine.generate.choice.logits`: greedy,
the filters, penalties and Mirostat, from a seeded numpy generator: reproducible, pure),
stop sequences checked as tokens arrive (:mod:`ortevals.engine.generate.choice.stops`: generation
stops at once, the text is cut at the first stop), EOS as a stop. Decoding settings and
the policy live in :mod:`ortevals.engine.generate.choice.settings`. Logits that are not finite
end the run with an error naming the request and the step
(:func:`ortevals.engine.generate.choice.logits.check_logits`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ortevals.engine.generate.choice.certainty import RunningCertainty
from ortevals.engine.generate.choice.logits import Sampler, check_logits
from ortevals.engine.generate.choice.settings import GenSettings
from ortevals.engine.generate.choice.stops import TextStream
from ortevals.engine.score.scoring import describe_request
from ortevals.errors import OrtEvalsError

log = logging.getLogger(__name__)

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


def generate(cursor, tokenizer, context: Sequence[int], s: GenSettings, eos_ids: set[int],
             rng: np.random.Generator, name: str | None = None,
             certainty: RunningCertainty | None = None, keep_at: int | None = None) -> tuple[str, int]:
    """Generate after ``context``; return (text cut at the first stop, tokens generated).

    ``name`` (see :func:`request_name`) names the request in errors. ``certainty`` (one row): each drawn
    token's raw logits added, as the raw sampler adds them (self-certainty, engine/generate/choice/certainty.py).
    ``keep_at``: where the next prompt branches off this one (the cursor keeps recurrent state there)."""
    if s.num_beams > 1 or s.mbr_samples > 1:  # a safety net: the scheduler routes these to the raw path
        raise OrtEvalsError(f"gen_kwargs num_beams={s.num_beams}/mbr_samples={s.mbr_samples} need the "
                            "raw-onnxruntime generation path, not the onnxruntime-genai cursor")
    stream = TextStream(tokenizer, s, eos_ids)
    sampler = Sampler(s, [rng])
    logits = cursor.move_to(list(context), keep_at=keep_at) if keep_at else cursor.move_to(list(context))
    while True:
        if not np.isfinite(np.max(logits)):
            check_logits(logits, len(stream.out) + 1, name or request_name(0, None, context, tokenizer))
        if certainty is not None:
            certainty.add(logits[None, :], [0])
        if stream.push(int(sampler.choose(logits[None, :], [[*context, *stream.out]])[0])):
            return stream.result
        logits = cursor.append([stream.out[-1]])


def can_batch(context: Sequence[int], s: GenSettings, pad_id: int | None) -> bool:
    """Whether a request may join a batched Generator: plain greedy (og's own search picks the
    tokens; no penalty, beam or MBR), and not ending in the pad id (og masks trailing pad ids as padding)."""
    return not s.do_sample and s.plain and len(context) > 0 and pad_id is not None and context[-1] != pad_id


def generate_batch(runner, tokenizer, contexts: Sequence[Sequence[int]], settings: Sequence[GenSettings],
                   eos_ids: set[int], names: Sequence[str] | None = None,
                   certainty: RunningCertainty | None = None) -> list[tuple[str, int]]:
    """Greedy generation for several requests in one batched Generator; each row stops on its
    own EOS, stop sequence or max_gen_toks, and the batch ends when every row has. ``certainty`` (a row
    per context): each running row's logits added at each of its tokens.

    og's search picks the tokens; each row that is still running is checked: finite logits,
    and a token that attains their maximum (what choose_token's argmax would pick), so no
    search option og applies can make batched output differ from single-row output unseen."""
    streams = [TextStream(tokenizer, s, eos_ids) for s in settings]
    steps = runner.greedy_steps([list(c) for c in contexts], max(s.max_gen_toks for s in settings))
    try:
        for tokens, logits in steps:  # tokens: [B], logits: [B,V]
            running = [row for row, stream in enumerate(streams) if not stream.done]
            for row in running:
                _check_row(logits[row], int(tokens[row]), len(streams[row].out) + 1,
                           lambda r=row: names[r] if names else request_name(r, None, contexts[r], tokenizer))
            if certainty is not None:
                certainty.add(logits[running], running)
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
