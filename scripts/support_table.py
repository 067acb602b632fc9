# ruff: noqa: E501  (markdown table rows)
"""Write docs/support.md (and docs/support.json) from the parity matrix's results.

The matrix (tests/test_matrix.py) records every architecture × precision × path it ran in ``results.json``
beside its fixtures (``.fixture-cache/matrix/``, or ``$ORTEVALS_TEST_CACHE/matrix/``). Run it whole, then
this script::

    ORTEVALS_MATRIX=full python -m pytest -q tests/test_matrix.py
    python scripts/support_table.py            # or: --results PATH

docs/support.json keeps the results the page was made from (rounded), so tests/test_support_table.py can
check that the page is this script's rendering of them and that every architecture of the matrix is in it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATHS = (("default", "default"), ("exact", "`--exact`"), ("no_prefix_cache", "`prefix_cache=false`"),
         ("incremental", "`path=incremental`"), ("shared_batch", "`shared_prefix_batch=on`"),
         ("gen_raw", "greedy, raw"), ("gen_og", "greedy, `gen_path=og`"))
PRECISIONS = ("fp32", "int4")

INTRO = """# Supported architectures

Every text architecture that onnxruntime-genai's model builder exports, and those users run from the Mobius
exporter (`pip install mobius-onnx`; `python -m mobius build --runtime ort-genai`), checked by ortevals' parity
matrix: a tiny random checkpoint of each (hidden size 64, 2 to 5 layers, shaped to exercise the architecture's own
features), exported fp32 and int4 by the builder or fp32 by Mobius (it has no int4; its `--ep cpu` graphs use
GroupQueryAttention, its `--ep default` ones the standard `Attention` and `RotaryEmbedding` ops), scored on real
MMLU-Pro 5-shot prompts (about 700 tokens, all sharing the five-shot header) on each scoring path, and decoded
greedily. Gemma 4 E2B/E4B (per-layer embeddings, layers sharing KV) is also checked as Mobius' multimodal export
(embedding, vision and decoder models) on the first five MMLU-Pro questions and on image requests
(tests/test_gemma4_e2b.py).

- **fp32** is compared with transformers on the same weights (lm-eval's `hf` backend).
- **int4** is compared with the same package run in one plain onnxruntime pass per input (quantization
  changes the numbers; ortevals must not change them again).
- Greedy generation (fp32) is compared with transformers' `generate_until` text.

| mark | meaning |
|---|---|
| ✓ | equal: max \\|Δ log-likelihood\\| ≤ {tol} nats against the reference (the number shown) |
| ≈ | within the stated tolerance: the package itself differs from transformers (the exporter's deviation, \
below); ortevals equals the package run in one pass (max \\|Δ\\| shown) |
| ✗ *n* | refused in one line: reason *n* below |
| ! *n* | fails with an error instead of a one-line refusal (being fixed): error *n* below |
| ✗✗ | differs: a wrong number (none should be listed) |
| · | not run |
| ↺ *n* | `shared_prefix_batch=on` (checked with `check=false`, so that the invariance canary cannot hide a wrong graph): the questions under the five-shot header ran one a pass instead, for reason *n* below; a mark without ↺ ran them many a pass, within 1e-5 + 1e-6·\\|log-likelihood\\| of one pass |
"""


def _mark(cell: dict | None, refusals: dict[str, int], fallbacks: dict[str, int] | None = None) -> str:
    if not cell:
        return "·"
    shared = cell.get("shared", "")
    if fallbacks is not None and shared.startswith("one input a pass: "):
        n = fallbacks.setdefault(shared.removeprefix("one input a pass: "), len(fallbacks) + 1)
        return f"{_mark(cell, refusals)} ↺ {n}"
    status = cell["status"]
    if status in ("refused", "error"):
        mark = "✗" if status == "refused" else "!"
        return f"{mark} {refusals.setdefault(cell['reason'], len(refusals) + 1)}"
    if "max_abs" in cell:
        shown = _short(cell["max_abs"])
    else:
        shown = f"{cell.get('texts_equal', 0)}/{cell.get('texts', 0)} texts"
    return {"equal": "✓", "tolerance": "≈", "differs": "✗✗"}[status] + f" {shown}"


def _short(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e")


def _exporter(entry: dict) -> str:
    return entry.get("exporter") or "builder"


def _by_title(archs: dict) -> list[dict]:
    return sorted(archs.values(), key=lambda e: (e["title"].lower(), _exporter(e) != "builder", _exporter(e)))


def _rows(archs: dict, refusals: dict[str, int], fallbacks: dict[str, int]) -> list[str]:
    head = "| architecture | exporter | precision | " + " | ".join(title for _, title in PATHS) + " |"
    rows = [head, "|" + "---|" * (len(PATHS) + 3)]
    for entry in _by_title(archs):
        for precision in PRECISIONS:
            cells = entry.get("cells", {}).get(precision)
            if cells is None:
                continue
            marks = [_mark(cells.get(p), refusals, fallbacks) if precision == "fp32" or not p.startswith("gen")
                     else "" for p, _ in PATHS]
            rows.append(f"| {entry['title']} | {_exporter(entry)} | {precision} | " + " | ".join(marks) + " |")
    return rows


def _features(archs: dict) -> list[str]:
    lines = ["## What each checkpoint exercises", "",
             "| architecture | exporter | features | package vs transformers (fp32) |", "|---|---|---|---|"]
    for entry in _by_title(archs):
        gap = entry.get("package_gap", {}).get("fp32")
        note = "—" if gap is None else f"{gap:.1e}" + (f": {entry['deviation']}" if entry.get("deviation") else "")
        lines.append(f"| {entry['title']} | {_exporter(entry)} | {entry.get('features') or '—'} | {note} |")
    workarounds = [f"- **{e['title']}**: {e['workaround']}." for e in _by_title(archs) if e.get("workaround")]
    if workarounds:
        lines += ["", "Exported after a workaround for builder 0.18 on checkpoints saved by transformers 5:", "",
                  *workarounds]
    lines += ["", "Mobius 0.1.0 fails on Gemma 4 configs saved by transformers 5.24 (`AmbiguousGlobalPerLayerAttributeError: "
              "'head_dim'`); its Gemma 4 checkpoints here are exported with the flat head sizes it reads set on the "
              "config in its process (tests/fixtures/mobius.py), the checkpoint left as saved. For a multimodal Gemma 4 "
              "built from a local folder it writes `type: gemma4_text`, which onnxruntime-genai refuses: set "
              "`gemma4`."]
    return lines


PRECISIONS_AND_PROVIDERS = """## Precisions

| precision | status |
|---|---|
| fp32 | the matrix above: equal to transformers to 1e-4 in log-likelihood |
| int8, int4 (the builder's `MatMulNBits`) | the matrix above (int4), and SmolLM2 measured: [calibration.md](calibration.md), [compare.md](compare.md) |
| dynamic quantization (`quantize_dynamic`) | detected and scored in exact mode ([exactness.md](exactness.md)) |
| fp16, bf16 logits | scored in float32 (tests on hand-made graphs); a bf16 package is refused on CPU |

## Decoders that return the last position's logits only

NPU and static-shape exports and the builder's `prune_lm_head=true` compute the LM head on the last position alone.
ortevals reads how many rows a pass really returns from its first pass, whatever the graph declares:

| logits the graph declares | one pass returns | log-likelihoods |
|---|---|---|
| `[B, sequence_length, V]` or no shape | every position | the prefill path (default) |
| `[B, sequence_length, V]` or no shape | the last position | stepping, on the prefill path's sessions (`path=auto` or `prefill`) or on onnxruntime-genai (`path=incremental`) |
| `[B, 1, V]` (the builder's `prune_lm_head=true`) | the last position | stepping on onnxruntime-genai (the incremental path; `path=prefill` is refused) |

Stepping scores a continuation of k tokens in k passes on the held KV cache, each ending at the position that predicts
the next token (each pass runs the previous token again with the new one: two new tokens a pass at least, as on every
path). It equals the full-logit package built from the same weights to 1e-5 on one- and multi-token continuations
(tests/test_last_row.py), and costs about one pass per continuation token. The run's mode line (`mode` in
results.json) says `stepping (… only the last position's logits …)`.

## LoRA adapters

A package whose decoder takes its LoRA weights as optional inputs (the builder's `adapter_path=` export run through
Olive's `generate-adapter`) is scored with `--adapter FILE.onnx_adapter` ([adapters.md](adapters.md)):

| path | with an adapter |
|---|---|
| default (prefill, derived scoring graph), `--exact`, `shared_prefix_batch=on` | ✓ within 1e-5 a token of transformers + peft |
| `path=incremental` (onnxruntime-genai) | ✓ within 1e-5 a token of transformers + peft |
| greedy, raw and `gen_path=og` | ✓ the same tokens as transformers + peft |
| sampling on the cascade graph (`cascade=on`) | ✓ the same samples as `cascade=off` |
| image and audio requests (packages with vision or speech models) | ✗ refused in one line |

Checked on the tiny Llama (builder fp32 with a rank-4 adapter on every projection; tests/test_adapters.py). Several
`--adapter` flags score each adapter in turn over one loaded base, one result each; a package with adapter inputs
run without `--adapter` is the base model, said in one warning line.

## Execution providers

| provider | status |
|---|---|
| CPU | every test runs on it |
| CUDA | its kernels' contracts are tested on CPU with graphs that follow them; CUDA packages are built and checked on CPU; no GPU run is published ([cuda.md](cuda.md)) |
| DirectML, NPUs | accepted by name; untested. An NPU provider uses the incremental path |
| OpenVINO, WebGPU, TensorRT-RTX, QNN 2.x (plugin packages) | found from the installed package (`pip install onnxruntime-ep-openvino`, …), registered with onnxruntime and onnxruntime-genai, the devices it offers used, its version in the run's scope; one line without the package, or where it offers no device (the OpenVINO plugin 1.8.1 and the WebGPU plugin 0.4.0 offer none on an AMD EPYC CPU), before any work on every path; not yet scored on a device by ortevals (see OpenVINO below) |
| TensorRT | refused until measured |

**OpenVINO** (`--ep openvino`, the plugin package `onnxruntime-ep-openvino`). What was seen, by CPU:

- AMD EPYC (the machine these docs' tests run on): the plugin 1.8.1 registers and offers no device
  (`onnxruntime.get_ep_devices()` lists only `CPUExecutionProvider`), so `--ep openvino` is one line saying so; the
  test suite runs the no-device case there.
- Intel Xeon (an earlier machine of this project): the plugin 1.8.1 offers CPU devices (`OpenVINOExecutionProvider` and
  `OpenVINOExecutionProvider.AUTO`). ortevals hands a session the devices listed for `OpenVINOExecutionProvider`
  (`SessionOptions.add_provider_for_devices`: handed the provider's name instead, a session there lands on the CPU
  provider). No scores on OpenVINO have been measured by ortevals yet: on such a machine
  `tests/test_plugin_eps.py` scores the tiny fp32 package on OpenVINO and checks it within 1e-3 of the CPU provider
  (the device case; it is skipped, with the reason, where no device is offered).

OpenVINO computes float32 graphs in bf16 (CPUs with AMX or AVX512-BF16) or f16 (GPUs) unless told otherwise; ortevals
gives it `load_config={"CPU":{"INFERENCE_PRECISION_HINT":"f32"},"GPU":{"INFERENCE_PRECISION_HINT":"f32"}}`, the
provider option the plugin reads the precision from (it ignores `precision`), so it computes in float32 as the CPU
provider does. The run's mode line says `inference precision CPU=f32, GPU=f32`, and results.json's
`provider_options` and the result store's scope hold the option. `--provider-option load_config=…` (or
`precision=…`) replaces it.
"""


def render(data: dict) -> str:
    refusals: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    table = _rows(data["archs"], refusals, fallbacks)
    lines = [INTRO.format(tol=_short(data["tolerance"])), *table, "", "## Refusals and errors", "",
             "Each reason as ortevals, the builder or transformers gives it, in one line:", ""]
    lines += [f"{n}. {reason}" for reason, n in refusals.items()] or ["None."]
    lines += ["", "## One question a pass under `shared_prefix_batch=on`", "",
              "Why a package's questions under a shared prefix ran one a pass (the numbers as in the default path):",
              ""]
    lines += [f"{n}. {reason}" for reason, n in fallbacks.items()] or ["None."]
    lines += ["", *_features(data["archs"]), "", *PRECISIONS_AND_PROVIDERS.splitlines(), "", "## Versions", "",
              ", ".join(f"{lib} {v}" for lib, v in data["versions"].items()) + ".", "",
              "Generated by `scripts/support_table.py` from the parity matrix (`tests/test_matrix.py`).", ""]
    return "\n".join(lines)


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.2e}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def main(argv: list[str] | None = None) -> int:
    cache = Path(os.environ.get("ORTEVALS_TEST_CACHE") or REPO / ".fixture-cache")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=cache / "matrix" / "results.json")
    parser.add_argument("--docs", type=Path, default=REPO / "docs")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        print(f"--results: {args.results} not found; run the matrix first (tests/test_matrix.py)", file=sys.stderr)
        return 2
    data = _rounded(json.loads(args.results.read_text()))
    (args.docs / "support.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    (args.docs / "support.md").write_text(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
