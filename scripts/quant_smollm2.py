#!/usr/bin/env python
"""Where quantization hurts on SmolLM2-135M (issue 51): the numbers and plots of docs/quantization.md.

1. the packages: the example's fp32 and int4 (``ortevals example``), the KV scales calibrated on the fp32
   package by the builder's own tool (``kv_cache_calibration``, int8 per channel, its defaults: 24
   sequences of 512 tokens), and the fp32 and int4 packages rebuilt with
   ``kv_cache_quant_scheme=int8_per_channel`` (``--work``);
2. every scoring path of ortevals on both quantized-KV packages against one plain onnxruntime pass of the
   same package (``paths.json``);
3. ``ortevals fidelity --by-position`` at ``--ctx 4096``: int4 against fp32, fp32 + int8 KV against fp32
   (the fp32 reference saved once and reused), int4 + int8 KV against int4 (its float-KV twin): the
   printed reports, ``--json`` and ``--plot`` of each, and ``by-position.png`` with the three on shared axes;
4. ``ortevals mmlu-pro --limit 100`` on fp32, int4 and fp32 + int8 KV, then ``compare --by-length``
   (``mmlu-compare.txt``/``.json``);
5. ``ortevals mmlu-pro --cot --limit 30 --max-gen-toks 256`` on fp32 and int4, ``compare`` (the drift,
   ``cot-compare.txt``) and ``fidelity --trajectories`` on the fp32 run's chains (``trajectories.*``);
6. ``ortevals diagnose --int8`` on the int4 package (the builder's int8 export built too), ``--candidates 20
   --questions 0 --verify`` (``diagnose-int8.*``).

    python scripts/quant_smollm2.py --out docs/bench-quant --work bench-data/quant

About three hours on a shared 2-core machine (each by-position comparison reads 12 windows of 4096 tokens
with both models; diagnose measures 40 groups).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the paths check reuses the tests' requests and one-pass oracle
SCHEME = "int8_per_channel"
COMPARISONS = (  # (name, candidate, reference, --kl-threshold, label in the joint plot)
    ("int4_vs_fp32", "int4", "fp32", 0.25, "int4 weights vs fp32"),
    ("fp32kv8_vs_fp32", "fp32-kv8", "fp32.npz", 0.01, "int8 KV vs float KV (fp32 weights)"),
    ("int4kv8_vs_int4", "int4-kv8", "int4", 0.01, "int8 KV vs float KV (int4 weights)"),
)


def packages(work: Path) -> dict[str, Path]:
    from ortevals.package.examples import build_genai_package, smollm2_hf_dir, smollm2_package

    pkgs = {"fp32": smollm2_package("fp32"), "int4": smollm2_package("int4"), "hf": smollm2_hf_dir()}
    scales = work / f"kv_{SCHEME}.json"
    if not scales.is_file():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.quantization.kv_cache_calibration",
                        "--model", str(pkgs["fp32"]), "--tokenizer", str(pkgs["hf"]), "--out", str(scales),
                        "--quant-type", SCHEME], check=True)
    for precision in ("fp32", "int4"):
        out = work / f"smollm2-135m-instruct-{precision}-kv8"
        if not (out / "genai_config.json").is_file():
            build_genai_package(pkgs["hf"], out, precision, work / "builder-cache",
                                extra=[f"kv_cache_quant_scheme={SCHEME}", f"kv_cache_scale_file={scales}"])
        pkgs[f"{precision}-kv8"] = out
    return pkgs


def paths_check(pkgs: dict[str, Path]) -> list[dict]:
    """Every path's log-likelihoods on the quantized-KV packages against one plain onnxruntime pass."""
    import numpy as np

    from ortevals.integrations.lm import ModelArgs, OrtLM
    from tests.test_hybrid import PAIRS, requests
    from tests.test_kvquant import PATHS, one_pass_scores

    out = []
    for name in ("fp32-kv8", "int4-kv8"):
        for path, kw in PATHS.items():
            lm = OrtLM.from_package(ModelArgs(pkg=str(pkgs[name]), max_length=2048, **kw))
            ours = np.array([lp for lp, _ in lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)])
            plain = np.array(one_pass_scores(lm, pkgs[name]))
            out.append({"package": name, "path": path, "requests": len(PAIRS),
                        "max_abs_diff": float(np.abs(ours - plain).max()), "mode": lm.run.stats.get("mode")})
            print(f"{name} {path}: max |ours - one pass| {out[-1]['max_abs_diff']:.2e}", file=sys.stderr)
    return out


def cli(*args: str, log: Path) -> None:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ortevals.cli", *args], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"ortevals {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    log.write_text(proc.stdout)
    print(f"[{time.perf_counter() - start:.0f} s] ortevals {args[0]} -> {log.name}", file=sys.stderr)


def runs_and_drift(pkgs: dict[str, Path], out: Path, work: Path) -> None:
    """Steps 4 and 5 of the module docstring."""
    tok = str(pkgs["fp32"])
    for name in ("fp32", "int4", "fp32-kv8"):
        cli("mmlu-pro", "--pkg", str(pkgs[name]), "--data", "bundled", "--limit", "100", "--output",
            str(work / "runs" / name), log=work / f"mmlu-{name}.txt")
    cli("compare", "--ref", str(work / "runs" / "fp32"), str(work / "runs" / "int4"), str(work / "runs" / "fp32-kv8"),
        "--by-length", "--tokenizer", tok, "--length-buckets", "1024,1536,2048", "--kl-threshold", "0.1",
        "--json", str(out / "mmlu-compare.json"), log=out / "mmlu-compare.txt")
    for name in ("fp32", "int4"):
        cli("mmlu-pro", "--cot", "--pkg", str(pkgs[name]), "--data", "bundled", "--limit", "30", "--max-gen-toks",
            "256", "--output", str(work / "runs-cot" / name), log=work / f"cot-{name}.txt")
    cli("compare", "--ref", str(work / "runs-cot" / "fp32"), str(work / "runs-cot" / "int4"), "--tokenizer", tok,
        "--json", str(out / "cot-compare.json"), log=out / "cot-compare.txt")
    cli("fidelity", "--pkg", str(pkgs["int4"]), "--ref", str(pkgs["fp32"]), "--trajectories",
        str(work / "runs-cot" / "fp32"), "--first", "256", "--kl-threshold", "0.25", "--json",
        str(out / "trajectories.json"), "--plot", str(out / "trajectories.png"), log=out / "trajectories.txt")


def diagnose_int8(pkgs: dict[str, Path], out: Path, work: Path) -> None:
    """Step 6 of the module docstring."""
    import shutil

    from ortevals.package.examples import smollm2_package

    cli("diagnose", "--pkg", str(pkgs["int4"]), "--ref", str(pkgs["fp32"]), "--int8", str(smollm2_package("int8")),
        "--checkpoint", str(pkgs["hf"]), "--candidates", "20", "--questions", "0", "--verify", "--output",
        str(work / "diagnose-int8"), log=out / "diagnose-int8.txt")
    for ext in ("json", "png"):
        shutil.copy(work / "diagnose-int8" / f"diagnose.{ext}", out / f"diagnose-int8.{ext}")


def fidelity(name: str, cand: Path, ref: Path, threshold: float, out: Path, tokens: int, save: Path | None) -> dict:
    args = ["fidelity", "--pkg", str(cand), "--ref", str(ref), "--by-position", "--kl-threshold", str(threshold),
            "--json", str(out / f"{name}.json"), "--plot", str(out / f"{name}.png")]
    if ref.suffix != ".npz":
        args += ["--ctx", "4096", "--tokens", str(tokens)]
    if save is not None:
        args += ["--save-ref", str(save)]
    cli(*args, log=out / f"{name}.txt")
    return json.loads((out / f"{name}.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench-quant")
    ap.add_argument("--work", type=Path, default=REPO / "bench-data" / "quant")
    ap.add_argument("--tokens", type=int, default=12 * 4095, help="scored tokens per comparison (12 windows)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    pkgs = packages(a.work)
    (a.out / "paths.json").write_text(json.dumps(paths_check(pkgs), indent=1) + "\n")
    refs = {"fp32.npz": a.work / "fp32.npz"}
    summaries = []
    for name, cand, ref, threshold, label in COMPARISONS:
        reference = refs.get(ref, pkgs.get(ref))
        save = a.work / "fp32.npz" if name == "int4_vs_fp32" else None
        summaries.append((label, fidelity(name, pkgs[cand], reference, threshold, a.out, a.tokens, save)))
    from ortevals.fidelity.plot import positions_png

    (a.out / "by-position.png").write_bytes(positions_png(summaries))
    runs_and_drift(pkgs, a.out, a.work)
    diagnose_int8(pkgs, a.out, a.work)


if __name__ == "__main__":
    main()
