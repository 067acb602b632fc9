"""The lmms-eval entry point: ``ortevals`` as a ``ModelManifest`` (the lmms-eval registry edge).

lmms-eval 0.7.x loads every payload of the ``lmms_eval.models`` entry-point group while
``lmms_eval.models`` is imported, for every run, whatever model it names; a payload may be
a ``ModelManifest`` or a callable returning one. This payload is the callable
:func:`manifest`: the module imports nothing at all, so

- loading the entry point costs nothing and never fails (a failing payload makes
  lmms-eval skip every entry point after it, with only a warning);
- importing this module first cannot recurse: a module-level ``ModelManifest`` would
  import ``lmms_eval.models``, whose ``__init__`` loads the entry points, which would
  find this module half-initialized.

The classes it names live in :mod:`ortevals.integrations.lmms` (torch, lm-eval, the
engine) and are imported only when ``--model ortevals`` is asked for. ``pyproject.toml``::

    [project.entry-points."lmms_eval.models"]
    ortevals = "ortevals.integrations.lmms_plugin:manifest"
"""

from __future__ import annotations

MODEL_ID = "ortevals"
SIMPLE_CLASS = "ortevals.integrations.lmms.OrtLMMS"
CHAT_CLASS = "ortevals.integrations.lmms.OrtLMMSChat"


def manifest():
    """``ModelManifest("ortevals")``: ``--model ortevals`` resolves to the chat class, ``--force_simple``
    to the simple one."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, simple_class_path=SIMPLE_CLASS, chat_class_path=CHAT_CLASS)
