#!/usr/bin/env python
"""``ortevals diagnose`` on the SmolLM2-135M int4 package against its fp32 package, and the checks of issue 41.

1. ``ortevals diagnose --pkg int4 --ref fp32 --checkpoint HF --verify`` (default text, budget +10%): its printed
   report (``diagnose.txt``), ``diagnose.json`` and ``diagnose.png``;
2. the builder's own exports with one group in ``nodes_to_exclude`` (the sensitivity stage's best single group,
   and the tied embeddings, whose swap copies the reference's Transpose + Gather), and the verified
   recommendation, each measured by ``ortevals fidelity --ref FP32`` on the same text and tokens: the KL
   diagnose predicted beside the one measured, with its standard error (``checks.json``);
3. where the KL lives (``sets.json``): the embeddings, the LM head, both, every attention projection, every
   MLP projection and every layer group put back at fp32 together, each measured against the same reference;
4. with ``--all-groups``, the same diagnose with every weight group tried (``--candidates 200``, token KL only):
   ``all-groups.txt`` / ``all-groups.json``.

Small results go to ``--out``; packages, the saved reference and the builder's exports to ``--work``.

    python scripts/diagnose_smollm2.py --out docs/bench-diagnose --all-groups
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, log: Path | None = None) -> str:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ortevals.cli", *args], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"ortevals {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    if log is not None:
        log.write_text(proc.stdout)
    print(f"[{time.perf_counter() - start:.0f} s] ortevals {args[0]}", file=sys.stderr)
    return proc.stdout


def diagnose(int4: Path, fp32: Path, hf: Path, work: Path, out: Path, name: str, *extra: str) -> dict:
    cli("diagnose", "--pkg", str(int4), "--ref", str(fp32), "--checkpoint", str(hf), "--output", str(work / name),
        *extra, log=out / f"{name}.txt")
    shutil.copy(work / name / "diagnose.json", out / f"{name}.json")
    shutil.copy(work / name / "diagnose.png", out / f"{name}.png")
    return json.loads((out / f"{name}.json").read_text())


def check(label: str, pkg: Path, nodes: list[str], predicted: float, fp32: Path, tokens: int, work: Path) -> dict:
    out = work / f"fidelity-{label}.json"
    cli("fidelity", "--pkg", str(pkg), "--ref", str(fp32), "--tokens", str(tokens), "--json", str(out))
    kl = json.loads(out.read_text())["kl"]
    return {"group": label, "nodes": nodes, "predicted_kl": predicted, "fidelity_kl": kl["mean"],
            "fidelity_se": kl["se"], "within_ci": abs(predicted - kl["mean"]) <= 1.96 * kl["se"]}


def checks(s: dict, paths: dict, work: Path) -> list[dict]:
    """The builder's exports with a group excluded, measured by ortevals fidelity, beside diagnose's prediction."""
    from ortevals.package.examples import build_genai_package

    reference = work / "diagnose" / "reference.npz"
    best = max(s["sensitivity"]["groups"], key=lambda g: g["recovered"])
    rows = []
    for label, nodes, predicted in ((best["label"], best["nodes"], best["kl"]),
                                    ("embeddings", ["/model/embed_tokens/Gather"], None)):
        built = work / f"excluded-{label}"
        if not (built / "genai_config.json").is_file():
            build_genai_package(paths["hf"], built, "int4", work / "builder-cache",
                                extra=[f"nodes_to_exclude={','.join(nodes)}"])
        if predicted is None:  # over the budget, so not measured by the run: the same swap, measured here
            predicted = swap_kl(paths, tuple(nodes), reference)
        rows.append(check(label, built, nodes, predicted, paths["fp32"], s["text"]["tokens_scored"], work))
    rec, v = s["recommendation"], s["verify"]
    if rec and v:
        row = check("recommended", work / "diagnose" / "recommended", rec["nodes"], rec["kl"], paths["fp32"],
                    s["text"]["tokens_scored"], work)
        rows.append({**row, "size_percent": v["size_percent"], "recovered_share": v["recovered_share"]})
    return rows


def swap_kl(paths: dict, nodes: tuple[str, ...], reference: Path) -> float:
    from ortevals.diagnose.measure import token_kl
    from ortevals.files import cache_root
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.swap import swapped_package

    swap = swapped_package(ModelPackage.load(paths["int4"]), ModelPackage.load(paths["fp32"]), nodes, cache_root())
    return token_kl(swap, reference, None).kl


def sets(paths: dict, reference: Path) -> dict:
    """Groups put back at fp32 together, each measured against the run's reference."""
    from ortevals.diagnose.inputs import decoder_graph
    from ortevals.diagnose.measure import token_kl
    from ortevals.diagnose.sensitivity import Bench
    from ortevals.files import cache_root
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.roles import weight_units
    from ortevals.runtime.swap import size_delta

    cand, ref = ModelPackage.load(paths["int4"]), ModelPackage.load(paths["fp32"])
    base = token_kl(cand.root, reference, None)
    bench = Bench(cand, ref, base, reference, cache_root(), None, lambda line: print(line, file=sys.stderr))
    units = weight_units(decoder_graph(cand))
    chosen = {"embeddings": ["embeddings"], "lm_head": ["lm_head"], "embeddings+lm_head": ["embeddings", "lm_head"],
              "every attention projection": [u for u in units if u.endswith((".qkv", ".o"))],
              "every MLP projection": [u for u in units if u.endswith((".gate_up", ".down"))],
              "every layer group": [u for u in units if u.startswith("layers.")]}
    rows = []
    for label, names in chosen.items():
        us = tuple(units[n] for n in names)
        c = bench.measure(label, us, size_delta(cand, ref, tuple(n for u in us for n in u.nodes)))
        rows.append({"set": label, "groups": len(us), "bytes_added": c.bytes_added,
                     "size_percent": 100 * c.bytes_added / sum(f.stat().st_size for f in cand.model_files()),
                     "kl": c.token.kl, "kl_se": c.token.kl_se, "recovered": c.recovered,
                     "recovered_se": c.recovered_se, "recovered_share": c.recovered / base.kl})
    return {"baseline_kl": base.kl, "sets": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "bench-diagnose")
    p.add_argument("--work", type=Path, default=None, help="default: <ortevals cache>/diagnose-smollm2")
    p.add_argument("--questions", type=int, default=50)
    p.add_argument("--all-groups", action="store_true")
    args = p.parse_args()
    from ortevals.files import cache_root
    from ortevals.package.examples import smollm2_hf_dir, smollm2_package

    paths = {"hf": smollm2_hf_dir(), "fp32": smollm2_package("fp32"), "int4": smollm2_package("int4")}
    out, work = args.out.resolve(), (args.work or cache_root() / "diagnose-smollm2").resolve()
    out.mkdir(parents=True, exist_ok=True)
    s = diagnose(paths["int4"], paths["fp32"], paths["hf"], work, out, "diagnose", "--verify",
                 "--questions", str(args.questions))
    rows = checks(s, paths, work)
    (out / "checks.json").write_text(json.dumps(rows, indent=2) + "\n")
    for r in rows:
        print(f"{r['group']:<16} predicted {r['predicted_kl']:.6f}  fidelity {r['fidelity_kl']:.6f} ± "
              f"{r['fidelity_se']:.6f}  within CI: {r['within_ci']}")
    (out / "sets.json").write_text(json.dumps(sets(paths, work / "diagnose" / "reference.npz"), indent=2) + "\n")
    if args.all_groups:
        diagnose(paths["int4"], paths["fp32"], paths["hf"], work, out, "all-groups", "--candidates", "200",
                 "--questions", "0")


if __name__ == "__main__":
    main()
