#!/usr/bin/env python
"""A tiny Llama package for the kit's install check and the device probe, built where it runs (seconds).

    python scripts/gpu/tinypkg.py OUT --precision fp16 --ep cuda      # OUT/hf and OUT/pkg

Random weights (vocabulary 512, hidden 64, 2 layers, 4 query heads on 2 KV heads of 16, context 2,048),
a word-level tokenizer of 512 made-up tokens (the builder wants one; nothing here reads text), then
onnxruntime-genai's builder. A folder built with the same arguments is reused. torch, transformers,
tokenizers and onnxruntime-genai only; exits 2 with one line when the builder fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

VOCAB = 512


def build_hf(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<pad>").save_pretrained(out)


def build(out: Path, precision: str, ep: str) -> Path:
    """``out/pkg`` (built unless ``out/spec.json`` says the same precision and provider)."""
    spec = {"precision": precision, "ep": ep, "vocab": VOCAB}
    if (out / "spec.json").is_file() and json.loads((out / "spec.json").read_text()) == spec:
        return out / "pkg"
    shutil.rmtree(out, ignore_errors=True)
    build_hf(out / "hf")
    python = [sys.executable, *(["-S"] if sys.flags.no_site else [])]
    proc = subprocess.run([*python, "-m", "onnxruntime_genai.models.builder", "-i", str(out / "hf"), "-o",
                           str(out / "pkg"), "-p", precision, "-e", ep, "-c", str(out / "cache")],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not (out / "pkg" / "genai_config.json").is_file():
        tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
        raise SystemExit(f"error: the builder failed on the tiny model: {tail[0]}")
    (out / "spec.json").write_text(json.dumps(spec) + "\n")
    return out / "pkg"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--precision", choices=["fp32", "fp16"], default="fp16")
    ap.add_argument("--ep", choices=["cpu", "cuda"], default="cuda")
    args = ap.parse_args()
    print(build(args.out, args.precision, args.ep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
