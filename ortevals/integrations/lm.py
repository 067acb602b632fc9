"""The lm-eval model ``ortevals``: a ``TemplateLM`` adapter over one run (:class:`ortevals.run.run.Run`).

Owns the lm-eval contract and nothing numeric: tokenization with the ``hf`` backend's BOS
rules (lm-eval's ``_encode_pair``), turning ``loglikelihood`` / ``loglikelihood_rolling``
requests into token requests (rolling windows, the context limit checked before anything
runs), ``cache_hook`` calls so ``--use_cache`` works, chat templates as the ``hf`` backend
applies them, lm-eval's multimodal requests handed to the media router (lm_media.py), and
``--self-eval``'s P(True) requests added to the same ``loglikelihood`` call (self_eval.py).
The run owns the package, engines, result store, canary verdicts, stats and modes; with
``workers`` it is handed a Ray pool here (integrations/ray.py). Registration with lm-eval's
registry lives in :mod:`ortevals.integrations.lm_eval_plugin`; this module only defines the class.

``OrtLM(run)`` does no I/O: build it with :meth:`OrtLM.from_package`, which is also what
lm-eval's ``create_from_arg_string`` / ``create_from_arg_obj`` call.

Other modules use an ``OrtLM`` only through :data:`OrtLM.INTERFACE` (tests/test_interfaces.py holds
integrations/ and report/ to it): lm-eval's model API, its model arguments, package and tokenizer, and
two views that hand over data instead of the run: :meth:`OrtLM.sample_facts` (the ``--samples``
report's input, report/samples.py) and :meth:`OrtLM.ptrue_model` (a P(True) verifier's, verify.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType

from lm_eval.api.model import TemplateLM

from ortevals.engine.score.prefill import Score, TokenRequest
from ortevals.engine.score.scoring import NonFiniteScore, describe_request, fits
from ortevals.errors import OrtEvalsError
from ortevals.files import store_path
from ortevals.integrations import self_eval
from ortevals.integrations.lm_media import MediaRouter
from ortevals.integrations.ray import WorkerPool
from ortevals.options import ModelArgs, parse_model_args
from ortevals.report.samples import SampleFacts
from ortevals.run.generate import gen_settings
from ortevals.run.run import NO_STORE, Run, run_settings

log = logging.getLogger(__name__)
__all__ = ["ModelArgs", "OrtLM"]
FIRST_PART = 768  # requests of a large run scored first, while the rest is tokenized (then parts 4x larger)
ENCODE_AHEAD = 384  # requests whose texts (two at most each) are encoded in one batch: two batches within
# Run's ENCODED_KEPT (one kept while the next is encoded)


def lm_eval_settings(arg_dict: dict, additional_config: dict | None) -> dict:
    """lm-eval's own settings for the model (``additional_config``: ``batch_size``, ``max_batch_size``,
    ``device``), where ``model_args`` do not set them. lm-eval's ``--batch_size`` default, 1, runs as the
    ortevals CLI's default (auto): the same scope, so the two routes share stored answers (one row per pass
    stays one ``model_args`` entry away: ``batch_size=1``)."""
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
    if str(extra.get("batch_size")) == "1":
        log.info("lm-eval's batch_size 1 (its --batch_size default) runs as batch_size=auto, the ortevals CLI's "
                 "default; give model_args batch_size=1 for one row per pass")
        extra.pop("batch_size")
    return extra


def lm_eval_model_args(arg_dict: dict, additional_config: dict | None) -> ModelArgs:
    """lm-eval's ``model_args`` (and its own settings) as ortevals' checked arguments; the store, by default the
    package's result store in the ortevals cache (``store=none``: none)."""
    merged = {**lm_eval_settings(arg_dict, additional_config), **arg_dict}  # model_args win
    off = "store" in merged and (merged["store"] in (None, False) or str(merged["store"]).lower() in NO_STORE)
    args = parse_model_args({k: v for k, v in merged.items() if not (off and k == "store")})
    if args.store is None and not off:
        args = dataclasses.replace(args, store=str(store_path(args.pkg)))
    return args


class OrtLM(TemplateLM):
    """lm-eval model backed by ONNX Runtime; see the module docstring."""

    backend = "causal"
    # issue 13: lm-eval's multimodal tasks; requests carrying media go to the media engine (lm_media.py),
    # all others to the text path unchanged (it never opens a vision or speech model)
    MULTIMODAL = True
    # what other modules may read of an OrtLM: lm-eval's model API, the model arguments, package and
    # tokenizer (read only), and the views below; nothing of the run, its engines or its store
    INTERFACE = frozenset({
        "loglikelihood", "loglikelihood_rolling", "generate_until", "tok_encode", "tok_decode",
        "apply_chat_template", "chat_template", "tokenizer_name", "eot_token_id", "prefix_token_id",
        "max_length", "max_gen_toks", "get_model_info", "from_package", "create_from_arg_string",
        "create_from_arg_obj", "args", "package", "tokenizer", "sample_facts", "ptrue_model",
    })

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run
        self.media = MediaRouter(run)  # issue 13: opens nothing until a request carries media
        self.self_eval_scores: dict = {}  # issue 24 --self-eval: (task, doc_id) → choice → (log p " (A)", " (B)")
        # called with each generate_until call's (prompt, max_gen_toks) before any answer is generated
        # (--verifier: its inputs must fit, integrations/verify.py check_room)
        self.before_generation: list[Callable[[list[tuple[str, int]]], None]] = []

    @classmethod
    def from_package(cls, args: ModelArgs, open_soon: bool = False) -> OrtLM:
        """Open the run (:meth:`Run.open`; ``open_soon``: its sessions on a thread, their errors at the first
        request); with workers, the Ray pool that serves it (the cluster starts on first use)."""
        pooled = bool(args.workers or args.ray_address)  # issue 15: data parallel on Ray
        # on CPU the workers' thread count comes from the cluster: the run's scope records it (integrations/ray.py)
        run = Run.open(args, open_soon, (lambda: WorkerPool.cpu_threads(args)) if pooled else None)
        if pooled:
            run.pool = WorkerPool(run.args, run.backends.provider.on_device)
        lm = cls(run)
        if args.search != "none":  # issue 25: the verifier's step scores guide generation
            lm._open_search()
        return lm

    def _open_search(self) -> None:
        """--search: the PRM from --verifier (integrations/verify.py); answers stored and resumed under the run's
        scope narrowed by the search's settings and what the verifier reads (run/search.py ``search_scope``)."""
        from ortevals.engine.generate.search.prm import TextPrm
        from ortevals.integrations.verify import open_verifier
        from ortevals.run.search import search_scope, search_settings, timed_scores

        args = self.args
        if args.verifier is None:
            raise OrtEvalsError("--search needs --verifier: its step scores guide the search")
        search_settings(args)  # a bad n / width stops the run now
        if self.run.pool is not None or self.run.generation.path() != "raw":
            raise OrtEvalsError(f"--search {args.search} runs on the raw path in this process; this run generates "
                                "on onnxruntime-genai or on workers (gen_path=raw, no --workers)")
        verifier = open_verifier(args.verifier, self)
        self.run.search_verifier = verifier  # its name, kind and cost go to results["search"] (evaluate.py)
        self.run.step_scorer = TextPrm(timed_scores(self.run, verifier), args.step_separator, self.tokenizer.decode)
        self.run.search_reward = "logit"  # every verifier scores a probability (P(True), runtime/reward.py)
        self.run.narrow_scope(*search_scope(args, self.run.search_reward, verifier))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> OrtLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> OrtLM:
        """lm-eval's (and lmms-eval's) route. It resumes like the CLI: the package's result store in the
        ortevals cache (the same file, the same scope for the same settings: :func:`lm_eval_settings`) unless
        ``store=PATH`` names another or ``store=none`` turns it off."""
        return cls.from_package(lm_eval_model_args(arg_dict, additional_config))

    def use_adapter(self, value: str) -> None:
        """Another LoRA adapter from now on, on the same sessions (:meth:`Run.use_adapter`): the next evaluation is
        that adapter's alone (``ortevals mmlu-pro`` and ``run`` with ``--adapter`` given more than once)."""
        self.run.use_adapter(value)
        self.self_eval_scores = {}
        self.before_generation.clear()  # each evaluation adds its verifier's check again

    def get_model_info(self) -> dict:
        """What lm-eval writes into ``results["config"]``: the package, its precision, provider and every model
        argument (report/model_info.py), in place of ``"model": "OrtLM", "model_args": null``."""
        return self.run.model_info()

    # --- the run's parts, as callers of an lm-eval model read them --------------------------------
    package = property(lambda self: self.run.package)
    tokenizer = property(lambda self: self.run.tokenizer)
    args = property(lambda self: self.run.args)
    backends = property(lambda self: self.run.backends)
    store = property(lambda self: self.run.store)
    stats = property(lambda self: self.run.stats)
    pool = property(lambda self: self.run.pool)
    sample_logprobs = property(lambda self: self.run.sample_logprobs)
    sample_certainty = property(lambda self: self.run.sample_certainty)

    @property
    def engine(self):
        """The engine serving log-likelihood requests."""
        return self.run.engine

    # --- views for other modules: the data they need, not the run ---------------------------------
    def sample_facts(self) -> SampleFacts:
        """What the ``--samples`` report reads of this run (report/samples.py): each sample's log-prob and
        self-certainty kept in this process, the result store for resumed ones, a text's token count, the
        package's weights."""
        run = self.run
        return SampleFacts(MappingProxyType(run.sample_logprobs), MappingProxyType(run.sample_certainty), run.store,
                           lambda text: len(self.tok_encode(text)), run.package.parameters)

    def ptrue_model(self):
        """What a P(True) verifier uses of this run (integrations/verify.py ``PTrueModel``)."""
        from ortevals.integrations.verify import PTrueModel

        run = self.run

        def every_prefix(requests):  # every shared prefix that saves a token gets its pass
            with run.prefix_saving(1):
                return self.loglikelihood(requests, disable_tqdm=True)

        def tokens_run() -> int:
            return int(run.engine.tokens_run - getattr(run.engine, "canary_tokens", 0))

        return PTrueModel(every_prefix, tokens_run, run.package.parameters, run.reads,
                          lambda: run_settings(run.args, run.backends), lambda: run.context_limit,
                          lambda text, special: len(run.tok_encode(text, special)))

    # --- lm-eval properties -------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.run.eot_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.run.prefix_token_id

    @property
    def max_length(self) -> int:
        return self.run.max_length

    @property
    def max_gen_toks(self) -> int:
        return self.run.max_gen_toks

    @property
    def context_limit(self):
        return self.run.context_limit

    @property
    def tokenizer_name(self) -> str:
        return str(self.package.root).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.run.tok_encode(string, add_special_tokens)

    def tok_decode(self, tokens, skip_special_tokens: bool = False) -> str:
        return self.run.tok_decode(tokens, skip_special_tokens)

    # --- scoring --------------------------------------------------------------
    def _stored(self, kind: str, requests, compute, decode=lambda v: v) -> list:
        """Answers from the run's store where it has them; ``compute(todo, keys)`` runs (and stores) the rest."""
        try:
            return self.run.stored(kind, requests, compute, decode, self.media.key_args)
        finally:
            self.media.done()

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        text = lambda rs: self._text_loglikelihood(rs, disable_tqdm)  # noqa: E731
        # issue 24 --self-eval: P(True) of every choice in this same call, so the prefix plan shares the prompt
        extra = self_eval.choice_requests(requests) if self.args.self_eval else []
        scores = self._stored("loglikelihood", [*requests, *extra],
                              lambda rs, keys: self.media.loglikelihood(rs, keys, text, disable_tqdm),  # issue 13
                              lambda v: (float(v[0]), bool(v[1])))
        self.self_eval_scores.update(self_eval.collect(extra, scores[len(requests):]))
        return scores[:len(requests)]

    def _text_loglikelihood(self, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """lm-eval's ``TemplateLM.loglikelihood`` on text requests: tokenized by :meth:`_pairs`, then scored, each
        request counted under its question (task, document) on the progress bar."""
        args, units = [r.args for r in requests], [(r.task_name, r.doc_id) for r in requests]
        bounds = waves(len(args))
        if len(bounds) == 1:
            return self._loglikelihood_tokens(self._pairs(args, disable_tqdm), disable_tqdm, units=units)
        out = []
        with ThreadPoolExecutor(1, thread_name_prefix="ortevals-tokenize-ahead") as ahead:
            # each part tokenized while the one before it scores (the tokenizer releases the GIL, and so does
            # onnxruntime); one progress bar over all (Run.score's later)
            coming = ahead.submit(self._pairs, args[:bounds[0]])
            for k, stop in enumerate(bounds):
                pairs = coming.result()
                if k + 1 < len(bounds):
                    coming = ahead.submit(self._pairs, args[stop:bounds[k + 1]])
                out += self._loglikelihood_tokens(pairs, disable_tqdm, units=units if k == 0 else None,
                                                  later=len(args) - stop)
        return out

    def _pairs(self, args: list[tuple[str, str]], disable_tqdm: bool = True) -> list:
        """What ``TemplateLM.loglikelihood`` hands ``_loglikelihood_tokens``: ``((context, continuation), context
        ids, continuation ids)``, each pair split by lm-eval's own ``_encode_pair`` (an empty context: the prefix
        token, as lm-eval does). The texts it will encode are encoded ahead in batches (:meth:`Run.encode_ahead`),
        and requests with the same context hold one tuple of its ids (ten per MMLU-Pro question otherwise)."""
        from tqdm import tqdm

        held: dict[str, tuple[int, ...]] = {}  # context text → its ids (lm-eval's context ids depend on it alone)
        out = []
        chunks = [args[start:start + ENCODE_AHEAD] for start in range(0, len(args), ENCODE_AHEAD)]
        keys = [[key for context, continuation in chunk for key in _texts(context, continuation)] for chunk in chunks]
        with ThreadPoolExecutor(1, thread_name_prefix="ortevals-encode-ahead") as ahead:
            # the next chunk is encoded (on every core, the GIL released) while this one is split
            coming = ahead.submit(self.run.encode_texts, keys[0]) if chunks else None
            for i, chunk in enumerate(tqdm(chunks, desc="Tokenizing inputs", unit="chunk",
                                           disable=disable_tqdm or len(chunks) <= 1)):
                self.run.keep_encoded(coming.result())
                if i + 1 < len(chunks):
                    coming = ahead.submit(self.run.encode_texts, keys[i + 1])
                self._split(chunk, held, out)
        return out

    def _split(self, chunk: list[tuple[str, str]], held: dict, out: list) -> None:
        """Each pair of ``chunk`` split as lm-eval splits it, onto ``out`` (its texts encoded ahead)."""
        for context, continuation in chunk:
            if context == "":
                cont = self.tok_encode(continuation, add_special_tokens=False)
                ctx, cont = ([self.prefix_token_id], cont) if self.prefix_token_id != cont[0] else (cont[:1], cont[1:])
                ids = tuple(ctx)
            else:
                ctx, cont = self._encode_pair(context, continuation)
                ids = held.setdefault(context, tuple(ctx))
            out.append(((context, continuation), ids, cont))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, units: list | None = None, later: int = 0,
                              **kwargs) -> list[tuple[float, bool]]:
        self.run.ready()  # tokenized while the sessions opened (Run.stored): their error before these checks
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
                self.run.put("loglikelihood", list(keys[index]), [score.logprob, score.greedy])

        try:
            scores = self.run.score(token_reqs, record, disable_tqdm, units, later)
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
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm, units=owners)
        totals = [0.0] * len(requests)
        for owner, (lp, _) in zip(owners, scores):
            totals[owner] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            self.run.put("loglikelihood_rolling", list(req.args), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled generation (ortevals/run/generate.py); requests with media go to the media engine."""
        if self.before_generation:
            prompts = list(dict.fromkeys((r.args[0], gen_settings(self.run, r.args[1]).max_gen_toks)
                                         for r in requests))
            for check in self.before_generation:
                check(prompts)
        # the key holds the occurrence of a repeated prompt: repeats sample differently, resumed or not
        return self._stored("generate_until", requests, lambda rs, keys: self.media.generate(  # issue 13: media split
            rs, keys, lambda r, k: self._generate(r, k, disable_tqdm), disable_tqdm))

    def _generate(self, requests, keys: list[list], disable_tqdm: bool) -> list[str]:
        hook = lambda i, text: self.cache_hook.add_partial("generate_until", requests[i].args, text)  # noqa: E731
        return self.run.generate(requests, keys, hook, disable_tqdm)

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


def waves(n: int) -> list[int]:
    """Where the parts of a run of ``n`` requests end: :data:`FIRST_PART`, then each four times the one before
    (the header of a shared prefix runs once a part), the last taking the rest; one part for a small run."""
    bounds, size = [], FIRST_PART
    while n - (bounds[-1] if bounds else 0) > 2 * size:
        bounds.append((bounds[-1] if bounds else 0) + size)
        size *= 4
    return bounds + [n]


def _texts(context: str, continuation: str) -> tuple[tuple[str, bool | None], ...]:
    """The ``(text, add_special_tokens)`` lm-eval's tokenizing asks ``tok_encode`` for on one request (a guess
    that only saves time: a text not guessed is encoded when asked for)."""
    if context == "":
        return ((continuation, False),)
    return (context + continuation, None), (context.rstrip(), None)
