"""ortevals: fast, exact lm-eval benchmarks for ONNX Runtime GenAI model packages.

Data flow: CLI (:mod:`ortevals.cli`) → presets/tasks (:mod:`ortevals.presets`)
→ lm-eval → :class:`ortevals.integrations.lm.OrtLM` → scoring engine
(:mod:`ortevals.engine.score.prefill`, math in :mod:`ortevals.engine.score.scoring`) → ORT sessions
(:mod:`ortevals.runtime`) → results (:mod:`ortevals.report.results`).

Importing this package imports neither onnxruntime, lm-eval, Olive nor torch;
lm-eval registration lives in :mod:`ortevals.integrations.lm_eval_plugin`.
"""

from ortevals.runtime import meter as _clock  # noqa: F401, I001  first: a run's start-up counts from here
from ortevals.errors import OrtEvalsError, PackageError
from ortevals.package.loader import KVSpec, ModelPackage
from ortevals.version import __version__ as __version__

__all__ = ["KVSpec", "ModelPackage", "OrtEvalsError", "PackageError"]
