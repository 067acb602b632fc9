"""lm-eval requests that carry images or audio: split them off to the media engine.

lm-eval 0.4.13 hands media to a model whose ``MULTIMODAL`` is true as one more
argument of the instance (``lm_eval/api/task.py`` ``construct_requests``):
``(context, continuation, {"visual": [PIL...], "audio": [...]})`` for
loglikelihood and ``(context, gen_kwargs, {...})`` for generate_until. Its
contexts write lm-eval's ``<image>`` placeholder, which
:func:`ortevals.package.multimodal.place_markers` turns into the model's own.

Owns that split: requests whose extra argument holds media go to
:class:`ortevals.engine.media.og.MediaEngine` (opened and validated on the
first one); everything else goes, with the extra argument dropped, to the text
path unchanged, which therefore never opens a vision or speech model. Also owns
store keys for media requests (the media's content hashes, never a PIL object's
``repr``), used by :mod:`ortevals.report.resume`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from tqdm import tqdm

from ortevals.engine.media.og import MediaRequest, media_digest
from ortevals.errors import OrtEvalsError
from ortevals.package.media import Media, to_media_list
from ortevals.run.generate import gen_settings

log = logging.getLogger(__name__)


def is_aux(arg) -> bool:
    """lm-eval's multimodal argument: a dict with "visual" and/or "audio"."""
    return isinstance(arg, dict) and ("visual" in arg or "audio" in arg)


class MediaRouter:
    """Per run (``run``: :class:`ortevals.run.run.Run`): converts each request's media once, and answers
    the media requests."""

    def __init__(self, run) -> None:
        self.run = run
        self._engine = None
        self._memo: dict[int, tuple[dict, tuple[Media, ...]]] = {}

    @property
    def engine(self):
        if self._engine is None:
            from ortevals.engine.media.paths import open_media

            run = self.run
            self._engine = open_media(run.package, run.tokenizer, run.backends.provider, run.max_length,
                                      {run.eot_token_id}, run.args.media_path)
        # exact mode as the text path has it now (asked for, detected, or the canary's verdict)
        self._engine.exact = self.run.backends.exact
        return self._engine

    def media(self, args) -> tuple[Media, ...]:
        """The request's images then audio clips, as bytes (converted once per request object)."""
        if not args or not is_aux(args[-1]):
            return ()
        aux = args[-1]
        hit = self._memo.get(id(aux))
        if hit is None or hit[0] is not aux:
            hit = (aux, to_media_list(aux.get("visual")) + to_media_list(aux.get("audio")))
            self._memo[id(aux)] = hit
        return hit[1]

    def key_args(self, args) -> list:
        """Store key of a request: media replaced by content hashes; an empty media argument dropped."""
        if not args or not is_aux(args[-1]):
            return list(args)
        media = self.media(args)
        return [*args[:-1], {"media": media_digest(media)}] if media else list(args[:-1])

    def done(self) -> None:
        self._memo.clear()

    # --- lm-eval request types ---------------------------------------------------------------
    def rolling(self, requests) -> list:
        """loglikelihood_rolling has no media form (lm-eval's own hf multimodal model refuses it too):
        media are a one-line error, lm-eval's empty media argument is dropped."""
        for i, r in enumerate(requests):
            if self.media(r.args):
                raise OrtEvalsError(f"request {i}: loglikelihood_rolling with images or audio is not supported "
                                    "(perplexity tasks are text-only); use loglikelihood or generate_until")
        return [_text_only(r) for r in requests]

    def loglikelihood(self, requests, keys: list[list], text: Callable[[list], list], disable_tqdm: bool) -> list:
        media = [self.media(r.args) for r in requests]
        out: list = [None] * len(requests)
        plain = [i for i, m in enumerate(media) if not m]
        if plain:
            for i, v in zip(plain, text([_text_only(requests[i]) for i in plain]), strict=True):
                out[i] = v
        rich = [i for i, m in enumerate(media) if m]
        if rich:
            reqs = [MediaRequest(requests[i].args[0], requests[i].args[1], media[i]) for i in rich]

            def finish(j: int, result) -> None:
                self.run.put("loglikelihood", keys[rich[j]], [result[0], result[1]])

            for i, v in zip(rich, self._timed(reqs, "loglikelihood", finish, disable_tqdm), strict=True):
                out[i] = v
        return out

    def generate(self, requests, keys: list[list], text: Callable[[list, list], list], disable_tqdm: bool) -> list:
        media = [self.media(r.args) for r in requests]
        out: list = [None] * len(requests)
        plain = [i for i, m in enumerate(media) if not m]
        if plain:
            texts = text([_text_only(requests[i]) for i in plain], [keys[i] for i in plain])
            for i, v in zip(plain, texts, strict=True):
                out[i] = v
        rich = [i for i, m in enumerate(media) if m]
        if rich:
            # gen_kwargs as on the text path (stops + EOS text, max_gen_toks, sampling, seed)
            settings = [gen_settings(self.run, requests[i].args[1]) for i in rich]
            reqs = [MediaRequest(requests[i].args[0], None, media[i], s) for i, s in zip(rich, settings, strict=True)]

            def finish(j: int, text_out: str, n: int) -> None:
                self.run.stats["generated_tokens"] += n
                self.run.put("generate_until", keys[rich[j]], text_out)

            texts = self._timed(reqs, "generate", finish, disable_tqdm, [keys[i] for i in rich])
            for i, v in zip(rich, texts, strict=True):
                out[i] = v
        return out

    def _timed(self, reqs: Sequence[MediaRequest], kind: str, finish, disable_tqdm: bool, keys=None) -> list:
        self.run.begin()  # the media paths' passes are not metered: the run computes from here
        bar = tqdm(total=len(reqs), desc=f"ortevals media {kind}", unit="req", disable=disable_tqdm,
                   dynamic_ncols=True)
        start = time.perf_counter()

        def done(j, *result) -> None:
            finish(j, *result)
            bar.update(1)

        try:
            if kind == "loglikelihood":
                return self.engine.loglikelihood(reqs, lambda j, r: done(j, r))
            return self.engine.generate(reqs, keys, done)
        finally:
            bar.close()
            self.run.stats["requests"] += len(reqs)
            self.run.stats["seconds"] += time.perf_counter() - start
            self.run.stats["media_requests"] = self.run.stats.get("media_requests", 0) + len(reqs)


def _text_only(req):
    """The request without lm-eval's (empty) media argument, for the text path."""
    if req.args and is_aux(req.args[-1]):
        return dataclasses.replace(req, arguments=tuple(req.args[:-1]))
    return req
