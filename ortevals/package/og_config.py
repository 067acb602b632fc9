"""Would onnxruntime-genai accept this ``genai_config.json``? Asked of onnxruntime-genai itself.

A package ortevals scores must be one its runtime accepts. onnxruntime-genai's rules live in its
C++ parser (``src/config.cpp``: every field's JSON type, integers that must be whole, unknown
keys refused per section) and in its model factory (``src/models/model.cpp``: ``model.type``
must be in the type lists of ``model_type.h``, else "Unsupported model_type"). Both change from
release to release, so they are not copied here: the installed onnxruntime-genai parses a copy
of the config in a temporary folder that holds nothing else (``og.Config`` reads only the JSON),
then is asked to create the model there (``og.Model``), which settles the type before it opens
any file; the missing model files make every accepted type fail later with another message.
No model of the package is opened. Where onnxruntime-genai is not installed nothing is checked.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from ortevals.errors import first_line
from ortevals.install import OG_WHEELS, import_og, installed

log = logging.getLogger(__name__)
UNSUPPORTED_TYPE = "Unsupported model_type"  # og's own message (model.cpp) for a type it cannot create


def og_refusal(config_bytes: bytes) -> str | None:
    """onnxruntime-genai's one-line refusal of this config, or None when it accepts it (or is absent)."""
    if not installed(OG_WHEELS):
        log.debug("onnxruntime-genai is not installed: its acceptance of the config is not checked")
        return None
    og = import_og()
    with tempfile.TemporaryDirectory(prefix="ortevals-config-") as folder:
        path = Path(folder) / "genai_config.json"
        path.write_bytes(config_bytes)  # byte for byte: og's line/index positions are the user's file's
        try:
            config = og.Config(folder)
        except Exception as e:  # og raises RuntimeError with its parser's message
            return _clean(first_line(e), folder)
        config.clear_providers()  # the type is settled before any provider or file is touched
        try:
            og.Model(config)
        except Exception as e:
            if UNSUPPORTED_TYPE in str(e):
                return _clean(first_line(e), folder)
    return None


def _clean(message: str, folder: str) -> str:
    """og's message without the temporary folder: "Error encountered while parsing '…' JSON Error: x" → "x"."""
    if "JSON Error:" in message:
        message = message.split("JSON Error:", 1)[1].strip()
    return message.replace(f"{folder}/", "").replace(folder, "")
