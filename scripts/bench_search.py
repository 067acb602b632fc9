"""Benchmark (issue 25 acceptance): selection and search against compute on chain-of-thought MMLU-Pro.

One invocation, SmolLM2-135M (the example package, fp32), one question per subject of the decoding
benchmark's 14-subject set (``--questions``), ``max_gen_toks`` M, stop "Question:":

1. K samples a question at temperature T (the raw shared-prompt path) with ``--verifier self``:
   maj@k, pass@k, best@k, bon@k, weighted_maj@k (P(True)), bon_certainty@k; the verifier's tokens and
   seconds against generation's, measured in the same run (results["verifier"]);
2. the same samples (reused from the run's result store: the verifier is not in its scope) judged by
   the tiny ORM fixture (``--orm``): bon@k and weighted_maj@k by a random reward model, a floor;
3. ``--search beam`` and ``--search particles`` (n = ``--search-n``) guided by P(True) step scores on
   the first ``--search-questions`` questions: one point each (generated tokens include pruned rows),
   with the decoder passes they ran against their decoding steps (a pass per row length a step: what an
   in-place ragged arena, one pass a step, would save).

Every curve against generated tokens per question and estimated FLOPs (report/compute.py's ``run_cost``:
2 · the package's parameters · tokens, plus the verifier's parameters · the tokens it ran per judged
sample), 95% bootstrap intervals over questions, Brown et al.'s coverage fit over pass@k. Writes
``OUT/bench.json`` and ``OUT/search.png``.

    python scripts/bench_search.py --out docs/bench-search
    python scripts/bench_search.py --questions 2 --samples 4 --max-gen-toks 32 --out /tmp/short
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def task_configs(questions: int, max_gen: int) -> list[dict]:
    from ortevals.presets import PRESETS, resolve_data, task_specs

    preset = PRESETS["mmlu-pro-cot"]
    configs = task_specs(preset, resolve_data(preset, "bundled"))[:questions]  # one question per subject
    for c in configs:
        c["generation_kwargs"] = {"until": ["Question:"], "max_gen_toks": max_gen, "do_sample": False}
    return configs


def run(pkg: Path, configs: list[dict], gen_kwargs: dict | None = None, **model_args) -> tuple[dict, dict, float]:
    """One ortevals evaluation: (results, the model's stats, wall seconds)."""
    from ortevals.evaluate import RunSpec, evaluate
    from ortevals.integrations.lm import ModelArgs, OrtLM

    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), truncate="left", **model_args))
    start = time.perf_counter()
    outcome = evaluate(lm, RunSpec(tasks=tuple(configs), limit=1, gen_kwargs=gen_kwargs))
    stats = {**lm.stats, "engine_tokens": lm.engine.tokens_run - lm.engine.canary_tokens}
    return outcome.results, stats, time.perf_counter() - start


def search_point(method: str, n: int, results: dict, stats: dict, cost):
    from ortevals.report.compute import search_point as point

    records = [r for rs in results["samples"].values() for r in rs]
    correct = [bool(r.get("exact_match")) for r in records]
    q = len(correct)
    return point(method, n, correct, [stats.get("search_tokens", 0) / q] * q, [stats["engine_tokens"] / q] * q, cost)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=14)
    p.add_argument("--search-questions", type=int, default=14)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-gen-toks", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--search-n", type=int, default=4)
    p.add_argument("--orm", type=Path, required=True, help="the tiny ORM folder (tests/fixtures/orm.py)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def sampling(a, pkg: Path, configs: list[dict], params: int, store: Path) -> dict:
    """K samples judged by P(True), then the same samples by the ORM: their points with FLOPs."""
    from ortevals.report.compute import compute_points, run_cost
    from ortevals.report.scaling import CurvePoint

    gen = {"samples": a.samples, "max_gen_toks": a.max_gen_toks, "store": str(store),
           "gen_kwargs": {"temperature": a.temperature}}
    with_self, s_self, wall_self = run(pkg, configs, verifier="self", **gen)
    with_orm, _, _ = run(pkg, configs, verifier=str(a.orm), **gen)  # the same samples, from the store
    points = [CurvePoint(**x) for x in with_self["scaling"]["points"]]
    orm = [CurvePoint(**{**x, "estimator": x["estimator"] + "_orm"}) for x in with_orm["scaling"]["points"]
           if x["estimator"] in ("bon", "weighted_maj")]
    out = compute_points(points, run_cost(params, with_self["verifier"]))
    return {"pass_points": points, "points": out + compute_points(orm, run_cost(params, with_orm["verifier"])),
            "verifier_self": with_self["verifier"], "verifier_orm": with_orm["verifier"], "wall_sampling_s": wall_self,
            "generation_stats": {k: s_self[k] for k in ("generated_tokens", "seconds")}}


def searches(a, pkg: Path, configs: list[dict], params: int) -> tuple[list, dict]:
    """Beam search and particle filtering guided by P(True) step scores: a point each, and their counts."""
    from ortevals.report.compute import Cost

    points, counts = [], {}
    for method in ("beam", "particles"):
        res, st, wall = run(pkg, configs[:a.search_questions], verifier="self", search=method, search_n=a.search_n,
                            search_width=2, search_max_steps=8, max_gen_toks=a.max_gen_toks)
        points.append(search_point(f"{method}+prm", a.search_n, res, st, Cost(params, params)))
        counts[method] = {"wall_s": wall, "search_tokens": st.get("search_tokens"), "prm_tokens": st["engine_tokens"],
                          "steps": st.get("search_steps"), "passes": st.get("search_passes"),
                          "questions": len(configs[:a.search_questions])}
    return points, counts


def main() -> None:
    a = parse_args()
    from ortevals.package.examples import smollm2_package
    from ortevals.package.loader import ModelPackage
    from ortevals.report.compute import compute_plot, fit_pass_curve

    pkg, store = smollm2_package("fp32"), Path(tempfile.mkdtemp()) / "store.sqlite"  # this invocation's only
    params = ModelPackage.load(pkg).parameters
    a.out.mkdir(parents=True, exist_ok=True)
    configs = task_configs(a.questions, a.max_gen_toks)
    body = sampling(a, pkg, configs, params, store)
    search_points, body["searches"] = searches(a, pkg, configs, params)
    out_points = body.pop("points") + search_points
    try:
        fit = fit_pass_curve(body.pop("pass_points"))
    except Exception as e:  # noqa: BLE001  (no positive coverage: nothing to fit)
        print(f"no coverage fit: {e}")
        fit = None
    compute_plot(out_points, a.out / "search.png", f"SmolLM2-135M, CoT MMLU-Pro, {a.questions} questions, "
                 f"K={a.samples}, T={a.temperature}", fit)
    body = {"questions": a.questions, "samples": a.samples, "max_gen_toks": a.max_gen_toks, "parameters": params,
            **body, "coverage_fit": {"a": fit.a, "b": fit.b, "k_for_0.5": fit.k_for(0.5)} if fit else None,
            "points": [p.__dict__ for p in out_points]}
    (a.out / "bench.json").write_text(json.dumps(body, indent=1, default=float))
    for pt in out_points:
        print(f"{pt.method:>22} k={pt.k:<3} acc {pt.value:.3f} [{pt.low:.3f}, {pt.high:.3f}]  tokens {pt.tokens:8.1f}"
              f"  GFLOPs {pt.flops / 1e9:9.1f}")
    for method, x in body["searches"].items():
        print(f"{method}: {x['passes']} decoder passes (prompts included) for {x['steps']} decoding steps")
    v = body["verifier_self"]
    print(f"verifier self: {v['tokens_run']} tokens, {v['seconds']:.1f} s = {v['cost_ratio']:.2f}x generation's "
          f"{v['generation_seconds']:.1f} s (same run)")


if __name__ == "__main__":
    main()
