#!/usr/bin/env python
"""A random-weight model of a real, current architecture, built where it runs: nothing large travels.

    python scripts/gpu/make_model.py --arch qwen3 --params 1.5e9 --precision fp16 --ep cuda OUT
    python scripts/gpu/make_model.py --arch llama --params 2e6 --precision fp32 --ep cpu --check OUT

``--precision fp32 --ep cuda`` is refused (:data:`FP32_CUDA`): the builder's fp32 CUDA package is invalid.

Writes under OUT:
* ``hf/``: a transformers checkpoint (config shaped like the real model, random weights from ``--seed``,
  saved in float32) and its tokenizer: a byte-level BPE trained here in seconds on the MMLU-Pro text
  bundled with ortevals (``--tokenizer DIR`` uses another one, e.g. SmolLM2's);
* ``<precision>-<ep>/``: the onnxruntime-genai builder's package of the same weights;
* ``make_model.json`` in each: the spec it was built from (a folder with the same spec is reused).

Shapes (layer widths, heads, vocabulary, RoPE) are the real models' (``ARCHS``); ``--params`` sets the
number of layers. Below one real-width layer the widths are halved until it fits and the vocabulary is the
tokenizer's, so tiny CPU models build in seconds. ``--check`` compares the package's log-softmax with
PyTorch's on the same weights (all positions of a few texts, through onnxruntime-genai) and fails above
``--tolerance`` (default 1e-4, fp32).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
# onnxruntime-genai 0.18's builder (-p fp32 -e cuda) uses Attention without present outputs but declares
# present.* as graph outputs: onnxruntime refuses the file ("Graph output (present.0.key) does not exist
# in the graph"). An fp32 package is built for the CPU; on CUDA it runs only if every node has a CUDA kernel.
FP32_CUDA = ("the builder writes an fp32 CUDA package onnxruntime cannot load (its present.* outputs are "
             "produced by no node); build fp32 with --ep cpu (ortevals runs it on CUDA only where every node has "
             "a CUDA kernel), or use --precision fp16/bf16 for CUDA")
BOS = {"qwen3": False, "qwen3-0.6b": False, "gemma3": True, "llama": True, "smollm2": False}
ARCHS = {  # the real models' configs (Qwen3-1.7B, Qwen3-0.6B, Gemma-3-1B, Llama-3.2-1B, SmolLM2-135M)
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=1152,
                   intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, query_pre_attn_scalar=256, vocab_size=262144, max_position_embeddings=32768,
                   sliding_window=512, rope_theta=1e6, rope_local_base_freq=1e4, rms_norm_eps=1e-6,
                   tie_word_embeddings=True),
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                  vocab_size=128256, max_position_embeddings=131072, rope_theta=5e5, rms_norm_eps=1e-5,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                  tie_word_embeddings=True),
    "smollm2": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    vocab_size=49152, max_position_embeddings=8192, rope_theta=1e5, rms_norm_eps=1e-5,
                    tie_word_embeddings=True),
}


def count_params(c: dict) -> tuple[int, int]:
    """(embedding + final norm parameters, parameters per layer) of a config dict."""
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    attn = h * d * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    norms = h * (4 if c["model_type"] == "gemma3_text" else 2) + (2 * d if c["model_type"] != "llama" else 0)
    emb = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2) + h
    return emb, attn + 3 * h * inter + norms


def size_config(arch: str, params: float, tokenizer_vocab: int) -> dict:
    """The real config with as many layers as ``params`` allows; halved widths when not even one layer fits."""
    c = json.loads(json.dumps(ARCHS[arch]))
    emb, layer = count_params(c)
    if params < emb + layer:  # tiny: the tokenizer's vocabulary, widths halved until two layers fit
        c.update(vocab_size=tokenizer_vocab, max_position_embeddings=min(c["max_position_embeddings"], 4096))
        c.pop("rope_scaling", None)
        while c["hidden_size"] > 64 and params < sum(count_params(c)) + count_params(c)[1]:
            heads = max(2, c["num_attention_heads"] // 2)
            kv = max(1, min(c["num_key_value_heads"] // 2, heads))
            c.update(hidden_size=max(64, c["hidden_size"] // 2), head_dim=max(16, c["head_dim"] // 2),
                     intermediate_size=max(128, c["intermediate_size"] // 2),
                     num_attention_heads=heads - heads % kv, num_key_value_heads=kv)
        if "query_pre_attn_scalar" in c:
            c["query_pre_attn_scalar"] = c["head_dim"]
        emb, layer = count_params(c)
    layers = c["num_hidden_layers"] = max(1 if params >= emb + layer else 2, round((params - emb) / layer))
    if arch == "gemma3":  # five sliding-window layers, then one global; at least one global layer
        period = min(6, layers)
        c["layer_types"] = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
    return c


def train_tokenizer(out: Path, bos: bool, vocab: int = 32768) -> None:
    """Byte-level BPE on the bundled MMLU-Pro text (questions, options, worked answers); seconds."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    data = REPO / "ortevals" / "data" / "mmlu_pro" / "data"
    texts = []
    for f in sorted(data.glob("*.parquet")):
        t = pq.read_table(f, columns=["question", "options", "cot_content"]).to_pylist()
        texts += [r["question"] + "\n" + "\n".join(r["options"]) + "\n" + (r["cot_content"] or "") for r in t]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|bos|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                           special_tokens=[("<|bos|>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.save_pretrained(out)


def build_hf(spec: dict, out: Path) -> dict:
    """Random weights for the spec's config, saved with the tokenizer; returns the config written."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if spec["tokenizer"] == "trained":
        train_tokenizer(tmp, BOS[spec["arch"]])
    else:
        AutoTokenizer.from_pretrained(spec["tokenizer"]).save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(tmp)
    c = size_config(spec["arch"], spec["params"], len(tok))
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(**{k: v for k, v in c.items() if k != "architectures"}, **ids)
    config.architectures = c["architectures"]
    torch.manual_seed(spec["seed"])
    device = spec["init_device"]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.to("cpu").save_pretrained(tmp)
    c["params"] = sum(p.numel() for p in model.parameters())
    (tmp / "make_model.json").write_text(json.dumps(spec, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return c


def build_package(hf: Path, out: Path, precision: str, ep: str, extra: list[str], spec: dict) -> None:
    """The onnxruntime-genai builder on ``hf`` into ``out`` (a temp folder renamed at the end)."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    python = [sys.executable, *(["-S"] if sys.flags.no_site else [])]  # the builder sees what we see
    cmd = [*python, str(Path(__file__).with_name("builder_shim.py")), "-i", str(hf), "-o", str(tmp),
           "-p", precision, "-e", ep, "-c", str(out.parent / "builder-cache")]
    cmd += ["--extra_options", *extra] if extra else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
        raise SystemExit(f"error: the builder failed on {hf}: {tail[0]}")
    (tmp / "make_model.json").write_text(json.dumps(spec, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def check(hf: Path, pkg: Path, max_tokens: int = 700) -> float:
    """Max |log-softmax(package) - log-softmax(PyTorch)| over every position of three texts (one of about
    ``max_tokens`` tokens, past a sliding window of 512); the package runs through onnxruntime-genai."""
    import numpy as np
    import onnxruntime_genai as og
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    rows = pq.read_table(next((REPO / "ortevals/data/mmlu_pro/data").glob("validation-*.parquet"))).to_pylist()
    long_text = "\n\n".join(r["question"] + "\n" + r["cot_content"] for r in rows[:12])
    texts = ["The capital of France is Paris.", rows[0]["question"], long_text]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    og_model = og.Model(str(pkg))
    context = json.loads((pkg / "genai_config.json").read_text())["model"]["context_length"]
    worst = 0.0
    for text in texts:
        ids = tok(text)["input_ids"][:max_tokens]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
        params = og.GeneratorParams(og_model)
        params.set_search_options(max_length=context)  # a windowed cache needs at least the window
        gen = og.Generator(og_model, params)
        gen.append_tokens(np.array([ids], dtype=np.int32))
        logits = np.asarray(gen.get_output("logits"), dtype=np.float64)[0]
        got = logits - logits.max(-1, keepdims=True)
        got -= np.log(np.exp(got).sum(-1, keepdims=True))
        worst = max(worst, float(np.abs(got - ref[: len(got)]).max()))
    return worst


def code_key(*dists: str) -> dict:
    """What else decides the weights (or the graph): this code and the versions of ``dists``."""
    from importlib import metadata

    h = hashlib.sha256()
    for name in ("make_model.py", "builder_shim.py"):
        h.update(Path(__file__).with_name(name).read_bytes())
    versions = {}
    for dist in dists:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return {"code_sha256": h.hexdigest()[:16], "versions": versions}


def same_spec(folder: Path, spec: dict, marker: str) -> bool:
    path = folder / "make_model.json"
    return (folder / marker).is_file() and path.is_file() and json.loads(path.read_text()) == spec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", choices=sorted(ARCHS), required=True)
    ap.add_argument("--params", type=float, required=True, help="parameter count to size the model to, e.g. 1.5e9")
    ap.add_argument("--precision", choices=["fp32", "fp16", "bf16", "int8", "int4"], default="fp16")
    ap.add_argument("--ep", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default="trained", help="'trained' (BPE on the bundled MMLU-Pro) or an HF folder")
    ap.add_argument("--init-device", default="auto", help="where the random weights are drawn (auto: cuda if any)")
    ap.add_argument("--extra-options", nargs="*", default=[], help="builder --extra_options KEY=VALUE …")
    ap.add_argument("--hf-only", action="store_true", help="only the transformers checkpoint (no onnxruntime-genai)")
    ap.add_argument("--check", action="store_true", help="compare the package's log-softmax with PyTorch's")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args(argv)
    if args.precision == "fp32" and args.ep == "cuda" and not args.hf_only:
        print(f"error: --precision fp32 --ep cuda: {FP32_CUDA}", file=sys.stderr)
        return 2
    if args.params <= 0:
        print(f"error: --params must be positive, got {args.params}", file=sys.stderr)
        return 2
    if args.tokenizer != "trained" and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        print(f"error: --tokenizer {args.tokenizer}: no tokenizer.json there (or use 'trained')", file=sys.stderr)
        return 2
    import torch

    device = args.init_device if args.init_device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    spec = {"arch": args.arch, "params": args.params, "seed": args.seed, "tokenizer": args.tokenizer,
            "init_device": device, **code_key("torch", "transformers", "tokenizers")}
    hf, report = args.out / "hf", {"spec": spec}
    t0 = time.perf_counter()
    if not same_spec(hf, spec, "config.json"):
        build_hf(spec, hf)
        report["hf_s"] = round(time.perf_counter() - t0, 1)
    config = json.loads((hf / "config.json").read_text())
    report["config"] = {k: config.get(k) for k in ("architectures", "hidden_size", "intermediate_size",
                                                   "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                   "head_dim", "vocab_size", "sliding_window")}
    report["hf_bytes"] = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    if not args.hf_only:
        pkg = args.out / f"{args.precision}-{args.ep}"
        pspec = {**spec, "precision": args.precision, "ep": args.ep, "extra_options": args.extra_options,
                 "builder": code_key("onnxruntime-genai", "onnxruntime-genai-cuda", "onnxruntime", "onnxruntime-gpu")}
        t0 = time.perf_counter()
        if not same_spec(pkg, pspec, "genai_config.json"):
            build_package(hf, pkg, args.precision, args.ep, args.extra_options, pspec)
            report["package_s"] = round(time.perf_counter() - t0, 1)
        report["package"] = str(pkg)
        report["package_bytes"] = sum(p.stat().st_size for p in pkg.iterdir() if p.is_file())
        if args.check:
            report["max_abs_dlogprob"] = check(hf, pkg)
    print(json.dumps(report))
    if args.check and not args.hf_only and report["max_abs_dlogprob"] > args.tolerance:
        print(f"error: {pkg}: log-softmax differs from PyTorch's by {report['max_abs_dlogprob']:.2e} "
              f"(tolerance {args.tolerance:g})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
