"""lmms-eval models ``ortevals``: a simple and a chat model over :class:`OrtLM` (the lmms-eval edge).

Owns the lmms-eval 0.7.x contract and nothing numeric: requests come in as lmms-eval
``Instance``s, media are read from the task's documents, and every number comes from
the same :class:`OrtLM` that lm-eval uses (tokenizer and BOS rules, result store,
generation) or, for requests with media, from its multimodal engine.

- **Simple model** (:class:`OrtLMMS`, ``--force_simple``): request args are
  ``(ctx, continuation | doc_to_target, doc_to_visual, doc_id, task, split)`` for
  log-likelihoods, ``(ctx, gen_kwargs, doc_to_visual, doc_id, task, split)`` for
  generation and ``(ctx, gen_kwargs, doc_to_visual, doc_to_text, doc_id, task, split)``
  for multi-round generation. Media are ``doc_to_visual(self.task_dict[task][split][doc_id])``.
- **Chat model** (:class:`OrtLMMSChat`, lmms-eval's default for ``--model ortevals``):
  generation args are ``(ctx, doc_to_messages, gen_kwargs, doc_id, task, split)``; the
  messages are rendered with the package's chat template where it ships one.

Two traps of lmms-eval 0.7.3, handled here:

- its ``multiple_choice`` picks ``argmin`` of what ``loglikelihood`` returns (its own
  models return the loss), so this model returns the **negative** summed log-likelihood
  ``-sum(log p(continuation tokens))`` (``NegLogLikelihood``);
- its evaluator passes every response through ``unwrap_generation_output``, which turns
  a ``(float, bool)`` tuple into the string ``"(-1.2, True)"``; the pair is therefore
  wrapped in a ``GenerationResult``, which it unwraps to the pair itself.

Imports lmms-eval (and so torch): never imported by ``import ortevals``; lmms-eval
finds the classes through :mod:`ortevals.integrations.lmms_plugin`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lm_eval.api.instance import Instance as LmInstance
from lmms_eval.api.instance import GenerationResult
from lmms_eval.api.model import lmms

from ortevals.errors import OrtEvalsError
from ortevals.integrations.lm import OrtLM
from ortevals.options import parse_arg_string

log = logging.getLogger(__name__)
MAX_ROUNDS = 1000  # generate_until_multi_round: a task whose doc_to_text never says "terminal" is an error


class NegLogLikelihood(tuple):
    """``(-log p(continuation | context), is_greedy)``: what lmms-eval's ``argmin`` expects.

    ``strip`` exists because lmms-eval's response cache (``--use_cache``) checks every
    ``GenerationResult`` with ``result.text.strip()`` before storing it.
    """

    __slots__ = ()

    def __new__(cls, nll: float, greedy: bool) -> NegLogLikelihood:
        return super().__new__(cls, (float(nll), bool(greedy)))

    def strip(self) -> NegLogLikelihood:
        return self


def as_lmms_score(logprob: float, greedy: bool) -> GenerationResult:
    """An lm-eval ``(log-likelihood, greedy)`` pair as lmms-eval's evaluator must receive it."""
    return GenerationResult(text=NegLogLikelihood(-logprob, greedy))


class OrtLMMS(lmms):
    """lmms-eval simple model backed by an :class:`OrtLM`; see the module docstring."""

    is_simple = True

    def __init__(self, lm: OrtLM) -> None:
        super().__init__()
        self.lm = lm

    @classmethod
    def create_from_arg_string(cls, arg_string: str | Mapping | None, additional_config: dict | None = None):
        """The same model args as lm-eval's ``ortevals`` (``pretrained=PKG`` or ``pkg=PKG``, options table)."""
        args = dict(arg_string) if isinstance(arg_string, Mapping) else parse_arg_string(arg_string)
        return cls.create_from_arg_obj(args, additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: Mapping, additional_config: dict | None = None):
        return cls(OrtLM.create_from_arg_obj(dict(arg_dict), additional_config))

    # --- documents and media ---------------------------------------------------
    def _doc(self, task: str, split: str, doc_id: int) -> dict:
        try:
            return self.task_dict[task][split][doc_id]
        except (KeyError, IndexError, TypeError):
            raise OrtEvalsError(f"lmms-eval request for task {task!r} split {split!r} doc {doc_id}: no such "
                                "document in the model's task_dict (set by lmms-eval's evaluator)") from None

    def _media(self, doc_to_visual: Callable | None, doc: dict, where: str) -> tuple:
        """The document's visuals/audios as ortevals ``Media`` (empty for a text-only request)."""
        visuals = doc_to_visual(doc) if callable(doc_to_visual) else doc_to_visual
        flat = [v for v in _flatten(visuals) if v is not None]
        if not flat:
            return ()
        from ortevals.package.media import to_media  # converted here so an error names the task and doc

        try:
            return tuple(to_media(v) for v in flat)
        except OrtEvalsError as e:
            raise OrtEvalsError(f"{where}: {e}") from None

    # --- the three request kinds ---------------------------------------------------
    def loglikelihood(self, requests) -> list[GenerationResult]:
        """``GenerationResult(text=(-log-likelihood, is_greedy))`` per request (see the module docstring)."""
        items = []
        for req in requests:
            if len(req.args) == 2:  # ("", choice): the unconditional request lmms-eval adds for acc_mutual_info
                raise OrtEvalsError(f"task {req.task_name!r}: metric acc_mutual_info is not supported: lmms-eval "
                                    "0.7.3 takes argmax of differences of what loglikelihood returns, which is "
                                    "a loss (argmin elsewhere), so it would pick the least likely choice")
            ctx, target, doc_to_visual, doc_id, task, split = req.args
            doc = self._doc(task, split, doc_id)
            cont = target if isinstance(target, str) else target(doc)
            if not isinstance(cont, str):
                raise OrtEvalsError(f"task {task!r} doc {doc_id}: a loglikelihood continuation must be text, got "
                                    f"{type(cont).__name__} from doc_to_target")
            items.append((ctx, cont, self._media(doc_to_visual, doc, f"task {task!r} doc {doc_id}")))
        return [as_lmms_score(lp, greedy) for lp, greedy in self._score(items, requests)]

    def generate_until(self, requests) -> list[GenerationResult]:
        items = []
        for req in requests:
            ctx, gen_kwargs, doc_to_visual, doc_id, task, split = req.args
            doc = self._doc(task, split, doc_id)
            items.append((ctx, dict(gen_kwargs or {}), self._media(doc_to_visual, doc, f"task {task!r} doc {doc_id}")))
        return [GenerationResult(text=t) for t in self._generate(items, requests)]

    def generate_until_multi_round(self, requests) -> list[list[str]]:
        """Rounds in lockstep over all requests; round r > 0 asks the task's ``doc_to_text`` for its input.

        lmms-eval's protocol (as its llava_onevision model calls it): ``doc_to_text(doc,
        previous_output=[outputs so far], round_idx=r, previous_round_info=info)`` returns
        ``(visuals, context, terminal, outputs, info)``; ``terminal`` ends the request and
        ``outputs`` replaces the outputs so far. Each request's answer is its list of outputs.
        """
        state = []
        for req in requests:
            ctx, gen_kwargs, doc_to_visual, doc_to_text, doc_id, task, split = req.args
            doc = self._doc(task, split, doc_id)
            where = f"task {task!r} doc {doc_id}"
            state.append({"doc": doc, "next": doc_to_text, "gen": dict(gen_kwargs or {}), "where": where,
                          "item": (ctx, dict(gen_kwargs or {}), self._media(doc_to_visual, doc, where)),
                          "outputs": [], "info": None})
        return self._rounds(state, requests, self._next_round_simple)

    def _next_round_simple(self, s: dict, round_idx: int):
        payload = s["next"](s["doc"], previous_output=list(s["outputs"]), round_idx=round_idx,
                            previous_round_info=s["info"])
        if not (isinstance(payload, tuple) and len(payload) == 5):
            raise OrtEvalsError(f"{s['where']}: doc_to_text(round_idx={round_idx}) must return (visuals, context, "
                                f"terminal, outputs, info) in generate_until_multi_round, got {type(payload).__name__}")
        visuals, context, terminal, outputs, info = payload
        if terminal:
            return None, outputs, info
        return (context, dict(s["gen"]), self._media(lambda _: visuals, s["doc"], s["where"])), outputs, info

    def _rounds(self, state: list[dict], requests, next_round) -> list[list[str]]:
        """Generate round after round until every request's task says terminal (or ``MAX_ROUNDS``)."""
        active = list(range(len(state)))
        for round_idx in range(MAX_ROUNDS + 1):
            if round_idx:
                still = []
                for i in active:
                    item, outputs, info = next_round(state[i], round_idx)
                    if outputs is not None:
                        state[i]["outputs"] = list(outputs)
                    state[i]["info"] = info
                    if item is not None:
                        state[i]["item"] = item
                        still.append(i)
                active = still
            if not active:
                break
            if round_idx == MAX_ROUNDS:  # never cut the answers short quietly
                raise OrtEvalsError(f"{state[active[0]]['where']}: generate_until_multi_round still not terminal "
                                    f"after {MAX_ROUNDS} rounds; its doc_to_text never returns terminal=True")
            texts = self._generate([state[i]["item"] for i in active], [requests[i] for i in active])
            for i, text in zip(active, texts):
                state[i]["outputs"].append(text)
        return [list(s["outputs"]) for s in state]

    # --- to OrtLM: text requests to its text path, requests with media to its media engine ----------
    def _score(self, items: Sequence[tuple[str, str, tuple]], requests) -> list[tuple[float, bool]]:
        insts = [_lm_instance("loglikelihood", item, req, i) for i, (item, req) in enumerate(zip(items, requests))]
        return self.lm.loglikelihood(insts, disable_tqdm=self.rank != 0)

    def _generate(self, items: Sequence[tuple[str, dict, tuple]], requests) -> list[str]:
        insts = [_lm_instance("generate_until", item, req, i) for i, (item, req) in enumerate(zip(items, requests))]
        return self.lm.generate_until(insts, disable_tqdm=self.rank != 0)


class OrtLMMSChat(OrtLMMS):
    """lmms-eval chat model: the task's ``doc_to_messages``, rendered with the package's chat template.

    lmms-eval builds message tasks for chat models, and those are generation only (its
    ``ConfigurableMessagesTask`` asserts it): log-likelihood tasks need ``--force_simple``.
    A package without a chat template gets the messages' text parts joined by newlines,
    which for lmms-eval's one-turn text tasks is the simple model's context.
    """

    is_simple = False

    def generate_until(self, requests) -> list[GenerationResult]:
        items = []
        for req in requests:
            ctx, doc_to_messages, gen_kwargs, doc_id, task, split = req.args
            doc = self._doc(task, split, doc_id)
            where = f"task {task!r} doc {doc_id}"
            items.append((*self._render(doc_to_messages(doc), where), dict(gen_kwargs or {})))
        return [GenerationResult(text=t) for t in self._generate([(c, g, m) for c, m, g in items], requests)]

    def generate_until_multi_round(self, requests) -> list[list[str]]:
        """As the simple model's, with ``doc_to_messages(doc, round_idx=r, previous_output=…,
        previous_round_info=…)`` returning ``(messages | None, terminal, outputs, info)`` per round."""
        state = []
        for req in requests:
            ctx, doc_to_messages, gen_kwargs, doc_id, task, split = req.args
            doc = self._doc(task, split, doc_id)
            where = f"task {task!r} doc {doc_id}"
            prompt, media = self._render(doc_to_messages(doc), where)
            state.append({"doc": doc, "next": doc_to_messages, "gen": dict(gen_kwargs or {}), "where": where,
                          "item": (prompt, dict(gen_kwargs or {}), media), "outputs": [], "info": None})
        return self._rounds(state, requests, self._next_round_chat)

    def _next_round_chat(self, s: dict, round_idx: int):
        payload = s["next"](s["doc"], round_idx=round_idx, previous_output=list(s["outputs"]),
                            previous_round_info=s["info"])
        if not (isinstance(payload, tuple) and len(payload) == 4):
            raise OrtEvalsError(f"{s['where']}: doc_to_messages(round_idx={round_idx}) must return (messages, "
                                f"terminal, outputs, info), got {type(payload).__name__}")
        messages, terminal, outputs, info = payload
        if terminal or messages is None:
            return None, outputs, info
        prompt, media = self._render(messages, s["where"])
        return (prompt, dict(s["gen"]), media), outputs, info

    def _render(self, messages: list[dict], where: str) -> tuple[str, tuple]:
        """(prompt, media): the chat template over the messages, media in the order they appear.

        A media part's type is what its content is: lmms-eval labels a dict visual "video" unless it
        says otherwise, so an audio ``{"array", "sampling_rate"}`` arrives as "video"; real video is
        refused by ``to_media`` in one line. The template sees ``{"type": "image" | "audio"}``."""
        turns, media = [], []
        for m in messages:
            content = m.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            typed = []
            for part in parts:
                kind = part.get("type")
                if kind in ("image", "audio", "video"):
                    [item] = self._media(lambda _, p=part: [p.get("url")], {}, where) or [None]
                    if item is None:
                        raise OrtEvalsError(f"{where}: a message {kind} part holds no media ('url' is empty)")
                    media.append(item)
                    typed.append({"type": item.kind})
                elif kind == "text":
                    typed.append({"type": "text", "text": part.get("text", "")})
                else:
                    raise OrtEvalsError(f"{where}: unknown message content type {kind!r}")
            turns.append((m.get("role", "user"), typed))
        # a multimodal template places its own markers from the typed parts; text-only messages get
        # plain string content, which every template renders
        plain = [{"role": role, "content": parts if media else _text_of(parts)} for role, parts in turns]
        if self.lm.tokenizer.chat_template:
            return self.lm.tokenizer.render_chat(plain, add_generation_prompt=True), tuple(media)
        log.debug("%s ships no chat template: the messages' text is the prompt", self.lm.package.root)
        return "\n".join(_text_of(m["content"]) for m in plain), tuple(media)


def _text_of(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content if p.get("type") == "text")


def _flatten(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def _lm_instance(kind: str, item: tuple, request, index: int) -> LmInstance:
    """``(context, continuation | gen_kwargs, media)`` as lm-eval's own request: media go in its multimodal
    argument (``{"visual": [...]}``, which OrtLM routes to its media engine), text-only requests carry none.
    The lmms-eval request's task and doc id come along for the store and for errors."""
    context, target, media = item
    args = (context, target, {"visual": list(media)}) if media else (context, target)
    meta = (getattr(request, "task_name", None), getattr(request, "doc_id", None), getattr(request, "repeats", 1))
    return LmInstance(kind, {}, args, index, meta)
