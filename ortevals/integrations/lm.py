"""The lm-eval model ``ortevals``: a ``TemplateLM`` over the scoring engines.

Owns the lm-eval contract: tokenization with the ``hf`` backend's BOS rules,
turning ``loglikelihood`` / ``loglikelihood_rolling`` requests into token
requests for the engine, ``cache_hook`` calls so ``--use_cache`` works, and a
progress bar in requests/s. Registration with lm-eval's registry lives in
:mod:`ortevals.integrations.lm_eval_plugin`; this module only defines the class.

``OrtLM(...)`` does no I/O: build it with :meth:`OrtLM.from_package`, which is
also what lm-eval's ``create_from_arg_string`` / ``create_from_arg_obj`` call.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from ortevals.engine.backends import Backends
from ortevals.engine.score.prefill import EngineSettings, Score, TokenRequest
from ortevals.engine.score.scoring import NonFiniteScore, context_limit, describe_request, effective_max_length, fits
from ortevals.errors import OrtEvalsError
from ortevals.files import cache_root, store_path
from ortevals.integrations import self_eval
from ortevals.options import ModelArgs, parse_model_args, scoped_settings
from ortevals.package.loader import CONFIG_NAME, ModelPackage
from ortevals.package.multimodal import check_media_tokens
from ortevals.package.scope import Reads
from ortevals.package.tokenizer import Tokenizer, tokenizer_reads
from ortevals.report import resume
from ortevals.report.model_info import model_info
from ortevals.report.scope import results_scope
from ortevals.report.store import ResultStore

log = logging.getLogger(__name__)
DEFAULT_MAX_LENGTH = 2048
__all__ = ["ModelArgs", "OrtLM"]
CPU_TOKEN_BUDGET = 1024  # auto batch on CPU: more tokens per pass only add memory traffic
NO_STORE = ("none", "off", "false", "no")  # store=none: no result store (lm-eval's route has one by default)
# lm-eval's own code splits context/continuation (_encode_pair) and cuts rolling windows
LM_EVAL_READS = Reads("lm-eval requests", dists=("lm-eval",))


class OrtLM(TemplateLM):
    """lm-eval model backed by ONNX Runtime; see the module docstring."""

    backend = "causal"
    # issue 13: lm-eval's multimodal tasks; requests carrying media go to the media engine (lm_media.py),
    # all others to the text path unchanged (it never opens a vision or speech model)
    MULTIMODAL = True

    def __init__(self, package: ModelPackage, tokenizer: Tokenizer, backends: Backends, args: ModelArgs,
                 store: ResultStore | None = None) -> None:
        super().__init__()
        self.package = package
        self.tokenizer = tokenizer
        self.backends = backends
        self.args = args
        self.store = store
        self.pool = None  # issue 15: a Ray WorkerPool when workers/ray_address is set (integrations/ray.py)
        self.stats = {"requests": 0, "seconds": 0.0, "generated_tokens": 0, "truncated": 0, "reused": 0}
        from ortevals.integrations.lm_media import MediaRouter

        self.media = MediaRouter(self)  # issue 13: opens nothing until a request carries media
        self.sample_logprobs: dict[str, tuple[float, int, int]] = {}  # key (JSON) → (log-prob, tokens, scored)
        self._modes: dict[str, str] = {}  # which mode ran and why, per request kind (stats["mode"] joins them)
        self._gen_plans: dict[str, tuple] = {}  # generation canary's plan per path, decided once
        self.self_eval_scores: dict = {}  # issue 24 --self-eval: (task, doc_id) → choice → (log p " (A)", " (B)")

    @classmethod
    def from_package(cls, args: ModelArgs) -> OrtLM:
        """Load the package and tokenizer; open the log-likelihood path now, generation on first use."""
        from ortevals.engine.generate.settings import SEARCH_POLICY
        from ortevals.runtime.buffers import kv_bytes_per_token
        from ortevals.runtime.providers import from_package, parse_options

        package = ModelPackage.load(args.pkg)
        tokenizer = Tokenizer.load(package, add_bos_token=args.add_bos_token)
        check_media_tokens(package, tokenizer.backend)  # issue 22: a media token id that text produces
        provider = from_package(package.decoder.session_options, args.ep,
                                parse_options(args.provider_options), args.threads)
        settings = EngineSettings(
            max_length=effective_max_length(args.max_length, package.context_length, package.root / CONFIG_NAME,
                                            DEFAULT_MAX_LENGTH),
            vocab_size=package.vocab_size,
            batch_size=args.batch_size,
            pad_token_id=package.pad_token_id or 0,
            memory_budget_mb=args.memory_budget_mb,
            token_budget=0 if provider.on_device else CPU_TOKEN_BUDGET,
            prefix_cache=args.prefix_cache and not package.windowed,
            prefix_budget_mb=args.prefix_budget_mb,
            # issue 10 §4: CPU GQA refuses batched continuations (CUDA's shared input check likely too: the
            # engine then goes one row per pass; issue 20 §1, docs/architecture.md)
            prefix_batch=0 if provider.on_device else 1,
            kv_bytes_per_token=kv_bytes_per_token(package),
            exact=args.exact, check=args.check,  # invariance switches (ortevals/invariance.py)
        )
        if args.prefix_cache and package.windowed:
            log.info("prefix cache off: %s keeps a windowed sliding KV cache", package.root)
        backends = Backends(package, provider, settings, args.path, cache_root() if args.scoring_graph else None,
                            args.gen_path, args.media_path)
        workers = bool(args.workers or args.ray_address)  # issue 20: the driver opens no session (workers do)
        if backends.loglikelihood_path == "prefill" and not workers:
            backends.prefill  # noqa: B018  (open now: a bad package fails before any data is loaded)
        log.info("loglikelihood requests go to the %s path%s", backends.loglikelihood_path,
                 f" ({backends.capability.reason})" if backends.capability.reason else "")
        store = None
        if args.store and args.store.lower() not in NO_STORE:
            # the scope: what every path of this run reads (files, the settings each hands its runtime, the
            # libraries that compute; package/scope.py) and every option that can change a number
            run_settings = scoped_settings(args) | {"effective_max_length": settings.max_length,
                                                    "search_policy": SEARCH_POLICY}
            reads = [tokenizer_reads(package), LM_EVAL_READS, *backends.reads()]
            store = ResultStore.open(Path(args.store), results_scope(package.root, reads, run_settings))
            backends.verdicts.store = store  # canary verdicts are kept under the same scope (issue 22 §9)
        lm = cls(package, tokenizer, backends, args, store)
        if workers:  # issue 15: data parallel on Ray; the cluster starts on first use
            from ortevals.integrations.ray import WorkerPool

            lm.pool = WorkerPool(args, provider.on_device)
        return lm

    def _commit(self) -> None:
        """After each chunk a worker returns: its answers are on disk (issue 15)."""
        if self.store is not None:
            self.store.commit()

    @property
    def engine(self):
        """The engine serving log-likelihood requests."""
        return self.backends.scorer()

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> OrtLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> OrtLM:
        """lm-eval's (and lmms-eval's) route. It resumes like the CLI: the package's result store in the
        ortevals cache (the same file, the same scope for the same settings) unless ``store=PATH`` names
        another or ``store=none`` turns it off."""
        merged = {**arg_dict, **{k: v for k, v in (additional_config or {}).items() if v is not None}}
        off = "store" in merged and (merged["store"] in (None, False) or str(merged["store"]).lower() in NO_STORE)
        args = parse_model_args({k: v for k, v in merged.items() if not (off and k == "store")})
        if args.store is None and not off:
            args = dataclasses.replace(args, store=str(store_path(args.pkg)))
        return cls.from_package(args)

    def get_model_info(self) -> dict:
        """What lm-eval writes into ``results["config"]``: the package, its precision, provider and every model
        argument (report/model_info.py), in place of ``"model": "OrtLM", "model_args": null``."""
        return model_info(self.package, self.backends.provider, self.args)

    # --- lm-eval properties -------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.special.eos_id
        if eos is None:
            raise OrtEvalsError(f"{self.package.root}: no eos token in tokenizer_config.json or genai_config.json")
        return eos

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.special.bos_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.backends.settings.max_length  # not self.engine: that would open a session

    @property
    def context_limit(self):
        """The context limit, where it came from (for the error) and the truncate policy."""
        return context_limit(self.max_length, self.args.max_length, self.package.context_length,
                             self.package.root / CONFIG_NAME, self.args.truncate)

    @property
    def tokenizer_name(self) -> str:
        return str(self.package.root).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens)

    def tok_decode(self, tokens, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens)

    # --- scoring --------------------------------------------------------------
    def _stored(self, kind: str, requests, compute, decode=lambda v: v) -> list:
        """Answers from the store where it has them; ``compute(todo, keys)`` runs (and stores) the rest."""
        try:
            return resume.answer(self.store, kind, requests, compute, decode, self.stats, self.media.key_args)
        finally:
            self.media.done()

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        text = lambda rs: super(OrtLM, self).loglikelihood(rs, disable_tqdm)  # noqa: E731
        # issue 24 --self-eval: P(True) of every choice in this same call, so the prefix plan shares the prompt
        extra = self_eval.choice_requests(requests) if self.args.self_eval else []
        scores = self._stored("loglikelihood", [*requests, *extra],
                              lambda rs, keys: self.media.loglikelihood(rs, keys, text, disable_tqdm),  # issue 13
                              lambda v: (float(v[0]), bool(v[1])))
        self.self_eval_scores.update(self_eval.collect(extra, scores[len(requests):]))
        return scores[:len(requests)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        token_reqs = [TokenRequest(tuple(ctx), tuple(cont)) for _, ctx, cont in requests]
        keys = [r[0] for r in requests]
        limit = self.context_limit  # too long: one clear error before anything runs, or counted truncation
        cut = sum(not fits(len(r.context) + len(r.continuation) - 1, limit,
                           f"loglikelihood request {i} {describe_request(*keys[i]) if keys[i] else '(rolling)'}")
                  for i, r in enumerate(token_reqs))
        if cut:
            self.stats["truncated"] += cut
            log.warning("truncate=left: %d of %d loglikelihood inputs left-truncated to %s", cut,
                        len(token_reqs), limit.source)

        def record(index: int, score: Score) -> None:
            if keys[index] is not None:  # rolling windows are cached per document instead
                self.cache_hook.add_partial("loglikelihood", keys[index], (score.logprob, score.greedy))
                if self.store is not None:
                    self.store.put("loglikelihood", list(keys[index]), [score.logprob, score.greedy])

        try:
            scores = self._run(token_reqs, record, disable_tqdm)
        except NonFiniteScore as e:  # name the request by its text, not by an index into this batch
            if e.index is None or keys[e.index] is None:
                raise
            raise NonFiniteScore(str(e).replace(f"request {e.index}", f"loglikelihood request "
                                                f"{describe_request(*keys[e.index])}", 1), e.index) from None
        return [(s.logprob, s.greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        requests = self.media.rolling(requests)  # issue 13: text only
        return self._stored("loglikelihood_rolling", requests, lambda rs, _: self._rolling(rs, disable_tqdm), float)

    def _rolling(self, requests, disable_tqdm: bool) -> list[float]:
        from lm_eval import utils

        windows: list[tuple[None, list[int], list[int]]] = []
        owners: list[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (lp, _) in zip(owners, scores):
            totals[owner] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            if self.store is not None:
                self.store.put("loglikelihood_rolling", list(req.args), total)
        return totals

    @property
    def max_gen_toks(self) -> int:
        return self.args.max_gen_toks

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled generation on the incremental path (see generation.py)."""
        # the key holds the occurrence of a repeated prompt: repeats sample differently, resumed or not
        return self._stored("generate_until", requests, lambda rs, keys: self.media.generate(  # issue 13: media split
            rs, keys, lambda r, k: self._generate(r, k, disable_tqdm), disable_tqdm))

    def _generate(self, requests, keys: list[list], disable_tqdm: bool) -> list[str]:
        from ortevals.engine.generate.generation import request_name
        from ortevals.engine.generate.schedule import prompt_item

        items = [prompt_item(self, req.args) for req in requests]
        if not items:
            return []
        path = self._generation_path()
        self.stats["gen_path"] = path  # the summary says which engine generated (report/results.py)
        runner = self.backends.genai if path == "og" and self.pool is None else None  # workers: the driver opens no og
        results: list[str] = [""] * len(items)
        bar = tqdm(total=len(items), desc="ortevals generate", unit="req", disable=disable_tqdm, dynamic_ncols=True)
        start = time.perf_counter()

        def finish(i: int, text: str, n: int, logprob: float | None = None, scored: int = 0) -> None:
            """``logprob``: the whole sequence's (EOS included), over ``scored`` tokens (n + the EOS)."""
            results[i] = text
            self.stats["generated_tokens"] += n
            self.cache_hook.add_partial("generate_until", requests[i].args, text)
            if self.store is not None:
                self.store.put("generate_until", keys[i], text)
                if logprob is not None:  # best-of-k (report/samples.py) reads it back, resumed or not
                    self.store.put("generate_until/logprob", keys[i], [logprob, n, scored])
            if logprob is not None:
                self.sample_logprobs[json.dumps(keys[i], default=str)] = (logprob, n, scored)
            bar.update(1)

        def name(i: int) -> str:  # a request in errors (non-finite logits)
            return request_name(i, requests[i])

        try:
            if self.pool is not None:  # issue 15: workers on Ray; identical prompts stay on one worker
                return self.pool.generate([r.args for r in requests], keys, [it[0] for it in items],
                                          lambda i, text, lp, n, scored: finish(i, text, n, lp, scored),
                                          self._commit)
            if path == "raw":  # issue 14: one prompt pass, K rows decoded together (engine/generate/sampler.py)
                self._generate_raw(items, keys, lambda i, s: finish(i, s.text, s.tokens, s.logprob, s.scored), name)
            else:
                self._generate_og(runner, items, keys, finish, name)
        finally:
            bar.close()
            self.stats["requests"] += len(items)
            self.stats["seconds"] += time.perf_counter() - start
        return results

    def _generate_raw(self, items, keys: list[list], finish, name) -> None:
        """The raw path, after the generation canary (engine/generate/gencanary.py) where it applies."""
        from ortevals.engine.generate.gencanary import raw_plan
        from ortevals.engine.generate.sampler import run_sampling

        sampler = self._sampler()
        self._gen_check("raw", lambda: raw_plan(sampler, items, keys, name, self._dtype, self.args.check,
                                                self.backends.verdicts))
        run_sampling(sampler, items, keys, finish, name=name)

    def _generate_og(self, runner, items, keys: list[list], finish, name) -> None:
        """og's path: batched greedy Generators and the rewinding cursor, as exact mode and the canary allow."""
        from ortevals.engine.generate.gencanary import og_plan
        from ortevals.engine.generate.schedule import run_generation

        eos = {self.eot_token_id, *self.package.eos_token_ids}
        width, reuse = self._gen_check("og", lambda: og_plan(
            runner, self.tokenizer, items, keys, eos, self.package.pad_token_id, self.args.gen_batch_size,
            self.backends.exact, self.args.check, self.backends.verdicts, name))
        run_generation(runner, self.tokenizer, items, keys, eos, width, self.package.pad_token_id, finish,
                       name=name, prefix_reuse=reuse)  # errors name the request

    def _gen_check(self, path: str, plan):
        """The generation canary's plan (engine/generate/gencanary.py), made once per run and path; its mode joins
        the run's mode. Returns the og path's (width, prefix reuse)."""
        if path not in self._gen_plans:
            out = plan()
            mode = out if isinstance(out, str) else out[2]
            self._gen_plans[path] = out[:2] if not isinstance(out, str) else ()
            self._set_mode("generate_until", mode)
        return self._gen_plans[path]

    def _set_mode(self, kind: str, mode: str) -> None:
        if mode:
            self._modes[kind] = mode
        self.stats["mode"] = "; ".join(self._modes.values())

    @property
    def _dtype(self) -> str:
        return self.backends.prefill_choice[0].dtype

    def _generation_path(self) -> str:
        """raw (engine/generate/sampler.py) or og, from gen_path and what the package allows."""
        path, why = self.backends.generation_path()
        if path == "og":
            log.info("generate_until goes to the onnxruntime-genai path%s", f" ({why})" if why else "")
        return path

    def _sampler(self):
        """The raw path's sampler, on the log-likelihood path's runner (opened once)."""
        if getattr(self, "_raw_sampler", None) is None:
            from ortevals.engine.generate.sampler import SharedPromptSampler

            prefill = self.backends.prefill
            self._raw_sampler = SharedPromptSampler(
                prefill.runner, self.tokenizer, {self.eot_token_id, *self.package.eos_token_ids},
                exact=prefill.settings.exact, prefix_cache=self.args.prefix_cache)
        if self.backends.exact and not self._raw_sampler.exact:  # the log-likelihood canary tripped since
            self._raw_sampler.exact, self._raw_sampler.prefix_cache = True, False
        return self._raw_sampler

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        return chat_template if isinstance(chat_template, str) and "{" in chat_template \
            else self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The package's chat template, as lm-eval's hf backend applies it: ``continue_final_message`` when
        no generation prompt is asked for, and a template that refuses the conversation (a system role
        it does not support) tried again without the system messages, with lm-eval's warning."""
        from ortevals.package.chat import ChatTemplateError

        continue_final = not add_generation_prompt
        try:
            return self.tokenizer.render_chat(chat_history, add_generation_prompt, continue_final)
        except ChatTemplateError as e:
            log.warning("Failed to apply chat template (%s). removing the system role in chat history.", e)
            chat_history = [m for m in chat_history if m.get("role") != "system"]
            return self.tokenizer.render_chat(chat_history, add_generation_prompt, continue_final)

    def _run(self, token_reqs: list[TokenRequest], on_done, disable_tqdm: bool) -> list[Score]:
        bar = tqdm(total=len(token_reqs), desc="ortevals", unit="req", disable=disable_tqdm,
                   dynamic_ncols=True, smoothing=0.1)

        def done(index: int, score: Score) -> None:
            on_done(index, score)
            bar.update(1)

        start = time.perf_counter()
        try:
            if self.pool is not None:  # issue 15: workers on Ray; answers come back (and are stored) here
                return self.pool.score(token_reqs, self.max_length, done, self._commit)
            return self.engine.score(token_reqs, done)
        finally:
            bar.close()
            self.stats["requests"] += len(token_reqs)
            self.stats["seconds"] += time.perf_counter() - start
            self._set_mode("loglikelihood", (self.pool.modes or ["batched"])[0] if self.pool is not None else
                           getattr(self.engine, "mode", "incremental"))  # which mode ran and why
