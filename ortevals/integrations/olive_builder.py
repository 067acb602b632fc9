"""``OrtEvalsModelBuilder``: Olive's ModelBuilder pass, run against onnxruntime-genai's current builder API.

Olive 0.13's ``ModelBuilder`` pass does not run with onnxruntime-genai 0.18:

- it patches ``onnxruntime_genai.models.quantized_model``, which 0.18 no longer has, so it fails before
  building anything (the patch only serves Olive-quantized inputs);
- it calls ``builder.create_model`` with raw options, where 0.18 wants them prepared by
  ``builder.parse_extra_options``.

This pass is ``ModelBuilder`` with both mended, and nothing changed outside its own run: the first by
overriding ``maybe_patch_quant`` on the subclass, the second by :func:`builder_api`, a context manager
that replaces ``builder.create_model`` only while the pass runs and restores it on exit. Importing this
module (or :mod:`ortevals.integrations.olive`) changes neither Olive's ``ModelBuilder`` nor the builder.

Olive finds a pass type only through its package config, which ``olive run`` reads before it imports
any workflow ``user_script``; so a workflow names ``"type": "OrtEvalsModelBuilder"`` and is run with
``olive run --config … --package-config configs/olive_package.json`` (docs/olive.md).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from ortevals.errors import OrtEvalsError

try:
    from olive.passes.onnx.model_builder import ModelBuilder
except ImportError as e:  # pragma: no cover - exercised without olive-ai
    raise OrtEvalsError(f"the ModelBuilder pass needs olive-ai ({e}); install it with: pip install olive-ai") from None

log = logging.getLogger(__name__)
TYPE = "OrtEvalsModelBuilder"


def _has_quantized_model() -> bool:
    """Whether onnxruntime-genai still ships the module Olive's ``maybe_patch_quant`` patches."""
    try:
        return importlib.util.find_spec("onnxruntime_genai.models.quantized_model") is not None
    except ModuleNotFoundError:
        return False


def _wants_prepared_options(builder) -> bool:
    """onnxruntime-genai 0.18's ``parse_extra_options(model_name, …, extra_options)`` prepares what its
    ``create_model`` needs (``hf_details``); older builders took raw options and had no such step."""
    params = inspect.signature(builder.parse_extra_options).parameters
    return "model_name" in params and "extra_options" in params


@contextmanager
def builder_api() -> Iterator[None]:
    """Within the block, ``onnxruntime_genai.models.builder.create_model`` accepts Olive 0.13's raw options.

    Olive's pass imports ``create_model`` from the module at call time, so it sees the adapted one; on
    exit (also on error) the module holds the original again. Olive runs passes one at a time in its
    process, so no other caller sees the adapted function meanwhile.
    """
    from onnxruntime_genai.models import builder

    original = builder.create_model
    if not _wants_prepared_options(builder):
        yield
        return

    def create_model(model_name, input_path, output_dir, precision, execution_provider, cache_dir, **extra):
        if "hf_details" not in extra:  # raw options from Olive: prepare them the way the builder's CLI does
            items = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in extra.items()]
            extra = builder.parse_extra_options(model_name, input_path, output_dir, precision, execution_provider,
                                                cache_dir, items)
        return original(model_name, input_path, output_dir, precision, execution_provider, cache_dir, **extra)

    builder.create_model = create_model
    log.debug("%s: builder.create_model adapted for this pass", TYPE)
    try:
        yield
    finally:
        builder.create_model = original


class OrtEvalsModelBuilder(ModelBuilder):
    """Olive's ModelBuilder pass (same parameters), runnable with onnxruntime-genai 0.18."""

    @staticmethod
    def maybe_patch_quant():
        if _has_quantized_model():
            ModelBuilder.maybe_patch_quant()
        else:  # the module is gone: Olive's patch (for Olive-quantized inputs only) has nothing to patch
            log.debug("%s: onnxruntime_genai.models.quantized_model is absent; Olive's quant patch skipped", TYPE)

    def _run_for_config(self, model, config, output_model_path):
        # Olive decides whether a workflow needs an execution provider from the pass's module path
        # (olive.passes.onnx.*), which this pass does not have; without one the parent would build for
        # CPU silently. Name it in the system's accelerators instead.
        if not self.accelerator_spec.execution_provider:
            raise OrtEvalsError(f"{TYPE}: no execution provider for the build; name one in the workflow's "
                                "systems.<host>.accelerators[0].execution_providers (e.g. CPUExecutionProvider)")
        with builder_api():
            return super()._run_for_config(model, config, output_model_path)
