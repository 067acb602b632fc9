"""The lm-eval model ``ortevals``: a ``TemplateLM`` over the scoring engines.

Owns the lm-eval contract: tokenization with the ``hf`` backend's BOS rules,
turning ``loglikelihood`` / ``loglikelihood_rolling`` requests into token
requests for the engine, ``cache_hook`` calls so ``--use_cache`` works, and a
progress bar in requests/s. Registration with lm-eval's registry lives in
:mod:`ortevals.lm_eval_plugin`; this module only defines the class.

``OrtLM(...)`` does no I/O: build it with :meth:`OrtLM.from_package`, which is
also what lm-eval's ``create_from_arg_string`` / ``create_from_arg_obj`` call.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from ortevals.backends import Backends
from ortevals.engine import EngineSettings, Score, TokenRequest
from ortevals.errors import OrtEvalsError
from ortevals.package import CONFIG_NAME, ModelPackage
from ortevals.scoring import TRUNCATE_MODES, NonFiniteScore, context_limit, describe_request, fits
from ortevals.store import ResultStore
from ortevals.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DEFAULT_MAX_LENGTH = 2048
CPU_TOKEN_BUDGET = 1024  # auto batch on CPU: more tokens per pass only add memory traffic


@dataclass(frozen=True)
class ModelArgs:
    """lm-eval ``model_args`` for ortevals (``pkg=...,ep=cpu,batch_size=auto``)."""

    pkg: str
    ep: str | None = None
    batch_size: int | None = None  # None: auto
    max_length: int | None = None
    threads: int | None = None
    provider_options: tuple[str, ...] = ()
    add_bos_token: bool | None = None
    memory_budget_mb: int = 2048
    prefix_cache: bool = True
    prefix_budget_mb: int = 1024
    scoring_graph: bool = True  # derived decoder: LM head only at scored positions
    path: str = "auto"  # loglikelihood path: auto | prefill | incremental
    store: str | None = None  # SQLite result store: finished requests are reused on a rerun
    max_gen_toks: int = 256
    gen_batch_size: int = 1  # greedy requests per batched Generator (1: one cursor that rewinds)
    seed: int = 1234
    truncate: str = "error"  # a request longer than the context: error | left (hf's left truncation)

    @classmethod
    def parse(cls, args: dict[str, Any]) -> ModelArgs:
        args = {k: v for k, v in args.items() if v is not None}
        args.pop("device", None)  # lm-eval passes its torch device; the EP is chosen by `ep`
        args.pop("max_batch_size", None)
        for alias in ("pretrained", "path", "model"):
            if alias in args and "pkg" not in args:
                args["pkg"] = args.pop(alias)
        if "pkg" not in args:
            raise OrtEvalsError("model_args needs pkg=PATH (the GenAI package folder)")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(args) - known)
        if unknown:
            raise OrtEvalsError(f"unknown ortevals model_args {unknown}; expected some of {sorted(known)}")
        args["batch_size"] = parse_batch_size(args.get("batch_size"))
        for key in ("max_length", "threads", "memory_budget_mb", "prefix_budget_mb", "max_gen_toks",
                    "gen_batch_size"):
            if key in args:
                args[key] = _positive_int(args[key], key, allow_zero=key == "threads")
        if "seed" in args:
            args["seed"] = _positive_int(args["seed"], "seed", allow_zero=True)
        if isinstance(args.get("provider_options"), str):
            args["provider_options"] = tuple(p for p in args["provider_options"].split(";") if p)
        if args.get("truncate", "error") not in TRUNCATE_MODES:  # issue 10 §6
            raise OrtEvalsError(f"truncate must be one of {', '.join(TRUNCATE_MODES)}, got {args['truncate']!r}")
        for key in ("add_bos_token", "prefix_cache", "scoring_graph"):
            if isinstance(args.get(key), str):
                args[key] = args[key].lower() in ("1", "true", "yes", "on")
        return cls(**args)


def request_keys(kind: str, requests) -> list[list]:
    """Store keys: the request's args; for generation also which repeat of the same prompt it is."""
    if kind != "generate_until":
        return [list(r.args) for r in requests]
    seen: dict[str, int] = {}
    keys = []
    for r in requests:
        ident = json.dumps(r.args, sort_keys=True, default=str)
        keys.append([*r.args, seen.get(ident, 0)])
        seen[ident] = seen.get(ident, 0) + 1
    return keys


def stable_ints(key: list) -> list[int]:
    """Seed material from a key, the same in every process (unlike hash())."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]


def parse_batch_size(value: Any) -> int | None:
    """``auto`` (or None) -> None, else a positive int; ``auto:4`` style is accepted as auto."""
    if value is None or (isinstance(value, str) and value.lower().startswith("auto")):
        return None
    return _positive_int(value, "batch_size")


def _positive_int(value: Any, name: str, allow_zero: bool = False) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise OrtEvalsError(f"{name} must be an integer, got {value!r}") from None
    if n < 0 or (n == 0 and not allow_zero):
        raise OrtEvalsError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {n}")
    return n


class OrtLM(TemplateLM):
    """lm-eval model backed by ONNX Runtime; see the module docstring."""

    backend = "causal"

    def __init__(self, package: ModelPackage, tokenizer: Tokenizer, backends: Backends, args: ModelArgs,
                 store: ResultStore | None = None) -> None:
        super().__init__()
        self.package = package
        self.tokenizer = tokenizer
        self.backends = backends
        self.args = args
        self.store = store
        self.stats = {"requests": 0, "seconds": 0.0, "generated_tokens": 0, "truncated": 0, "reused": 0}

    @classmethod
    def from_package(cls, args: ModelArgs) -> OrtLM:
        """Load the package and tokenizer; open the log-likelihood path now, generation on first use."""
        from ortevals.files import cache_root
        from ortevals.providers import from_package, parse_options

        package = ModelPackage.load(args.pkg)
        tokenizer = Tokenizer.load(package, add_bos_token=args.add_bos_token)
        provider = from_package(package.decoder.session_options, args.ep,
                                parse_options(args.provider_options), args.threads)
        settings = EngineSettings(
            max_length=args.max_length or package.context_length or DEFAULT_MAX_LENGTH,
            vocab_size=package.vocab_size,
            batch_size=args.batch_size,
            pad_token_id=package.pad_token_id or 0,
            memory_budget_mb=args.memory_budget_mb,
            token_budget=0 if provider.on_device else CPU_TOKEN_BUDGET,
            prefix_cache=args.prefix_cache and not package.windowed,
            prefix_budget_mb=args.prefix_budget_mb,
            kv_bytes_per_token=sum(2 * s.kv_heads * s.head_size * np.dtype(s.dtype).itemsize for s in package.kv),
        )
        if args.prefix_cache and package.windowed:
            log.info("prefix cache off: %s keeps a windowed sliding KV cache", package.root)
        backends = Backends(package, provider, settings, args.path, cache_root() if args.scoring_graph else None)
        if backends.loglikelihood_path == "prefill":
            backends.prefill  # noqa: B018  (open now: a bad package fails before any data is loaded)
        log.info("loglikelihood requests go to the %s path%s", backends.loglikelihood_path,
                 f" ({backends.capability.reason})" if backends.capability.reason else "")
        store = None
        if args.store:
            scope = {"package": package.fingerprint(), "ep": provider.name, "options": provider.options,
                     "max_length": settings.max_length, "add_bos_token": args.add_bos_token, "seed": args.seed,
                     "max_gen_toks": args.max_gen_toks, "truncate": args.truncate}
            store = ResultStore.open(Path(args.store), scope)
        return cls(package, tokenizer, backends, args, store)

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
        merged = {**arg_dict, **{k: v for k, v in (additional_config or {}).items() if v is not None}}
        return cls.from_package(ModelArgs.parse(merged))

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
        return self.engine.settings.max_length

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
        """Answers from the store where it has them; ``compute`` runs (and stores) the rest."""
        keys = request_keys(kind, requests)
        if self.store is None:
            return compute(requests, keys)
        found = [self.store.get(kind, k) for k in keys]
        todo = [r for r, v in zip(requests, found) if v is None]
        todo_keys = [k for k, v in zip(keys, found) if v is None]
        reused = len(requests) - len(todo)
        self.stats["reused"] += reused
        if reused:
            log.warning("resuming: %d of %d %s requests reused from %s", reused, len(requests), kind,
                        self.store.path)
        try:
            fresh = iter(compute(todo, todo_keys) if todo else [])
        finally:  # Ctrl-C or a crash: keep every answer finished so far
            self.store.commit()
        return [decode(v) if v is not None else next(fresh) for v in found]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._stored("loglikelihood", requests, lambda rs, _: super(OrtLM, self).loglikelihood(rs, disable_tqdm),
                            lambda v: (float(v[0]), bool(v[1])))

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
        return self._stored("generate_until", requests, lambda rs, keys: self._generate(rs, keys, disable_tqdm))

    def _generate(self, requests, keys: list[list], disable_tqdm: bool) -> list[str]:
        from ortevals.generation import can_batch, generate, generate_batch

        items = [self._gen_item(req.args) for req in requests]
        if not items:
            return []
        runner = self.backends.genai
        eos = {self.eot_token_id, *self.package.eos_token_ids}
        results: list[str] = [""] * len(items)
        bar = tqdm(total=len(items), desc="ortevals generate", unit="req", disable=disable_tqdm, dynamic_ncols=True)
        start = time.perf_counter()

        def finish(i: int, text: str, n: int) -> None:
            results[i] = text
            self.stats["generated_tokens"] += n
            self.cache_hook.add_partial("generate_until", requests[i].args, text)
            if self.store is not None:
                self.store.put("generate_until", keys[i], text)
            bar.update(1)

        width = self.args.gen_batch_size if runner.rewind_ok else 1  # batches only where og is exact
        pad = self.package.pad_token_id
        batched = [i for i in range(len(items)) if width > 1 and can_batch(*items[i], pad)]
        singles = sorted(set(range(len(items))) - set(batched), key=lambda i: items[i][0])
        log.info("generate_until: %d requests on the incremental path (%d in batches of up to %d)",
                 len(items), len(batched), width)
        batched.sort(key=lambda i: len(items[i][0]))  # similar lengths: little padding
        for chunk in (batched[j:j + width] for j in range(0, len(batched), width)):
            outs = generate_batch(runner, self.tokenizer, [items[i][0] for i in chunk],
                                  [items[i][1] for i in chunk], eos)
            for i, (text, n) in zip(chunk, outs, strict=True):
                finish(i, text, n)
        if singles:
            cursor = runner.cursor(max(len(items[i][0]) + items[i][1].max_gen_toks for i in singles))
            # prompts sharing a prefix are adjacent: the cursor rewinds instead of re-running it
            for i in singles:
                ids, settings = items[i]
                rng = np.random.default_rng([settings.seed, *stable_ints(keys[i])])
                finish(i, *generate(cursor, self.tokenizer, ids, settings, eos, rng))
        bar.close()
        self.stats["requests"] += len(items)
        self.stats["seconds"] += time.perf_counter() - start
        return results

    def _gen_item(self, args) -> tuple[list[int], object]:
        from ortevals.generation import parse_gen_kwargs

        context, gen_kwargs = args
        settings = parse_gen_kwargs(gen_kwargs, self.max_gen_toks, self.tok_decode([self.eot_token_id]),
                                    self.args.seed)
        room = self.max_length - settings.max_gen_toks
        if room <= 0:
            raise OrtEvalsError(f"max_gen_toks={settings.max_gen_toks} leaves no room for a prompt within "
                                f"max_length={self.max_length}")
        ids = self.tok_encode(context)
        what = f"generate_until request {describe_request(context)} (a prompt of {len(ids)} tokens + " \
               f"max_gen_toks={settings.max_gen_toks})"
        if not fits(len(ids) + settings.max_gen_toks, self.context_limit, what):  # truncate=left: as hf does
            self.stats["truncated"] += 1
            log.warning("prompt of %d tokens left-truncated to %d", len(ids), room)
            ids = ids[-room:]
        return ids, settings

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        return chat_template if isinstance(chat_template, str) and "{" in chat_template \
            else self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the package's chat template (tokenizer_config.json or chat_template.jinja)."""
        return self.tokenizer.render_chat(chat_history, add_generation_prompt)

    def _run(self, token_reqs: list[TokenRequest], on_done, disable_tqdm: bool) -> list[Score]:
        bar = tqdm(total=len(token_reqs), desc="ortevals", unit="req", disable=disable_tqdm,
                   dynamic_ncols=True, smoothing=0.1)

        def done(index: int, score: Score) -> None:
            on_done(index, score)
            bar.update(1)

        start = time.perf_counter()
        try:
            return self.engine.score(token_reqs, done)
        finally:
            bar.close()
            self.stats["requests"] += len(token_reqs)
            self.stats["seconds"] += time.perf_counter() - start
