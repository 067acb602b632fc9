"""Which media path serves a package: ``media_path=auto|og|fast``.

Owns the choice between og's multimodal pipeline (:class:`~ortevals.engine.media.og.MediaEngine`)
and the fast path (:class:`~ortevals.engine.media.fast.FastMediaEngine`: og's processor, then raw
onnxruntime with shared text-prefix KV), made from the package's layout (``fast_layout``), and
the one-line error when ``fast`` is asked of a package that cannot take it.
"""

from __future__ import annotations

import logging

from ortevals.engine.media.fast import FastMediaEngine, fast_layout
from ortevals.engine.media.og import MediaEngine
from ortevals.errors import OrtEvalsError
from ortevals.package.loader import ModelPackage
from ortevals.package.multimodal import multimodal_spec

log = logging.getLogger(__name__)
MEDIA_PATHS = ("auto", "og", "fast")


def open_media(package: ModelPackage, tokenizer, provider=None, max_length: int | None = None,
               eos_ids: set[int] | None = None, path: str = "auto") -> MediaEngine:
    """The media engine ``path`` asks for: "og" (onnxruntime-genai's pipeline), "fast" (og's processor,
    then raw onnxruntime with shared text-prefix KV: :mod:`ortevals.engine.media.fast`) or "auto"
    (fast where the layout allows). The package is validated for media; no model is opened yet."""
    spec = multimodal_spec(package)
    if path not in MEDIA_PATHS:
        raise OrtEvalsError(f"media_path must be auto, og or fast, got {path!r}")
    cls = MediaEngine
    if path != "og":
        ok, why = fast_layout(package)
        if ok:
            cls = FastMediaEngine
        elif path == "fast":
            raise OrtEvalsError(f"media_path=fast: {package.root} cannot take the fast media path ({why}); "
                                "use media_path=og or auto")
        else:
            log.info("media path: onnxruntime-genai's pipeline (%s)", why)
    return cls.open(package, tokenizer, provider, max_length, eos_ids, spec)
