"""``genai_config.json``: reading it and its scalar fields, each error one line naming the field.

Owns the file's own problems (missing, empty, not JSON, no ``model`` object; then, once ortevals' own
checks pass, a config onnxruntime-genai refuses: :func:`check_og_accepts`), typed fields
(``model.vocab_size``, token ids, ``context_length``) and model file names resolved inside the
package folder. :mod:`ortevals.package.loader` builds the package from what this returns.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ortevals.errors import PackageError
from ortevals.package.og_config import og_refusal

CONFIG_NAME = "genai_config.json"


def resolve_inside(root: Path, name: object, field_name: str) -> Path:
    """Resolve ``name`` (a config string) under ``root``; refuse anything outside it."""
    if not isinstance(name, str) or not name.strip():
        raise PackageError(f"{root / CONFIG_NAME}: field {field_name} must be a non-empty file name, got {name!r}")
    candidate = Path(name)
    if candidate.is_absolute():
        raise PackageError(
            f"{root / CONFIG_NAME}: field {field_name}={name!r} is an absolute path; "
            "expected a file name inside the package folder"
        )
    # lexical check: symlinks the user placed (a hub cache's blobs) are theirs to make
    resolved = Path(os.path.normpath(os.path.abspath(root / candidate)))
    if not resolved.is_relative_to(Path(os.path.abspath(root))):
        raise PackageError(
            f"{root / CONFIG_NAME}: field {field_name}={name!r} escapes the package folder {root}; "
            "expected a file inside it"
        )
    return resolved


WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")  # what a transformers checkpoint folder holds


def _not_a_package_hint(root: Path) -> str:
    """What the folder is instead, where that is plain: a transformers checkpoint (to export with the builder),
    or a folder with a package one level down (Olive's output)."""
    if (root / "config.json").is_file() and any(next(root.glob(p), None) for p in WEIGHTS):
        return (f"; {root} is a transformers checkpoint (config.json + weights): export it first with "
                f"`python -m onnxruntime_genai.models.builder -i {root} -o OUT -p int4 -e cpu` (or Olive), then "
                "pass --pkg OUT")
    inner = sorted(p.parent for p in root.glob(f"*/{CONFIG_NAME}"))
    return f"; {inner[0]} holds one: pass --pkg {inner[0]}" if inner else ""


def load_json_config(root: Path) -> dict[str, Any]:
    """Read genai_config.json with a one-line error for every way it can be wrong."""
    cfg_path = root / CONFIG_NAME
    if not root.exists():
        raise PackageError(f"{root}: package folder not found; expected a folder holding {CONFIG_NAME}")
    if not root.is_dir():
        raise PackageError(f"{root}: is a file; expected the package folder holding {CONFIG_NAME}"
                           + (f" (give its folder: {root.parent})" if root.suffix in (".json", ".onnx") else ""))
    if not cfg_path.is_file():
        raise PackageError(f"{cfg_path}: not found; expected an ONNX Runtime GenAI package folder ({CONFIG_NAME} + "
                           "decoder .onnx), as written by Olive or the onnxruntime-genai model builder"
                           + _not_a_package_hint(root))
    text = cfg_path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise PackageError(f"{cfg_path}: file is empty; expected a JSON object with a 'model' section")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PackageError(f"{cfg_path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise PackageError(f"{cfg_path}: expected a JSON object with a 'model' object, got {type(data).__name__}")
    return data


def typed_field(section: dict, key: str, kind: type, where: Path, name: str):
    if key not in section:
        raise PackageError(f"{where}: field {name} is missing; expected {kind.__name__}")
    value = section[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise PackageError(f"{where}: field {name} must be {kind.__name__}, got {value!r}")
    return value


def optional_int(section: dict, key: str, where: Path) -> int | None:
    if section.get(key) is None:
        return None
    return typed_field(section, key, int, where, f"model.{key}")


def read_context_length(model: dict, where: Path) -> int:
    """``model.context_length``; 0 when absent (ortevals' default applies), never <= 0 when given."""
    value = optional_int(model, "context_length", where)
    if value is not None and value <= 0:
        raise PackageError(f"{where}: field model.context_length must be a positive int, got {value}")
    return value or 0


def read_token_ids(value: Any, where: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise PackageError(f"{where}: field model.eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(values)


def check_og_accepts(root: Path) -> None:
    """The config is one onnxruntime-genai accepts (its parser and model types, package/og_config.py); else one
    line with onnxruntime-genai's own reason. Run after ortevals' checks, whose messages name more."""
    cfg_path = root / CONFIG_NAME
    refusal = og_refusal(cfg_path.read_bytes())
    if refusal:
        raise PackageError(f"{cfg_path}: onnxruntime-genai refuses this config: {refusal}")
