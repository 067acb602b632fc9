"""What a multimodal package needs for image and audio requests, checked without opening a model.

Owns :func:`multimodal_spec` (the package's vision and speech sections, the
processor configs they name, and the prompt markers of its ``model.type``,
validated with one-line errors naming the field) and :func:`place_markers`,
the one rule for where images and audio go in a prompt:

1. a context that already holds the model's markers, one per image (and one per
   audio clip), is used as it is;
2. otherwise lm-eval's generic ``<image>`` placeholder (lm-eval's multimodal
   tasks write it), one per image, is replaced in order by the model's marker;
3. otherwise the markers are placed at the start of the prompt, images first.

Any other count of markers is a one-line error. BOS: onnxruntime-genai's
processor adds none, so the tokenizer's BOS text is put in front when the text
path would add BOS too (:class:`MultimodalSpec` ``bos_text``), and log-likelihoods
and generations mean the same prompt on both paths.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ortevals.errors import OrtEvalsError, PackageError
from ortevals.package.loader import CONFIG_NAME, ModelPackage, resolve_inside

LM_EVAL_IMAGE = "<image>"  # lm_eval.models.hf_vlms.DEFAULT_IMAGE_PLACEHOLDER
_QWEN = "<|vision_start|><|image_pad|><|vision_end|>"
# model.type -> (image marker, audio marker); "{i}" is the 1-based index of the image / clip
MARKERS: dict[str, tuple[str, str | None]] = {
    "gemma4": ("<|image|>", "<|audio|>"),
    "gemma3": ("<start_of_image>", None),
    "phi3v": ("<|image_{i}|>", None),
    "phi4mm": ("<|image_{i}|>", "<|audio_{i}|>"),
    "qwen2_5_vl": (_QWEN, None), "qwen3_vl": (_QWEN, None), "qwen3_5": (_QWEN, None),
    "qwen3_5_moe": (_QWEN, None), "fara": (_QWEN, None),
}
DEFAULT_VISION_CONFIG = "processor_config.json"


@dataclass(frozen=True)
class MultimodalSpec:
    """A package's multimodal parts: paths are inside the package; None where absent."""

    model_type: str
    image_marker: str
    audio_marker: str | None
    vision_model: Path | None
    vision_config: Path | None
    speech_model: Path | None
    speech_config: Path | None

    @property
    def takes_images(self) -> bool:
        return self.vision_model is not None

    @property
    def takes_audio(self) -> bool:
        return self.speech_model is not None and self.audio_marker is not None

    def marker(self, kind: str, index: int) -> str:
        """The marker of the ``index``-th (0-based) image or audio clip."""
        fmt = self.image_marker if kind == "image" else self.audio_marker
        return fmt.replace("{i}", str(index + 1))


def has_media_models(package: ModelPackage) -> bool:
    """Whether genai_config.json names a vision or speech model (cheap; nothing opened)."""
    model = package.config.get("model", {})
    return any(isinstance(model.get(k), dict) and model[k].get("filename") for k in ("vision", "speech"))


def multimodal_spec(package: ModelPackage) -> MultimodalSpec:
    """Validate the package for image/audio requests; every error is one line naming the field."""
    where = package.root / CONFIG_NAME
    model = package.config["model"]
    if package.model_type not in MARKERS:
        raise PackageError(f"{where}: field model.type={package.model_type!r} is not a multimodal type ortevals "
                           f"supports for image/audio requests; expected one of {sorted(MARKERS)}")
    if package.embedding is None:
        raise PackageError(f"{where}: field model.embedding is missing; a multimodal package needs an embedding "
                           "model that merges image/audio features into inputs_embeds")
    vision_model = vision_config = speech_model = speech_config = None
    vision = model.get("vision")
    if isinstance(vision, dict) and vision.get("filename"):
        vision_model = _existing(package.root, vision, "vision", "filename")
        vision_config = _existing(package.root, vision, "vision", "config_filename", DEFAULT_VISION_CONFIG,
                                  "onnxruntime-genai's image processor reads it")
        _json_with(vision_config, "processor", "model.vision.config_filename")
    speech = model.get("speech")
    if isinstance(speech, dict) and (speech.get("filename") or speech.get("config_filename")):
        if not speech.get("filename"):
            raise PackageError(f"{where}: field model.speech.config_filename={speech['config_filename']!r} is set "
                               "but model.speech.filename is empty; expected both (speech model + its feature "
                               "extraction config) or neither")
        speech_model = _existing(package.root, speech, "speech", "filename")
        speech_config = _existing(package.root, speech, "speech", "config_filename", None,
                                  "onnxruntime-genai's audio feature extraction reads it")
        _json_with(speech_config, "feature_extraction", "model.speech.config_filename")
    if vision_model is None and speech_model is None:
        raise PackageError(f"{where}: no model.vision.filename or model.speech.filename; the package takes no "
                           "images or audio")
    image_marker, audio_marker = MARKERS[package.model_type]
    return MultimodalSpec(package.model_type, image_marker, audio_marker, vision_model, vision_config,
                          speech_model, speech_config)


def _existing(root: Path, section: dict, role: str, key: str, default: str | None = None,
              why: str = "") -> Path:
    name = section.get(key) or default
    field = f"model.{role}.{key}"
    if not name:
        raise PackageError(f"{root / CONFIG_NAME}: field {field} is missing; expected a file name"
                           + (f" ({why})" if why else ""))
    path = resolve_inside(root, name, field)
    if path.is_dir():
        raise PackageError(f"{root / CONFIG_NAME}: field {field}={name!r} is a folder in {root}; expected a file")
    if not path.is_file():
        raise PackageError(f"{root / CONFIG_NAME}: field {field}={name!r} not found in {root}"
                           + (f"; {why}" if why else ""))
    return path


def _json_with(path: Path, key: str, field: str) -> None:
    """The config file is JSON with a top-level ``key`` (a processor vs a feature-extraction config)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackageError(f"{path}: not valid JSON ({e}); named by field {field}") from None
    if not isinstance(data, dict) or key not in data:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise PackageError(f"{path}: named by field {field} but has no '{key}' section (found {keys}); "
                           "the file does not match its field")


MEDIA_TOKEN_FIELDS = ("image_token_id", "audio_token_id")


def check_media_tokens(package: ModelPackage, tokenizer) -> None:
    """``model.image_token_id`` / ``audio_token_id`` name special tokens of the package's tokenizer.

    The embedding model puts image/audio features where ``input_ids`` hold that id, so an id that
    ordinary text produces (a text token) sends text to the feature slots: every prompt holding it fails
    inside the embedding model (Gather/ScatterND out of bounds) or is silently wrong. ``tokenizer``: the
    package's HF ``tokenizers.Tokenizer``.
    """
    where = package.root / CONFIG_NAME
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for name in MEDIA_TOKEN_FIELDS:
        value = package.config["model"].get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PackageError(f"{where}: field model.{name} must be a token id (int >= 0), got {value!r}")
        if value in special:
            continue
        text = tokenizer.id_to_token(value)
        what = f"the ordinary text token {text!r}" if text is not None else "not a token"
        raise PackageError(f"{where}: field model.{name}={value} is {what} in tokenizer.json; expected a special "
                           "token (the model's media marker), since the embedding model puts media features where "
                           "input_ids hold this id")


def place_markers(spec: MultimodalSpec, context: str, n_images: int, n_audio: int) -> str:
    """The prompt with one model marker per image and per audio clip (rule in the module docstring)."""
    if n_images and not spec.takes_images:
        raise OrtEvalsError(f"model type {spec.model_type!r}: the package has no vision model, but the request "
                            f"has {n_images} image(s)")
    if n_audio and not spec.takes_audio:
        raise OrtEvalsError(f"model type {spec.model_type!r}: the package has no speech model, but the request "
                            f"has {n_audio} audio clip(s)")
    text = context
    front = ""
    for kind, n, generic in (("image", n_images, LM_EVAL_IMAGE), ("audio", n_audio, None)):
        if kind == "audio" and spec.audio_marker is None:
            continue
        found = _count(spec, kind, text)
        if found == n:
            continue
        if found:
            raise OrtEvalsError(f"the prompt holds {found} {kind} marker(s) {spec.marker(kind, 0)!r} but the "
                                f"request has {n} {kind}(s); expected one marker per {kind}, or none")
        if generic and text.count(generic) == n and n:
            for i in range(n):
                text = text.replace(generic, spec.marker(kind, i), 1)
        elif generic and text.count(generic):
            raise OrtEvalsError(f"the prompt holds {text.count(generic)} {generic!r} placeholder(s) but the request "
                                f"has {n} {kind}(s); expected one per {kind}, or none")
        else:
            front += "".join(spec.marker(kind, i) for i in range(n))
    return front + text


def _count(spec: MultimodalSpec, kind: str, text: str) -> int:
    fmt = spec.image_marker if kind == "image" else spec.audio_marker
    if "{i}" in fmt:
        return len(re.findall(re.escape(fmt).replace(re.escape("{i}"), r"\d+"), text))
    return text.count(fmt)
