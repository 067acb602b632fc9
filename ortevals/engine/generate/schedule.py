"""Generation scheduling: which ``generate_until`` requests run where, and in what order.

Owns turning lm-eval's ``generate_until`` requests into generation work:
each request's prompt ids and decoding settings (gen_kwargs, the context
limit), the split between batched greedy Generators (``gen_batch_size``) and
the one rewinding cursor (prompts sorted so those sharing a few-shot header
are adjacent), the per-request sampling seed, and reporting each finished
text (store, lm-eval's cache hook, progress bar). Token choice and stop
sequences live in :mod:`ortevals.engine.generate.generation`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ortevals.engine.generate.generation import can_batch, generate, generate_batch
from ortevals.engine.generate.seeds import sample_rng
from ortevals.engine.generate.settings import parse_gen_kwargs
from ortevals.engine.score.scoring import describe_request, fits
from ortevals.errors import OrtEvalsError

log = logging.getLogger(__name__)


def prompt_item(lm, args) -> tuple[list[int], object]:
    """(prompt ids, GenSettings) of one request; a prompt that leaves no room for max_gen_toks is an
    error naming the limit, or (truncate=left) left-truncated as lm-eval's hf backend does."""
    context, gen_kwargs = args
    settings = parse_gen_kwargs(gen_kwargs, lm.max_gen_toks, lm.tok_decode([lm.eot_token_id]), lm.args.seed)
    room = lm.max_length - settings.max_gen_toks
    if room <= 0:
        raise OrtEvalsError(f"max_gen_toks={settings.max_gen_toks} leaves no room for a prompt within "
                            f"max_length={lm.max_length}")
    ids = lm.tok_encode(context)
    what = (f"generate_until request {describe_request(context)} (a prompt of {len(ids)} tokens + "
            f"max_gen_toks={settings.max_gen_toks})")
    if not fits(len(ids) + settings.max_gen_toks, lm.context_limit, what):  # truncate=left: as hf does
        lm.stats["truncated"] += 1
        log.warning("prompt of %d tokens left-truncated to %d", len(ids), room)
        ids = ids[-room:]
    return ids, settings


def run_generation(runner, tokenizer, items: Sequence[tuple[list[int], object]], keys: Sequence[list],
                   eos: set[int], width: int, pad_id: int | None, finish: Callable[[int, str, int], None],
                   name: Callable[[int], str] = lambda i: f"request #{i}", prefix_reuse: bool = True) -> None:
    """Generate every item; ``finish(index, text, tokens)`` fires as each one ends.

    width: greedy requests per batched Generator (1: all go through the rewinding cursor).
    name: how an error names request i. prefix_reuse: False gives each request its own Generator
    (exact mode, or the generation canary's verdict: engine/generate/gencanary.py).
    """
    batched = [i for i in range(len(items)) if width > 1 and can_batch(*items[i], pad_id)]
    singles = sorted(set(range(len(items))) - set(batched), key=lambda i: items[i][0])
    log.info("generate_until: %d requests on the incremental path (%d in batches of up to %d)",
             len(items), len(batched), width)
    batched.sort(key=lambda i: len(items[i][0]))  # similar lengths: little padding
    for chunk in (batched[j:j + width] for j in range(0, len(batched), width)):
        outs = generate_batch(runner, tokenizer, [items[i][0] for i in chunk], [items[i][1] for i in chunk], eos,
                              names=[name(i) for i in chunk])
        for i, (text, n) in zip(chunk, outs, strict=True):
            finish(i, text, n)
    if singles:
        cursor = runner.cursor(max(len(items[i][0]) + items[i][1].max_gen_toks for i in singles))
        # prompts sharing a prefix are adjacent: the cursor rewinds instead of re-running it
        for i in singles:
            ids, settings = items[i]
            rng = sample_rng(settings.seed, keys[i])
            here = cursor if prefix_reuse else runner.cursor(len(ids) + settings.max_gen_toks)
            finish(i, *generate(here, tokenizer, ids, settings, eos, rng, name=name(i)))
