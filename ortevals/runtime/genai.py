"""onnxruntime-genai for the incremental path: one Model, reusable Generators.

Owns building ``og.Config`` from the package with the providers and thread
counts set explicitly (og's defaults were 1.7x slower here), and a
:class:`Cursor`: a Generator plus the token ids it holds, which moves to a new
token sequence by ``rewind_to`` the common prefix and ``append_tokens`` of the
rest, or by a fresh Generator where rewinding is not exact (windowed sliding
KV caches, multimodal packages).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import numpy as np

from ortevals.errors import PackageError, ProviderError, first_line
from ortevals.package import ModelPackage
from ortevals.prefix import common_prefix
from ortevals.providers import ProviderConfig
from ortevals.runtime import import_og

log = logging.getLogger(__name__)


def rewind_is_exact(package: ModelPackage) -> tuple[bool, str]:
    """Whether ``rewind_to`` gives exact logits on this package, and why not."""
    if package.windowed:
        return False, "a windowed sliding KV cache is silently wrong after rewinding past the window"
    if package.embedding is not None or package.skipped_models:
        return False, "multimodal rewind is a no-op on some onnxruntime-genai versions"
    return True, ""


class GenaiRunner:
    """An ``og.Model`` opened on one provider. Build with :meth:`open`."""

    def __init__(self, package: ModelPackage, model, og, rewind_ok: bool) -> None:
        self.package = package
        self.model = model
        self.og = og
        self.rewind_ok = rewind_ok
        self.generators_created = 0

    @classmethod
    def open(cls, package: ModelPackage, provider: ProviderConfig) -> GenaiRunner:
        og = import_og()
        for section in ("decoder", "embedding"):
            opts = package.config["model"].get(section, {}).get("session_options", {})
            if isinstance(opts, dict) and opts.get("custom_ops_library"):
                raise PackageError(f"{package.root / 'genai_config.json'}: model.{section}.session_options."
                                   "custom_ops_library is set; ortevals does not load native libraries "
                                   "named by a package")
        config = og.Config(str(package.root))
        config.clear_providers()
        if provider.name != "cpu":
            try:
                config.append_provider(provider.name)
                for key, value in provider.options.items():
                    config.set_provider_option(provider.name, key, value)
            except Exception as e:
                raise ProviderError(f"onnxruntime-genai cannot use provider {provider.name!r}: {e}") from None
        threads = {"intra_op_num_threads": provider.intra_op_threads, "inter_op_num_threads": 1}
        overlay = {"model": {s: {"session_options": threads} for s in ("decoder", "embedding")
                             if s in package.config["model"]}}
        config.overlay(json.dumps(overlay))
        try:
            model = og.Model(config)
        except Exception as e:
            raise PackageError(f"{package.root}: onnxruntime-genai could not load the package: "
                               f"{first_line(e)}") from None
        ok, why = rewind_is_exact(package)
        if not ok:
            log.info("incremental path: fresh Generator per input (%s)", why)
        return cls(package, model, og, ok)

    def cursor(self, max_length: int) -> Cursor:
        """A cursor whose Generators reserve KV for ``max_length`` tokens (never the whole context)."""
        return Cursor(self, max_length)

    def greedy_steps(self, prompts: list[list[int]], max_new: int) -> Iterator[np.ndarray]:
        """og's greedy search over a right-padded batch; yields each step's next tokens ``[B]``.

        A batched Generator takes one ``append_tokens`` (og 0.18), so decoding is og's own
        ``generate_next_token``; og masks the trailing pad ids, so no prompt may end in one.
        """
        pad = self.package.pad_token_id
        width = max(len(p) for p in prompts)
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=width + max_new, do_sample=False, batch_size=len(prompts))
        self.generators_created += 1
        gen = self.og.Generator(self.model, params)
        gen.append_tokens(np.asarray([p + [pad] * (width - len(p)) for p in prompts], dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
            yield np.asarray(gen.get_next_tokens())

    def _generator(self, max_length: int):
        params = self.og.GeneratorParams(self.model)
        # our own token choice reads get_logits(); og's search stays greedy and unused
        params.set_search_options(max_length=max_length, do_sample=False, batch_size=1)
        self.generators_created += 1
        return self.og.Generator(self.model, params)


class Cursor:
    """A Generator and the tokens it holds; moves to new sequences as cheaply as is exact."""

    def __init__(self, runner: GenaiRunner, max_length: int) -> None:
        self.runner = runner
        self.max_length = max_length
        self.gen = None
        self.tokens: list[int] = []
        self.tokens_run = 0

    def move_to(self, tokens: list[int] | tuple[int, ...]) -> np.ndarray:
        """Hold exactly ``tokens``; return the logits ``[V]`` that predict the next token."""
        tokens = list(tokens)
        if len(tokens) > self.max_length:
            raise ValueError(f"{len(tokens)} tokens exceed the cursor's max_length {self.max_length}")
        keep = common_prefix(self.tokens, tokens) if self.gen is not None and self.runner.rewind_ok else 0
        keep = min(keep, len(tokens) - 1)  # the last token must be run to get its logits
        if self.gen is None or keep <= 0:
            self.gen, self.tokens, keep = self.runner._generator(self.max_length), [], 0
        elif keep < len(self.tokens):
            self.gen.rewind_to(keep)
            self.tokens = self.tokens[:keep]
        return self.append(tokens[keep:])

    def append(self, new: list[int]) -> np.ndarray:
        """Append ``new`` tokens; logits ``[V]`` after the last one."""
        self.gen.append_tokens(np.asarray([new], dtype=np.int32))
        self.tokens.extend(new)
        self.tokens_run += len(new)
        return np.asarray(self.gen.get_logits())[0, -1]

    def tail_logits(self, n: int) -> np.ndarray | None:
        """Logits ``[n, V]`` of the last append's last n positions, if og returns all positions."""
        out = np.asarray(self.gen.get_output(self.runner.package.logits_name))
        if out.ndim != 3 or out.shape[1] < n:
            return None  # pruned LM head or fixed window: only the last position
        return out[0, -n:]
