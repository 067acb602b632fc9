"""A run's ``generate_until``: prompts and settings, the path that generates, its canary, finishing.

Owns turning requests (anything with lm-eval's ``args``: ``(context, gen_kwargs)``) into
generation work for one run: each prompt's ids and decoding settings (:func:`prompt_item`: the
context limit, left truncation as lm-eval's hf backend does), the generation path (raw
onnxruntime, engine/generate/rows/sampler.py, or onnxruntime-genai's Generators), the generation
canary's plan per path (engine/generate/canary.py), made once per run and joined to the run's
mode, the raw path's sampler on the log-likelihood path's runner, a worker pool when the run has
one, and each finished text: the store, each sample's log-prob, the stats and a progress bar.

:func:`decode_plan` resolves, when the run opens, what decides which rows decode together (the decode
budget, and ``cascade=auto``'s choice) from the memory the device holds, not from what is free when a
batch starts: both go into the run's scope, so a stored sample is a function of it. (On the cascade
graph a row's log-probs move by up to ~3e-5 with the number of rows sharing its prompt on
SmolLM2-135M fp32, enough to change a sampled token now and then; the plain path's rows are
bit-equal whatever the batch.)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time

from tqdm import tqdm

from ortevals.engine.generate.canary import og_plan, raw_plan
from ortevals.engine.generate.choice.settings import GenSettings, parse_gen_kwargs
from ortevals.engine.generate.og.loops import request_name
from ortevals.engine.generate.og.schedule import run_generation
from ortevals.engine.generate.rows.cascade_kv import Cascade, CascadeKV, decoder_bytes
from ortevals.engine.generate.rows.sampler import FREE_SHARE, UNKNOWN_BUDGET, SharedPromptSampler, run_sampling
from ortevals.engine.score.scoring import describe_request, fits
from ortevals.errors import OrtEvalsError
from ortevals.files import cache_root
from ortevals.runtime.memory import total_bytes
from ortevals.runtime.providers import default_threads
from ortevals.runtime.sessions import BIND_DEVICES

log = logging.getLogger(__name__)
# where ortevals differs on purpose, the output says so (the summary's mode line, results' config)
CASCADE_MODE = ("sample rows on one shared prompt KV (cascade: attention summed in another order, ~1e-6 in "
                "log-probs; cascade=off decodes as each row alone)")


def decode_plan(args, package, provider):
    """``args`` with ``decode_budget_mb`` (given, else FREE_SHARE of the memory the device holds where the KV
    lives; UNKNOWN_BUDGET where that cannot be read) and ``cascade`` (``auto`` becomes ``off`` where a second
    session of the decoder would take more than half of what that memory holds beside the first) resolved:
    the same on every run on one machine, and recorded in the run's scope."""
    device = BIND_DEVICES.get(provider.name, "cpu") if provider.on_device else "cpu"
    total = total_bytes(device, int(provider.raw_options.get("device_id", 0) or 0))
    budget = args.decode_budget_mb or int((FREE_SHARE * total if total else UNKNOWN_BUDGET) // 2**20)
    cascade = args.cascade
    if cascade == "auto" and total is not None and 3 * decoder_bytes(package) > total:
        log.info("cascade off: a second session of the decoder (%.1f MiB of weights) would take more than half of "
                 "the %.1f MiB the %s holds beside the first; each decode row keeps its own copy of the prompt KV",
                 decoder_bytes(package) / 2**20, total / 2**20, device)
        cascade = "off"
    return dataclasses.replace(args, decode_budget_mb=budget, cascade=cascade)


def gen_settings(run, gen_kwargs: dict) -> GenSettings:
    """GenSettings from lm-eval gen_kwargs, as every path of the run reads them (text and media)."""
    return parse_gen_kwargs(gen_kwargs, run.max_gen_toks, run.tok_decode([run.eot_token_id]), run.args.seed)


def prompt_item(run, args) -> tuple[list[int], GenSettings]:
    """(prompt ids, GenSettings) of one request; a prompt that leaves no room for max_gen_toks is an
    error naming the limit, or (truncate=left) left-truncated as lm-eval's hf backend does."""
    context, gen_kwargs = args
    settings = gen_settings(run, gen_kwargs)
    room = run.max_length - settings.max_gen_toks
    if room <= 0:
        raise OrtEvalsError(f"max_gen_toks={settings.max_gen_toks} leaves no room for a prompt within "
                            f"max_length={run.max_length}")
    ids = run.tok_encode(context)
    what = (f"generate_until request {describe_request(context)} (a prompt of {len(ids)} tokens + "
            f"max_gen_toks={settings.max_gen_toks})")
    if not fits(len(ids) + settings.max_gen_toks, run.context_limit, what):  # truncate=left: as hf does
        run.stats["truncated"] += 1
        log.warning("prompt of %d tokens left-truncated to %d", len(ids), room)
        ids = ids[-room:]
    return ids, settings


class Generation:
    """One run's generation: see the module docstring. ``run``: the :class:`ortevals.run.run.Run`."""

    def __init__(self, run) -> None:
        self.run = run
        self._plans: dict[str, tuple] = {}  # generation canary's plan per path, decided once
        self._sampler = None

    def restart(self) -> None:
        """Another adapter from now on (``Run.use_adapter``): the canary's plans made again, and the sampler (its
        sessions and cascade graph kept) holding no prompt KV made under the previous one."""
        self._plans.clear()
        if self._sampler is not None:
            self._sampler = self._sampler.fresh()

    def generate(self, requests, keys: list[list], on_text, disable_tqdm: bool) -> list[str]:
        """Texts in request order; ``on_text(index, text)`` as each finishes (lm-eval's cache hook)."""
        run = self.run
        items = [prompt_item(run, req.args) for req in requests]
        if not items:
            return []
        path = self.path()
        run.stats["gen_path"] = path  # the summary says which engine generated (report/results.py)
        runner = run.backends.genai if path == "og" and run.pool is None else None  # workers: the driver opens no og
        results: list[str] = [""] * len(items)
        bar = tqdm(total=len(items), desc="ortevals generate", unit="req", disable=disable_tqdm, dynamic_ncols=True)
        start = time.perf_counter()

        def finish(i: int, text: str, n: int, logprob: float | None = None, scored: int = 0,
                   certainty: float | None = None) -> None:
            """``logprob``: the whole sequence's (EOS included), over ``scored`` tokens (n + the EOS);
            ``certainty``: its self-certainty (raw and og paths, Ray workers: best-of-N by self-certainty reads it)."""
            results[i] = text
            run.stats["generated_tokens"] += n
            on_text(i, text)
            run.put("generate_until", keys[i], text)
            if logprob is not None:  # best-of-k (report/samples.py) reads it back, resumed or not
                run.put("generate_until/logprob", keys[i], [logprob, n, scored])
                run.sample_logprobs[json.dumps(keys[i], default=str)] = (logprob, n, scored)
            if certainty is not None and certainty == certainty:  # NaN: a row that chose no token
                run.put("generate_until/certainty", keys[i], certainty)
                run.sample_certainty[json.dumps(keys[i], default=str)] = certainty
            bar.update(1)

        def name(i: int) -> str:  # a request in errors (non-finite logits)
            return request_name(i, requests[i])

        try:
            if run.args.search != "none":  # issue 25: step-level search on the raw engine (run/search.py)
                return self._search(items, keys, finish, path) or results
            if run.pool is not None:  # issue 15: workers on Ray; identical prompts stay on one worker
                return run.pool.generate([r.args for r in requests], keys, [it[0] for it in items],
                                         lambda i, text, lp, n, scored, c: finish(i, text, n, lp, scored, c),
                                         run.commit)
            if path == "raw":  # issue 14: one prompt pass, K rows decoded together (engine/generate/rows/sampler.py)
                self._raw(items, keys, lambda i, s: finish(i, s.text, s.tokens, s.logprob, s.scored, s.certainty),
                          name)
            else:
                self._og(runner, items, keys, finish, name)
        finally:
            bar.close()
            run.stats["requests"] += len(items)
            run.stats["seconds"] += time.perf_counter() - start
        return results

    def _raw(self, items, keys: list[list], finish, name) -> None:
        """The raw path, after the generation canary (engine/generate/canary.py) where it applies."""
        run = self.run
        sampler = self.sampler()
        self._check("raw", lambda: raw_plan(sampler, items, keys, name, run.backends.prefill_choice[0].dtype,
                                            run.args.check, run.backends.verdicts))
        run_sampling(sampler, items, keys, finish, name=name)
        kv = sampler.kv_rows
        if isinstance(kv, CascadeKV) and kv.runner is not None:  # the cascade graph served decode rows: say so
            run.set_mode("cascade", CASCADE_MODE)

    def _search(self, items, keys: list[list], finish, path: str) -> None:
        from ortevals.run.search import run_search, search_mode

        run = self.run
        if path != "raw" or run.pool is not None:  # OrtLM checks it at open; a Run driven otherwise too
            raise OrtEvalsError(f"--search {run.args.search} runs on the raw path in this process; this run "
                                "generates on onnxruntime-genai or on workers (gen_path=raw, no --workers)")
        run.set_mode("generate_until", search_mode(run.args))  # the mode line says a search ran, and which
        run_search(self.run, self.sampler().runner, items, keys, lambda i, text, n: finish(i, text, n))

    def _og(self, runner, items, keys: list[list], finish, name) -> None:
        """og's path: batched greedy Generators and the rewinding cursor, as exact mode and the canary allow."""
        run = self.run
        eos = {run.eot_token_id, *run.package.eos_token_ids}
        width, reuse = self._check("og", lambda: og_plan(
            runner, run.tokenizer, items, keys, eos, run.package.pad_token_id, run.args.gen_batch_size,
            run.backends.exact, run.args.check, run.backends.verdicts, name))
        run_generation(runner, run.tokenizer, items, keys, eos, width, run.package.pad_token_id, finish,
                       name=name, prefix_reuse=reuse, certainty=True, switch=run.backends.settings.reuse.rope_switch)

    def _check(self, path: str, plan):
        """The generation canary's plan (engine/generate/canary.py), made once per run and path; its
        mode joins the run's mode. Returns the og path's (width, prefix reuse)."""
        if path not in self._plans:
            out = plan()
            mode = out if isinstance(out, str) else out[2]
            self._plans[path] = out[:2] if not isinstance(out, str) else ()
            self.run.set_mode("generate_until", mode)
        return self._plans[path]

    def path(self) -> str:
        """raw (engine/generate/rows/sampler.py) or og, from gen_path and what the package allows."""
        path, why = self.run.backends.generation_path()
        if path == "og":
            log.info("generate_until goes to the onnxruntime-genai path%s", f" ({why})" if why else "")
        return path

    def sampler(self) -> SharedPromptSampler:
        """The raw path's sampler, on the log-likelihood path's runner (opened once)."""
        run = self.run
        if self._sampler is None:
            prefill = run.backends.prefill
            runner = prefill.runner
            opener = functools.partial(runner.cascade, run.backends.provider, cache_root())
            # auto's memory rule was applied when the run opened (decode_plan), never against free memory here
            cascade = Cascade(run.args.cascade, opener, decoder_bytes(run.package))
            self._sampler = SharedPromptSampler(
                runner, run.tokenizer, {run.eot_token_id, *run.package.eos_token_ids},
                exact=prefill.settings.exact, prefix_cache=run.args.prefix_cache,
                kv_budget_mb=run.args.decode_budget_mb, cascade=cascade, threads=_choice_threads(run.backends.provider),
                reuse=prefill.settings.reuse)
        if run.backends.exact and not self._sampler.exact:  # the log-likelihood canary tripped since
            self._sampler.exact, self._sampler.prefix_cache = True, False
        return self._sampler


def _choice_threads(provider) -> int:
    """Threads that choose tokens between decode passes: the session's on CPU (the cores the run was given),
    the host's where the passes run on a device (the host idles while they run)."""
    return provider.intra_op_threads if provider.name == "cpu" else default_threads("cpu")
