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

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from ortevals.engine import EngineSettings, PrefillEngine, Score, TokenRequest
from ortevals.errors import OrtEvalsError
from ortevals.package import ModelPackage
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
        for key in ("max_length", "threads", "memory_budget_mb", "prefix_budget_mb"):
            if key in args:
                args[key] = _positive_int(args[key], key, allow_zero=key == "threads")
        if isinstance(args.get("provider_options"), str):
            args["provider_options"] = tuple(p for p in args["provider_options"].split(";") if p)
        for key in ("add_bos_token", "prefix_cache", "scoring_graph"):
            if isinstance(args.get(key), str):
                args[key] = args[key].lower() in ("1", "true", "yes", "on")
        return cls(**args)


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

    def __init__(self, package: ModelPackage, tokenizer: Tokenizer, engine: PrefillEngine,
                 args: ModelArgs) -> None:
        super().__init__()
        self.package = package
        self.tokenizer = tokenizer
        self.engine = engine
        self.args = args
        self.stats = {"requests": 0, "seconds": 0.0}

    @classmethod
    def from_package(cls, args: ModelArgs) -> OrtLM:
        """Load the package, open its sessions and build the engine."""
        from ortevals.files import cache_root
        from ortevals.providers import from_package, parse_options
        from ortevals.runtime.sessions import DecoderRunner

        package = ModelPackage.load(args.pkg)
        tokenizer = Tokenizer.load(package, add_bos_token=args.add_bos_token)
        provider = from_package(package.decoder.session_options, args.ep,
                                parse_options(args.provider_options), args.threads)
        runner = DecoderRunner.open(package, provider, cache_root() if args.scoring_graph else None)
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
        return cls(package, tokenizer, PrefillEngine(runner, settings), args)

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
    def tokenizer_name(self) -> str:
        return str(self.package.root).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens)

    def tok_decode(self, tokens, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens)

    # --- scoring --------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        token_reqs = [TokenRequest(tuple(ctx), tuple(cont)) for _, ctx, cont in requests]
        keys = [r[0] for r in requests]

        def record(index: int, score: Score) -> None:
            if keys[index] is not None:  # rolling windows are cached per document instead
                self.cache_hook.add_partial("loglikelihood", keys[index], (score.logprob, score.greedy))

        scores = self._run(token_reqs, record, disable_tqdm)
        return [(s.logprob, s.greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
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
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise OrtEvalsError(
            "generate_until needs the incremental (onnxruntime-genai) path, which this version of ortevals "
            "does not have yet; use a log-likelihood task such as leaderboard_mmlu_pro"
        )

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
