"""The lmms-eval entry point: ``ortevals`` as a :class:`ModelManifest` (the lmms-eval registry edge).

lmms-eval 0.7.x loads every payload of the ``lmms_eval.models`` entry-point group while
``lmms_eval.models`` is imported, for every run, whatever model it names. This module is
that payload, so it imports only lmms-eval's registry dataclass: no torch, no onnxruntime,
no ortevals engine. The classes it names live in :mod:`ortevals.integrations.lmms` and are
imported only when ``--model ortevals`` is asked for.

``pyproject.toml``::

    [project.entry-points."lmms_eval.models"]
    ortevals = "ortevals.integrations.lmms_plugin:MANIFEST"
"""

from __future__ import annotations

from lmms_eval.models.registry_v2 import ModelManifest

SIMPLE_CLASS = "ortevals.integrations.lmms.OrtLMMS"
CHAT_CLASS = "ortevals.integrations.lmms.OrtLMMSChat"

# lmms-eval resolves `--model ortevals` to the chat class, `--force_simple` to the simple one
MANIFEST = ModelManifest(model_id="ortevals", simple_class_path=SIMPLE_CLASS, chat_class_path=CHAT_CLASS)
