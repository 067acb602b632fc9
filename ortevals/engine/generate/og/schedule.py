"""Generation scheduling on onnxruntime-genai: which requests run where, and in what order.

Owns the split of prompts (ids and settings already made: ortevals/run/generate.py) between
batched greedy Generators (``gen_batch_size``) and the one rewinding cursor (prompts sorted so
those sharing a few-shot header are adjacent), and the per-request sampling seed; each finished
text goes to the caller's ``finish``. Token choice and stop sequences live in
:mod:`ortevals.engine.generate.og.loops`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ortevals.engine.generate.choice.certainty import RunningCertainty
from ortevals.engine.generate.choice.seeds import sample_rng
from ortevals.engine.generate.og.loops import can_batch, generate, generate_batch
from ortevals.engine.score.prefill import MIN_OWN_TOKENS
from ortevals.tokens import common_prefix

log = logging.getLogger(__name__)


def run_generation(runner, tokenizer, items: Sequence[tuple[list[int], object]], keys: Sequence[list],
                   eos: set[int], width: int, pad_id: int | None, finish: Callable[..., None],
                   name: Callable[[int], str] = lambda i: f"request #{i}", prefix_reuse: bool = True,
                   certainty: bool = False, switch: int | None = None) -> None:
    """Generate every item; ``finish(index, text, tokens)`` fires as each one ends (``certainty``: with the
    keyword ``certainty``, the sample's self-certainty from og's logits: engine/generate/choice/certainty.py).

    width: greedy requests per batched Generator (1: all go through the rewinding cursor).
    name: how an error names request i. prefix_reuse: False gives each request its own Generator
    (exact mode, or the generation canary's verdict: engine/generate/canary.py). switch: a LongRoPE switch
    (package/reuse.py): a batched Generator would cross it without running its rows again (og does that at
    batch 1 and 4,097 tokens only), so requests that may cross it go through the cursor, which does.
    """
    batched = [i for i in range(len(items)) if width > 1 and can_batch(*items[i], pad_id)]
    if switch is not None and batched:  # a batch pads to its longest prompt: bound by the longest of all
        most = max(items[i][1].max_gen_toks for i in batched)
        batched = [i for i in batched if len(items[i][0]) + most <= switch]
    singles = sorted(set(range(len(items))) - set(batched), key=lambda i: items[i][0])
    log.info("generate_until: %d requests on the incremental path (%d in batches of up to %d)",
             len(items), len(batched), width)

    def done(i: int, text: str, n: int, c: float) -> None:
        finish(i, text, n, **({"certainty": c} if certainty else {}))

    batched.sort(key=lambda i: len(items[i][0]))  # similar lengths: little padding
    for chunk in (batched[j:j + width] for j in range(0, len(batched), width)):
        kept = RunningCertainty(len(chunk))
        outs = generate_batch(runner, tokenizer, [items[i][0] for i in chunk], [items[i][1] for i in chunk], eos,
                              names=[name(i) for i in chunk], certainty=kept)
        for i, (text, n), c in zip(chunk, outs, kept.values(), strict=True):
            done(i, text, n, float(c))
    if singles:
        cursor = runner.cursor(max(len(items[i][0]) + items[i][1].max_gen_toks for i in singles))
        # prompts sharing a prefix are adjacent: the cursor rewinds instead of re-running it (to where it kept
        # a recurrent state: where the next prompt branches off)
        for j, i in enumerate(singles):
            ids, settings = items[i]
            rng = sample_rng(settings.seed, keys[i])
            here = cursor if prefix_reuse else runner.cursor(len(ids) + settings.max_gen_toks)
            after = items[singles[j + 1]][0] if prefix_reuse and j + 1 < len(singles) else None
            kept = RunningCertainty(1)
            text, n = generate(here, tokenizer, ids, settings, eos, rng, name=name(i), certainty=kept,
                               keep_at=min(common_prefix(ids, after), len(after) - MIN_OWN_TOKENS) if after else None)
            done(i, text, n, float(kept.values()[0]))
