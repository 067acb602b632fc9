"""The onnxruntime-genai 0.18 model builder, run with the one fix it needs on transformers 5 for Gemma 3.

transformers 5 reads Gemma 3's RoPE settings into a nested ``rope_parameters`` ({"full_attention": …,
"sliding_attention": …}); the builder's Gemma 3 path expects the flat form of transformers 4 (global
``rope_parameters`` / ``rope_theta`` plus ``rope_local_base_freq``) and fails with KeyError 'rope_type'.
The config is flattened right after loading; every other model passes through unchanged. Arguments are
the builder's own (``python builder_shim.py -i HF -o OUT -p fp32 -e cpu``).
"""

from __future__ import annotations

import runpy
import sys

import transformers

_load = transformers.AutoConfig.from_pretrained


def _flat_gemma3(*args, **kwargs):
    config = _load(*args, **kwargs)
    rope = getattr(config, "rope_parameters", None)
    if getattr(config, "model_type", "") == "gemma3_text" and isinstance(rope, dict) and "full_attention" in rope:
        config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
        config.rope_parameters = dict(rope["full_attention"])
    return config


if __name__ == "__main__":
    transformers.AutoConfig.from_pretrained = _flat_gemma3
    sys.argv = ["onnxruntime_genai.models.builder", *sys.argv[1:]]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
