"""Images and audio as bytes for onnxruntime-genai's processor, all in memory.

Owns :class:`Media` (one image or one audio clip: its kind and encoded bytes,
what ``og.Images.open_bytes`` / ``og.Audios.open_bytes`` take) and
:func:`to_media`, which accepts what benchmark harnesses hand over:

* a PIL image (its pixels, written as PNG in memory);
* a path (``str`` / ``os.PathLike``) or raw ``bytes``, recognised by their
  magic bytes (PNG, JPEG, GIF, BMP, WebP, TIFF; WAV, FLAC, MP3, OGG);
* a ``{"array", "sampling_rate"}`` dict (Hugging Face ``datasets`` audio) →
  32-bit float WAV in memory (scipy); ``{"bytes": ...}`` / ``{"path": ...}``
  dicts (``datasets`` with ``decode=False``);
* a ``datasets`` ≥ 4 / torchcodec ``AudioDecoder`` (duck-typed:
  ``get_all_samples()`` → ``.data [channels, samples]`` and ``.sample_rate``;
  torch is never imported here).

Video (files, bytes or decoder objects) is a one-line error: onnxruntime-genai
0.18 has no video processor. No temporary file is ever written.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ortevals.errors import OrtEvalsError

IMAGE, AUDIO = "image", "audio"
_MAGIC = (  # (prefix, offset, kind, format)
    (b"\x89PNG\r\n\x1a\n", 0, IMAGE, "png"), (b"\xff\xd8\xff", 0, IMAGE, "jpeg"), (b"GIF8", 0, IMAGE, "gif"),
    (b"BM", 0, IMAGE, "bmp"), (b"II*\x00", 0, IMAGE, "tiff"), (b"MM\x00*", 0, IMAGE, "tiff"),
    (b"fLaC", 0, AUDIO, "flac"), (b"ID3", 0, AUDIO, "mp3"), (b"\xff\xfb", 0, AUDIO, "mp3"),
    (b"\xff\xf3", 0, AUDIO, "mp3"), (b"\xff\xf2", 0, AUDIO, "mp3"), (b"OggS", 0, AUDIO, "ogg"),
    (b"ftyp", 4, "video", "mp4/mov"), (b"\x1aE\xdf\xa3", 0, "video", "mkv/webm"),
)
NATIVE_IMAGE = ("png", "jpeg")  # decoded by og's DecodeImage as they are; others become PNG
VIDEO_SUFFIXES = {".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpeg", ".mpg", ".wmv", ".flv"}


@dataclass(frozen=True)
class Media:
    """One image or audio clip: ``kind`` is "image" or "audio"; ``data`` its encoded bytes."""

    kind: str
    data: bytes

    def __post_init__(self) -> None:
        if self.kind not in (IMAGE, AUDIO):
            raise OrtEvalsError(f"media kind must be 'image' or 'audio', got {self.kind!r}")
        if not isinstance(self.data, bytes) or not self.data:
            raise OrtEvalsError(f"{self.kind} media must be non-empty bytes")

    def __repr__(self) -> str:  # never print megabytes of bytes in a log or an error
        return f"Media({self.kind}, {len(self.data)} bytes)"


def to_media(obj: Any) -> Media:
    """One image or audio object in any supported form → :class:`Media` (see the module docstring)."""
    if isinstance(obj, Media):
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return _from_bytes(bytes(obj), "bytes")
    if isinstance(obj, (str, os.PathLike)):
        return _from_path(Path(obj))
    if isinstance(obj, dict):
        return _from_dict(obj)
    if _is_pil(obj):
        return Media(IMAGE, _pil_bytes(obj))
    if callable(getattr(obj, "get_all_samples", None)) and not _looks_like_video(obj):
        samples = obj.get_all_samples()
        data = samples.data.numpy() if hasattr(samples.data, "numpy") else np.asarray(samples.data)
        return Media(AUDIO, wav_bytes(np.asarray(data).T, int(samples.sample_rate)))
    if _looks_like_video(obj):
        raise OrtEvalsError(f"video input ({type(obj).__name__}) is not supported: onnxruntime-genai 0.18 has "
                            "no video processor; pass images or audio")
    raise OrtEvalsError(f"cannot use {type(obj).__name__} as media; expected a PIL image, a path, bytes, "
                        "an {'array', 'sampling_rate'} dict or an audio decoder")


def to_media_list(objs: Any) -> tuple[Media, ...]:
    """None, one object or a list of them → a tuple of :class:`Media` (images and audio in order)."""
    if objs is None:
        return ()
    if isinstance(objs, (list, tuple)):
        return tuple(m for o in objs for m in to_media_list(o))
    return (to_media(objs),)


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """``samples`` ``[n]`` or ``[n, channels]`` (float or int PCM) → WAV bytes (float input: 32-bit float)."""
    from scipy.io import wavfile

    x = np.asarray(samples)
    if x.ndim not in (1, 2) or x.size == 0:
        raise OrtEvalsError(f"audio array must be [samples] or [samples, channels] and non-empty, got shape {x.shape}")
    if not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise OrtEvalsError(f"audio sampling_rate must be a positive int, got {rate!r}")
    if np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
    elif x.dtype not in (np.int16, np.int32, np.uint8):
        raise OrtEvalsError(f"audio array dtype {x.dtype} is not supported; expected float, int16 or int32")
    buf = io.BytesIO()
    wavfile.write(buf, int(rate), x)
    return buf.getvalue()


def sniff(data: bytes) -> tuple[str, str] | None:
    """(kind, format) from magic bytes, or None."""
    if data[:4] == b"RIFF" and data[8:12] in (b"WAVE", b"AVI ", b"WEBP"):
        return {b"WAVE": (AUDIO, "wav"), b"AVI ": ("video", "avi"), b"WEBP": (IMAGE, "webp")}[data[8:12]]
    for prefix, offset, kind, fmt in _MAGIC:
        if data[offset:offset + len(prefix)] == prefix:
            return kind, fmt
    return None


def _from_bytes(data: bytes, where: str) -> Media:
    found = sniff(data)
    if found is None:
        raise OrtEvalsError(f"{where}: not a recognised image or audio format (first bytes {data[:8]!r}); "
                            "expected PNG, JPEG, GIF, BMP, WebP, TIFF, WAV, FLAC, MP3 or OGG")
    kind, fmt = found
    if kind == "video":
        raise OrtEvalsError(f"{where}: video ({fmt}) is not supported: onnxruntime-genai 0.18 has no video "
                            "processor; pass images or audio")
    if kind == IMAGE and fmt not in NATIVE_IMAGE:
        from PIL import Image

        return Media(IMAGE, _pil_bytes(Image.open(io.BytesIO(data))))
    return Media(kind, data)


def _from_path(path: Path) -> Media:
    if path.suffix.lower() in VIDEO_SUFFIXES:
        raise OrtEvalsError(f"{path}: video is not supported: onnxruntime-genai 0.18 has no video processor; "
                            "pass images or audio")
    if not path.is_file():
        raise OrtEvalsError(f"{path}: media file not found")
    return _from_bytes(path.read_bytes(), str(path))


def _from_dict(obj: dict) -> Media:
    if "array" in obj:
        if "sampling_rate" not in obj:
            raise OrtEvalsError("audio dict has 'array' but no 'sampling_rate'; expected {'array', 'sampling_rate'}")
        return Media(AUDIO, wav_bytes(np.asarray(obj["array"]), obj["sampling_rate"]))
    if obj.get("bytes"):
        return _from_bytes(bytes(obj["bytes"]), str(obj.get("path") or "bytes"))
    if obj.get("path"):
        return _from_path(Path(obj["path"]))
    raise OrtEvalsError(f"media dict with keys {sorted(obj)} is not supported; expected "
                        "{'array', 'sampling_rate'}, {'bytes'} or {'path'}")


def _is_pil(obj: Any) -> bool:
    return type(obj).__module__.startswith("PIL.") and hasattr(obj, "save") and hasattr(obj, "mode")


def _pil_bytes(img) -> bytes:
    """The image's pixels as PNG (lossless; fast compression). Always from the pixels, never from the
    file it was read from: a harness may have resized or converted it since."""
    if img.mode not in ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"):
        img = img.convert("RGB")  # CMYK, YCbCr, F...: PNG cannot hold them
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _looks_like_video(obj: Any) -> bool:
    name = type(obj).__name__.lower()
    return "video" in name or (hasattr(obj, "get_frames_at") and not hasattr(obj, "get_samples_played_in_range"))
