"""ortevals: fast, exact lm-eval benchmarks for ONNX Runtime GenAI model packages.

Data flow: CLI (:mod:`ortevals.cli`) → presets/tasks (:mod:`ortevals.presets`)
→ lm-eval → :class:`ortevals.lm.OrtLM` → scoring engine
(:mod:`ortevals.engine`, math in :mod:`ortevals.scoring`) → ORT sessions
(:mod:`ortevals.runtime`) → results (:mod:`ortevals.results`).

Importing this package imports neither onnxruntime, lm-eval, Olive nor torch;
lm-eval registration lives in :mod:`ortevals.lm_eval_plugin`.
"""

from ortevals.errors import OrtEvalsError, PackageError
from ortevals.package import KVSpec, ModelPackage

__all__ = ["KVSpec", "ModelPackage", "OrtEvalsError", "PackageError"]
__version__ = "0.1.0"
