"""Benchmark (issue 26): K samples of a prompt with and without cascade (decode rows on one shared prompt KV).

One invocation, two OrtLMs on the same package (model arg ``cascade=off`` and ``cascade=on``), run
alternately so both see the same load on a shared machine:

* **acceptance run**: scripts/bench_samples.py's decoding acceptance settings (chain-of-thought
  MMLU-Pro, one question per subject, K=16 samples, temperature 0.7, 128 tokens, stop "Question:"),
  each question through ``lm_eval.simple_evaluate`` on each OrtLM (which one goes first alternates
  by question); generated tokens/s of each (tokens re-tokenized from the returned texts, as
  bench_samples counts them), their ratio, and whether every sample's text is equal.
* **prompt-length sweep**: K rows sampled for 128 tokens (temperature 0.7, no stop string) after
  the first 256 / 1024 / 2048 tokens of the bundled MMLU-Pro worked answers (fidelity/text.py),
  decode only (the prompt pass apart), median of ``--repeats`` alternating runs; token ids compared.

    PYTHONPATH=. python scripts/bench_cascade.py                        # 14 questions, K=16, sweep 256,1024,2048
    PYTHONPATH=. python scripts/bench_cascade.py --questions 2 --lengths 256 --out /tmp/cascade
    PYTHONPATH=. python scripts/bench_cascade.py --together --rounds 3 --lengths '' --baseline-tree /tmp/old \
        --out /tmp/together                 # /tmp/old: a git worktree of an earlier ortevals, a third row

Writes results.json, table.md and cascade.png to ``--out`` (docs/bench-cascade: the first command).
docs/bench-cascade/together.json and together.md are the third command's results.json and table.md
(every question in one run per mode, three rounds), copied there by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
MODES = ("off", "on")
BASE = "main@issue"  # --baseline-tree: ortevals as it was when the issue was filed (its own process)


def open_lms(args) -> dict:
    from bench_samples import model_paths

    from ortevals.integrations.lm import ModelArgs, OrtLM

    pkg = model_paths(args)[0]
    return {m: OrtLM.from_package(ModelArgs(pkg=pkg, threads=args.threads, gen_path="raw", cascade=m))
            for m in MODES}


def one_question(lm, cfg: dict) -> tuple[float, list[str]]:
    """(seconds, the K texts) of one question's simple_evaluate on ``lm``."""
    return questions(lm, [cfg])


def questions(lm, cfgs: list[dict]) -> tuple[float, list[str]]:
    """(seconds, the K texts of each question in turn) of one simple_evaluate over ``cfgs`` on ``lm``.

    lm-eval's ``add_env_info`` (``pip list`` through torch's collect_env, ~0.5 s a call on the 2-core machine) is
    skipped for every mode, as ortevals' own front door skips it (evaluate.py): it is the harness's, not the
    model's, and the per-question runs called it 14 times."""
    import copy
    from unittest import mock

    import lm_eval
    import lm_eval.evaluator

    from ortevals.tasks import task_manager

    t0 = time.perf_counter()
    with mock.patch.object(lm_eval.evaluator, "add_env_info", lambda storage: None):
        res = lm_eval.simple_evaluate(model=lm, tasks=[copy.deepcopy(c) for c in cfgs], limit=1, log_samples=True,
                                      task_manager=task_manager(None, defaults=False))
    return time.perf_counter() - t0, [t for c in cfgs for e in res["samples"][c["task"]] for t in e["resps"][0]]


def warm_up(lm, args) -> float:
    """One-time costs apart (tasks, the canary, cascade's graph): one question, 2 samples, 4 tokens."""
    from bench_samples import task_configs

    return one_question(lm, task_configs(1, 2, 4, args.temperature)[0])[0]


class Baseline:
    """ortevals of another working tree (``--baseline-tree``: main when the issue was filed) in its own
    process, its OrtLM (raw path) opened and warmed up once; one question at a time over a pipe."""

    def __init__(self, tree: Path, args) -> None:
        import subprocess

        cmd = [sys.executable, __file__, "--worker", str(tree), "--questions", str(args.questions), "--samples",
               str(args.samples), "--max-gen-toks", str(args.max_gen_toks), "--temperature", str(args.temperature),
               "--precision", args.precision, "--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(tree)})
        self.warmup = self._reply()["seconds"]
        self.commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                                     text=True).stdout.strip()

    def _reply(self) -> dict:
        line = next(ln for ln in self.proc.stdout if ln.startswith("WORKER "))
        return json.loads(line[7:])

    def question(self, i: int | str) -> tuple[float, list[str]]:
        """Question ``i``, or ``"all"``: every question in one simple_evaluate."""
        self.proc.stdin.write(f"{i}\n")
        self.proc.stdin.flush()
        r = self._reply()
        return r["seconds"], r["texts"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def worker(tree: str, args) -> None:
    """--worker TREE: the Baseline's process, ortevals imported from TREE."""
    from bench_samples import model_paths, task_configs  # (it puts REPO on sys.path: taken off after)

    sys.path[:] = [tree] + [p for p in sys.path if p != str(REPO)]
    import ortevals
    from ortevals.integrations.lm import ModelArgs, OrtLM

    assert ortevals.__file__.startswith(tree), ortevals.__file__
    lm = OrtLM.from_package(ModelArgs(pkg=model_paths(args)[0], threads=args.threads, gen_path="raw"))
    configs = task_configs(args.questions, args.samples, args.max_gen_toks, args.temperature)
    print("WORKER " + json.dumps({"seconds": warm_up(lm, args)}), flush=True)
    for line in sys.stdin:
        seconds, texts = questions(lm, configs) if line.strip() == "all" else one_question(lm, configs[int(line)])
        print("WORKER " + json.dumps({"seconds": seconds, "texts": texts}), flush=True)


def _setup(lms: dict, args) -> tuple:
    """(tokenizer, question configs, warm-up seconds per mode, the Baseline or None, the modes run)."""
    from bench_samples import task_configs

    tok = lms["off"].tokenizer
    configs = task_configs(args.questions, args.samples, args.max_gen_toks, args.temperature)
    warmup = {m: warm_up(lms[m], args) for m in MODES}
    base = Baseline(args.baseline_tree, args) if args.baseline_tree else None
    modes = (*MODES, BASE) if base else MODES
    if base:
        warmup[BASE] = base.warmup
    return tok, configs, warmup, base, modes


def acceptance(lms: dict, args) -> dict:
    """Each question on both OrtLMs (and the baseline's), in turn; per mode: seconds, tokens, texts."""
    tok, configs, warmup, base, modes = _setup(lms, args)
    out = {m: {"seconds": 0.0, "tokens": 0, "texts": []} for m in modes}
    rows = []
    for i, cfg in enumerate(configs):
        row, ids = {"task": cfg["task"]}, {}
        seen = _prompt_tokens(lms["on"])
        for m in modes[i % len(modes):] + modes[:i % len(modes)]:  # each mode first in turn
            wall, texts = base.question(i) if m == BASE else one_question(lms[m], cfg)
            ids[m] = [tok.encode(t, False) for t in texts]
            out[m]["seconds"] += wall
            out[m]["tokens"] += sum(map(len, ids[m]))
            out[m]["texts"] += texts
            row[m] = {"seconds": wall, "tokens": sum(map(len, ids[m]))}
        row["prompt_tokens"] = _prompt_tokens(lms["on"]) - seen
        row["samples_differing"] = _differing(ids["off"], ids["on"])  # (sample, first token that differs)
        if base:
            row["samples_differing_from_base"] = _differing(ids[BASE], ids["on"])
        rows.append(row)
        print(f"  {cfg['task']}: " + ", ".join(f"{m} {row[m]['seconds']:.1f} s" for m in modes), flush=True)
    return _found(lms, out, base, args, questions=len(configs), warmup_s=warmup, per_question=rows)


def _found(lms: dict, out: dict, base, args, **extra) -> dict:
    """Each mode's seconds, tokens and tokens/s from ``out``, the engines' stats, and the ratios."""
    summary = {m: {"generated_tokens": r["tokens"], "tokens_per_s": r["tokens"] / r["seconds"]}
               | {k: r[k] for k in ("seconds", "rounds") if k in r} for m, r in out.items()}
    for m in MODES:
        sampler = lms[m].run.generation.sampler()
        summary[m].update(kv=sampler.kv_rows.name, engine=dict(sampler.stats))
    found = {**extra, **summary, "texts_equal": out["off"]["texts"] == out["on"]["texts"],
             "texts_differing": _texts_differing(out["off"]["texts"], out["on"]["texts"]),
             "ratio": summary["on"]["tokens_per_s"] / summary["off"]["tokens_per_s"]}
    if base:
        base.close()
        found["baseline"] = {"commit": base.commit, "tree": str(args.baseline_tree),
                             "ratio": summary["on"]["tokens_per_s"] / summary[BASE]["tokens_per_s"],
                             "texts_differing": _texts_differing(out[BASE]["texts"], out["on"]["texts"])}
    return found


def acceptance_together(lms: dict, args) -> dict:
    """The acceptance run as a user runs it: every question in one simple_evaluate per mode (and the baseline's),
    ``--rounds`` times, which mode goes first rotating; seconds summed over the rounds, texts of the last."""
    tok, configs, warmup, base, modes = _setup(lms, args)
    out = {m: {"seconds": 0.0, "rounds": []} for m in modes}
    for r in range(args.rounds):
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:
            wall, texts = base.question("all") if m == BASE else questions(lms[m], configs)
            out[m]["seconds"] += wall
            out[m]["rounds"].append(wall)
            out[m]["texts"] = texts
            print(f"  round {r}: {m} {wall:.1f} s", flush=True)
    for m in modes:
        out[m]["tokens"] = args.rounds * sum(len(tok.encode(t, False)) for t in out[m]["texts"])
    return _found(lms, out, base, args, questions=len(configs), together=True, rounds=args.rounds, warmup_s=warmup)


def _texts_differing(a: list[str], b: list[str]) -> int:
    """How many of two runs' sample texts (same order) differ."""
    return sum(x != y for x, y in zip(a, b, strict=True))


def _prompt_tokens(lm) -> int:
    """Prompt tokens the sampler has seen (run or reused from a shared prefix)."""
    stats = lm.run.generation.sampler().stats
    return stats["prompt_tokens"] + stats["reused_tokens"]


def sweep(lms: dict, args) -> list[dict]:
    """Decode-only tokens/s after prompts of each length, both modes alternately."""
    import numpy as np

    from ortevals.engine.generate.choice.settings import parse_gen_kwargs
    from ortevals.fidelity.text import default_text

    tok = lms["off"].tokenizer
    ids = tok.encode(default_text(None, max_chars=40 * max(args.lengths)), False)
    kwargs = {"until": [], "max_gen_toks": args.max_gen_toks, "do_sample": True, "temperature": args.temperature}
    settings = parse_gen_kwargs(kwargs, args.max_gen_toks)
    out = []
    for length in args.lengths:
        prompt = tuple(ids[:length])
        times = {m: [] for m in MODES}
        got = {}
        for r in range(args.repeats):
            for m in (MODES if r % 2 == 0 else MODES[::-1]):
                s = lms[m].run.generation.sampler().fresh()  # no prefix held: every repeat runs the whole prompt
                logits, past = s.prompt(prompt, settings.max_gen_toks)
                t0 = time.perf_counter()
                done = s.decode(logits, past, settings, [np.random.default_rng(j) for j in range(args.samples)],
                                ["r"] * args.samples)
                times[m].append(time.perf_counter() - t0)
                got[m] = [d.ids for d in done]
        tokens = sum(len(x) for x in got["off"])
        row = {"prompt_tokens": len(prompt), "rows": args.samples, "generated_tokens": tokens,
               "token_equal": got["off"] == got["on"], "rows_differing": _differing(got["off"], got["on"])}
        if args.alone:  # the current path's own rounding: each row alone (one row per pass) against the batch
            alone = []
            for j in range(args.samples):
                s = lms["off"].run.generation.sampler().fresh()
                logits, past = s.prompt(prompt, settings.max_gen_toks)
                alone += [d.ids for d in s.decode(logits, past, settings, [np.random.default_rng(j)], ["r"])]
            row["off_rows_differing_from_alone"] = _differing(got["off"], alone)
        for m in MODES:
            row[m] = {"decode_s": statistics.median(times[m]), "tokens_per_s": tokens / statistics.median(times[m])}
        row["ratio"] = row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"]
        out.append(row)
        print(f"  prompt {length}: off {row['off']['decode_s']:.2f} s, on {row['on']['decode_s']:.2f} s, "
              f"× {row['ratio']:.2f}, rows differing {row['rows_differing']}", flush=True)
    return out


def _differing(a: list, b: list) -> list[tuple[int, int]]:
    """(row, first token index) of each row whose ids differ."""
    return [(r, next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))))
            for r, (p, q) in enumerate(zip(a, b, strict=True)) if p != q]


def table(report: dict) -> str:
    a = report.get("acceptance")
    lines = []
    if a:
        lines += ["| acceptance run | questions | samples | generated tokens | seconds | tokens/s |",
                  "|---|---:|---:|---:|---:|---:|"]
        base = a.get("baseline")
        for m in (*MODES, BASE) if base else MODES:
            name = f"main when the issue was filed ({base['commit'][:7]})" if m == BASE else f"cascade={m}"
            lines.append(f"| {name} | {a['questions']} | {report['config']['samples']} | "
                         f"{a[m]['generated_tokens']} | {a[m]['seconds']:.1f} | {a[m]['tokens_per_s']:.2f} |")
        if base:
            lines += ["", f"cascade=on / main when the issue was filed: **{base['ratio']:.2f}×** generated tokens/s "
                      f"({base['texts_differing']} of {a['questions'] * report['config']['samples']} samples' texts "
                      "differ)."]
        lines += ["", f"cascade=on / cascade=off: **{a['ratio']:.2f}×** generated tokens/s; every sample's text "
                  f"equal: {a['texts_equal']} ({a['texts_differing']} differ). One-time warm-up (tasks, canary, and "
                  f"for on the cascade graph built, opened and checked): off {a['warmup_s']['off']:.1f} s, on "
                  f"{a['warmup_s']['on']:.1f} s."]
        lines += _together_rows(a, base) if a.get("together") else _question_rows(a)
    if not report.get("sweep"):
        return "\n".join(lines) + "\n"
    lines += ["| prompt tokens | rows | generated tokens | off: decode s | on: decode s | on / off | rows differing: "
              "on vs off | off (16 rows) vs each row alone |", "|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in report.get("sweep", []):
        alone = r.get("off_rows_differing_from_alone")
        lines.append(f"| {r['prompt_tokens']} | {r['rows']} | {r['generated_tokens']} | {r['off']['decode_s']:.2f} | "
                     f"{r['on']['decode_s']:.2f} | **{r['ratio']:.2f}×** | {_rows(r['rows_differing'])} | "
                     f"{'—' if alone is None else _rows(alone)} |")
    return "\n".join(lines) + "\n"


def _question_rows(a: dict) -> list[str]:
    """The per-question table of the one-question-a-call acceptance run."""
    prompts = [r["prompt_tokens"] for r in a["per_question"]]
    lines = ["", f"Prompts {min(prompts)}–{max(prompts)} tokens (median {statistics.median(prompts):.0f}).", "",
             "| question | prompt tokens | tokens off / on | off s | on s | on / off | samples differing |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for q in a["per_question"]:
        diff = ", ".join(f"sample {r} from token {i}" for r, i in q.get("samples_differing", [])) or "none"
        lines.append(f"| {q['task'].removeprefix('mmlu_pro_')} | {q['prompt_tokens']} | {q['off']['tokens']} / "
                     f"{q['on']['tokens']} | {q['off']['seconds']:.1f} | {q['on']['seconds']:.1f} | "
                     f"{q['off']['seconds'] / q['on']['seconds']:.2f}× | {diff} |")
    return [*lines, ""]


def _together_rows(a: dict, base) -> list[str]:
    """Each round's seconds of the all-questions-in-one-call acceptance run, and the engine's passes."""
    modes = (*MODES, BASE) if base else MODES
    rounds = len(a["on"].get("rounds") or a["on"].get("rounds_s"))
    lines = ["", "| round | " + " | ".join(f"cascade={m}" if m != BASE else "issue's main" for m in modes) + " |",
             "|---|" + "---:|" * len(modes)]
    for r in range(rounds):
        lines.append(f"| {r} | " + " | ".join(f"{(a[m].get('rounds') or a[m].get('rounds_s'))[r]:.1f} s"
                                              for m in modes) + " |")
    lines.append("")
    lines += [f"- cascade={m}: {a[m]['engine']['decode_passes']} decode passes for {a[m]['engine']['row_steps']} "
              f"row-steps ({a[m]['kv']})" for m in MODES]
    return [*lines, ""]


def _rows(diff: list) -> str:
    return ", ".join(f"row {r} from token {i}" for r, i in diff) or "none"


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.get("sweep", [])
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = [r["prompt_tokens"] for r in rows]
    for m, style in zip(MODES, ("o--", "s-"), strict=True):
        ax.plot(x, [r[m]["tokens_per_s"] for r in rows], style, label=f"cascade={m}")
    for r in rows:
        ax.annotate(f"{r['ratio']:.2f}×", (r["prompt_tokens"], r["on"]["tokens_per_s"]), textcoords="offset points",
                    xytext=(0, 6), ha="center")
    cfg = report["config"]
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("generated tokens / s (decode)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"SmolLM2-135M {cfg['precision']}, K={cfg['samples']} rows, {cfg['max_gen_toks']} tokens, "
                 f"{cfg['threads']} threads", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cascade.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=14)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-gen-toks", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",") if x], default=[256, 1024, 2048],
                    help="prompt lengths of the decode sweep ('' for none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-alone", dest="alone", action="store_false",
                    help="skip decoding each sweep row alone (the current path's own rounding, for comparison)")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="a working tree of ortevals as the issue found it (git worktree add /tmp/old 4a33a3a): "
                         "the acceptance run on it too, in its own process, each question in turn")
    ap.add_argument("--together", action="store_true",
                    help="the acceptance run as a user runs it: every question in one simple_evaluate per mode (two "
                         "questions' samples may then share decode passes), --rounds times")
    ap.add_argument("--rounds", type=int, default=2, help="with --together: runs of each mode, first mode rotating")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench-cascade")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"} | {
        "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}}
    import torch  # noqa: F401 - simple_evaluate imports torch to seed it: once here, in neither mode's time

    lms = open_lms(args)
    if args.questions:
        report["acceptance"] = (acceptance_together if args.together else acceptance)(lms, args)
        (args.out / "results.json").write_text(json.dumps(report, indent=1))  # kept if the sweep fails
    report["sweep"] = sweep(lms, args) if args.lengths else []
    report["config"]["load_avg_end"] = os.getloadavg()
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    (args.out / "table.md").write_text(table(report))
    plot(report, args.out)
    print(table(report))


if __name__ == "__main__":
    main()
