"""onnxruntime-genai for image and audio requests: the full multimodal model and its processor.

Owns the og calls of the media path (FIELD_NOTES, "Multimodal on
onnxruntime-genai 0.18"): an ``og.Model`` opened with its vision and speech
models (unlike :mod:`ortevals.runtime.genai`, which opens packages text-only),
``model.create_multimodal_processor()``, media handed over with
``og.Images.open_bytes`` / ``og.Audios.open_bytes`` (no files), and Generators
primed with ``generator.set_inputs(processed)``. Batch 1: the Gemma-4 processor
ignores a list of prompts. One Generator per set of media: ``rewind_to(0)`` then
a new image fails in og 0.18.

Opened lazily by :class:`ortevals.engine.media.og.MediaEngine`, on the first
request that carries media; text requests never come here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ortevals.errors import OrtEvalsError, PackageError, first_line
from ortevals.install import import_og
from ortevals.package.loader import ModelPackage
from ortevals.package.media import Media
from ortevals.package.scope import Reads
from ortevals.runtime.genai import NEUTRAL_SEARCH, og_config, og_files, og_settings
from ortevals.runtime.plugins import with_plugin
from ortevals.runtime.providers import ProviderConfig

log = logging.getLogger(__name__)
SECTIONS = ("decoder", "embedding", "vision", "speech")
# what og's processor reads besides each section's config_filename: its tokenizer (ort-extensions) opens
# these when present; a black box, so every name it may read is keyed (absent ones as absent)
OG_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer_module.json", "tokenizer.model",
                      "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt")


def media_reads(package: ModelPackage, provider: ProviderConfig) -> Reads:
    """What :meth:`MediaRunner.open` and its processor read: every section's model and external data,
    the vision processor config (``processor_config.json`` when unnamed, as og defaults) and the speech
    feature config, og's tokenizer files, and :func:`~ortevals.runtime.genai.og_settings`."""
    files = og_files(package, SECTIONS, ("config_filename",))
    vision = package.config["model"].get("vision")
    if isinstance(vision, dict) and vision.get("filename") and not vision.get("config_filename"):
        files.append(package.root / "processor_config.json")
    files.extend(package.tokenizer_root / n for n in OG_TOKENIZER_FILES)
    return Reads("onnxruntime-genai media", tuple(files), og_settings(package, provider, SECTIONS),
                 with_plugin(provider.name, ("onnxruntime-genai", "onnxruntime")))


@dataclass(frozen=True)
class Processed:
    """og's processor output for one prompt + media: the og object and its ``input_ids [S]``."""

    inputs: object
    input_ids: tuple[int, ...]

    def numpy(self) -> dict[str, np.ndarray]:
        """Every processor output as numpy (pixel_values [N,P,768], pixel_position_ids, audio_embeds, ...)."""
        return {k: np.asarray(self.inputs[k].as_numpy()) for k in self.inputs.keys()}


class MediaRunner:
    """An ``og.Model`` with vision and speech, and its multimodal processor. Build with :meth:`open`."""

    def __init__(self, package: ModelPackage, model, og) -> None:
        self.package = package
        self.model = model
        self.og = og
        self.processor = model.create_multimodal_processor()
        self.generators_created = 0
        self.processed = 0

    @classmethod
    def open(cls, package: ModelPackage, provider: ProviderConfig) -> MediaRunner:
        og = import_og()
        config = og_config(og, package, provider, SECTIONS)
        try:
            og_model = og.Model(config)
            runner = cls(package, og_model, og)
        except Exception as e:
            raise PackageError(f"{package.root}: onnxruntime-genai could not load the multimodal package: "
                               f"{first_line(e)}") from None
        log.info("onnxruntime-genai opened %s with its vision/speech models for media requests", package.root)
        return runner

    def process(self, prompt: str, media: tuple[Media, ...], name: str = "request") -> Processed:
        """Run og's processor on one prompt and its media (images and audio in their own order)."""
        images = [m.data for m in media if m.kind == "image"]
        audios = [m.data for m in media if m.kind == "audio"]
        kwargs = {}
        try:
            if images:
                kwargs["images"] = self.og.Images.open_bytes(*images)
            if audios:
                kwargs["audios"] = self.og.Audios.open_bytes(*audios)
            inputs = self.processor(prompt, **kwargs)
        except Exception as e:
            raise OrtEvalsError(f"{name}: onnxruntime-genai's processor refused the prompt or its media "
                                f"({len(images)} image(s), {len(audios)} audio clip(s)): {first_line(e)}") from None
        self.processed += 1
        ids = np.asarray(inputs["input_ids"].as_numpy()).reshape(-1)
        return Processed(inputs, tuple(int(t) for t in ids))

    def generator(self, processed: Processed, max_length: int, name: str = "request"):
        """A Generator holding the prompt (vision, speech, embedding and prefill run here)."""
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, batch_size=1, **NEUTRAL_SEARCH)
        try:
            gen = self.og.Generator(self.model, params)
            gen.set_inputs(processed.inputs)
        except Exception as e:
            raise OrtEvalsError(f"{name}: onnxruntime-genai failed on the prompt's media: {first_line(e)}") from None
        self.generators_created += 1
        return gen

    def last_logits(self, gen) -> np.ndarray:
        """Logits ``[V]`` that predict the next token."""
        return np.asarray(gen.get_logits())[0, -1]

    def append(self, gen, tokens: list[int]) -> np.ndarray:
        """Append ``tokens``; logits ``[len(tokens), V]`` of every appended position."""
        if self.package.logits_positions == 1 and len(tokens) > 1:  # pruned LM head: one token at a time
            return np.stack([self.append(gen, [t])[0] for t in tokens])
        gen.append_tokens(np.asarray([tokens], dtype=np.int32))
        if len(tokens) == 1:
            return np.asarray(gen.get_logits())[0, -1:]
        return np.asarray(gen.get_output(self.package.logits_name))[0, -len(tokens):]
