"""The package's tokenizer, read the way lm-eval's ``hf`` backend reads it.

Owns loading ``tokenizer.json`` (Hugging Face ``tokenizers``, the same Rust
code transformers' fast tokenizers run) plus ``tokenizer_config.json`` for the
special-token strings and the chat template (rendered by :mod:`ortevals.package.chat`
as transformers renders it), and encoding with lm-eval's BOS rules: special
tokens are added as the tokenizer's post-processor says unless the caller
decides, and never twice when the text already starts with BOS.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortevals.errors import PackageError
from ortevals.package.chat import choose_template, render, special_token_vars
from ortevals.package.config import CONFIG_NAME, load_json_config
from ortevals.package.extend import encode_extending, may_split
from ortevals.package.loader import ModelPackage
from ortevals.package.manifest import locate, tokenizer_folder
from ortevals.package.scope import Reads

log = logging.getLogger(__name__)
MIN_SLICE = 16  # texts a thread of encode_many takes at least: fewer are not worth a thread


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """encode_many's threads, one per core (daemon-like: idle between calls)."""
    return ThreadPoolExecutor(_cores(), thread_name_prefix="ortevals-tokenize")


@dataclass(frozen=True)
class TokenizerFiles:
    """The files :meth:`Tokenizer.load` opens (the template file only when the config has no template)."""

    tokenizer: Path
    config: Path
    template: Path


def tokenizer_files(root: Path) -> TokenizerFiles:
    return TokenizerFiles(root / "tokenizer.json", root / "tokenizer_config.json", root / "chat_template.jinja")


def package_tokenizer_root(folder: Path) -> Path:
    """The folder a GenAI package's tokenizer files are in (``model.tokenizer_dir`` resolved as
    :attr:`ModelPackage.tokenizer_root` resolves it), from its ``genai_config.json`` alone: no model is read."""
    root, manifest, _ = locate(Path(folder), None)
    model = load_json_config(root).get("model")
    return tokenizer_folder(root, model.get("tokenizer_dir") if isinstance(model, dict) else None, manifest,
                            root / CONFIG_NAME)


def tokenizer_digest(path: Path) -> str:
    """sha256 of a ``tokenizer.json`` re-serialized with sorted keys (its formatting does not count): two files
    with one digest split every text into the same tokens."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackageError(f"{path}: not a readable tokenizer.json ({e})") from None
    canonical = json.dumps(data, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def tokenizer_reads(package: ModelPackage) -> Reads:
    """What :meth:`Tokenizer.load` reads: :func:`tokenizer_files`; tokenization is the ``tokenizers``
    library's and chat templates render with ``jinja2``."""
    f = tokenizer_files(package.tokenizer_root)
    return Reads("tokenizer", (f.tokenizer, f.config, f.template), {}, ("tokenizers", "jinja2"))


@dataclass(frozen=True)
class SpecialTokens:
    bos_id: int | None
    eos_id: int | None
    bos_text: str | None


class Tokenizer:
    """Encode/decode with a ``tokenizers.Tokenizer``. Build with :meth:`load`."""

    def __init__(self, backend, special: SpecialTokens, chat_template: str | None = None,
                 add_bos_token: bool | None = None, template_vars: dict[str, str] | None = None) -> None:
        self.backend = backend
        self.special = special
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.template_vars = template_vars  # the named special tokens the template sees (package/chat.py)

    @classmethod
    def load(cls, package: ModelPackage, add_bos_token: bool | None = None) -> Tokenizer:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise PackageError("the 'tokenizers' package is required: pip install tokenizers") from None
        files = tokenizer_files(package.tokenizer_root)
        path = files.tokenizer
        if not path.is_file():
            raise PackageError(f"{path}: not found; ortevals needs the package's tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise PackageError(f"{path}: not a valid tokenizers file ({e})") from None
        cfg = _read_json(files.config)
        special = _special_tokens(backend, cfg, package)
        template = choose_template(cfg.get("chat_template"),  # transformers: the file wins over the config
                                   files.template.read_text(encoding="utf-8") if files.template.is_file() else None)
        _check_vocab(backend, package, path)
        return cls(backend, special, template, add_bos_token, special_token_vars(cfg))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """lm-eval ``hf`` rules: None means the tokenizer's default unless text starts with BOS."""
        special = self._special(text, add_special_tokens)
        return self._bos(self.backend.encode(text, add_special_tokens=special).ids, special)

    def encode_many(self, texts: list[str], add_special_tokens: bool | None = None) -> list[list[int]]:
        """``[encode(t, add_special_tokens) for t in texts]``, the texts encoded by the library in batches
        (its threads; ids only, no offsets): the same ids, a fraction of the time on long prompts."""
        flags = [self._special(t, add_special_tokens) for t in texts]
        out: list[list[int]] = [[] for _ in texts]
        splittable = may_split(self.backend)
        for flag in set(flags):
            where = [i for i, f in enumerate(flags) if f == flag]
            # a text extending another of the batch (lm-eval's context + continuation) by its tail, where exact
            group = encode_extending([texts[i] for i in where], flag, self._batch,
                                     lambda t, f: self._batch(t, f, offsets=True), splittable)
            for i, ids in zip(where, group, strict=True):
                out[i] = self._bos(ids, flag)
        return out

    def _batch(self, texts: list[str], flag: bool, offsets: bool = False) -> list:
        """The library's batch encoder on every core: the texts in one contiguous slice a core, each slice on a
        thread of its own (the library releases the GIL; its own thread pool, which lm-eval's command line turns
        off with TOKENIZERS_PARALLELISM=false, is not relied on). The encodings in order (with offsets: slower)."""
        fast = None if offsets else getattr(self.backend, "encode_batch_fast", None)
        batch = fast or self.backend.encode_batch
        if not texts:
            return []
        slices = min(_cores(), len(texts) // MIN_SLICE)
        if slices < 2:
            return batch(texts, add_special_tokens=flag)
        bounds = [len(texts) * k // slices for k in range(slices + 1)]
        parts = _pool().map(lambda a, b: batch(texts[a:b], add_special_tokens=flag), bounds[:-1], bounds[1:])
        return [enc for part in parts for enc in part]

    def _special(self, text: str, add_special_tokens: bool | None) -> bool:
        if add_special_tokens is not None:
            return add_special_tokens
        if self.special.bos_text and text.startswith(self.special.bos_text):
            return False
        return True if self.add_bos_token is None else self.add_bos_token

    def _bos(self, ids: list[int], special: bool) -> list[int]:
        if special and self.add_bos_token and self.special.bos_id is not None \
                and (not ids or ids[0] != self.special.bos_id):
            return [self.special.bos_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The chat template rendered as transformers' ``apply_chat_template(tokenize=False)`` renders it
        (package/chat.py); a template that refuses the conversation raises :class:`ChatTemplateError`."""
        if not self.chat_template:
            raise PackageError("the package ships no chat template (tokenizer_config.json chat_template or "
                               "chat_template.jinja); run without --apply_chat_template")
        variables = self.template_vars
        if variables is None:  # built by hand: the BOS/EOS text only
            ids = {"bos_token": self.special.bos_id, "eos_token": self.special.eos_id}
            variables = {k: self.decode([i]) for k, i in ids.items() if i is not None}
        return render(self.chat_template, messages, add_generation_prompt, continue_final_message, variables)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PackageError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(backend, cfg: dict[str, Any], package: ModelPackage) -> SpecialTokens:
    bos_text = _token_text(cfg.get("bos_token"))
    eos_text = _token_text(cfg.get("eos_token"))
    bos_id = backend.token_to_id(bos_text) if bos_text else None
    eos_id = backend.token_to_id(eos_text) if eos_text else None
    if bos_id is None and package.bos_token_id is not None and bos_text is None:
        bos_id = package.bos_token_id
        bos_text = backend.id_to_token(bos_id)
    if eos_id is None and package.eos_token_ids:
        eos_id = package.eos_token_ids[0]
    return SpecialTokens(bos_id, eos_id, bos_text)


def _check_vocab(backend, package: ModelPackage, path: Path) -> None:
    """A tokenizer with ids beyond the model's logits would score garbage."""
    size = backend.get_vocab_size(with_added_tokens=True)
    if size > package.vocab_size:
        raise PackageError(
            f"{path}: tokenizer has {size} tokens but the model's vocab_size is {package.vocab_size}; "
            "the tokenizer does not belong to this model"
        )
