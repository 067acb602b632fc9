#!/usr/bin/env python
"""Image requests side by side in one run: the fast media path, og's pipeline, and a naive loop.

    python scripts/bench_multimodal.py --docs 24 --out docs/bench-multimodal

On the tiny Gemma-4 multimodal fixture (tests/fixtures/gemma4_mm.py; built in about a second),
three workloads shaped like an MMMU-style benchmark: each document is a shared instruction header,
one real image (scikit-image's astronaut, chelsea, coffee, camera, text, rocket), a question;
``mc``: four multi-token answer choices scored by log-likelihood; ``mc N-shot``: the same with N
worked text examples after the header (a longer shared text prefix); ``gen``: greedy generation
(16 tokens, no stop). Three backends on the same request lists:

* ``fast``: :class:`ortevals.engine.media.fast.FastMediaEngine` (og's processor, then raw
  onnxruntime vision/embedding/decoder; the header's KV computed once);
* ``og``: :class:`ortevals.engine.media.og.MediaEngine` (``open_media(path="og")``: og's Generator; one
  processor + vision + prefill per document, continuations appended then rewound);
* ``naive``: a new processor run and a new Generator for every request (what Olive's draft PR
  #2615 does, without its temporary PNG files).

Each backend is warmed up on one document (sessions opened) and then timed; requests/s, the ratio
to ``naive``, and the largest log-likelihood difference to ``og`` are written to
``OUT/results.json``, ``OUT/table.md`` and ``OUT/requests_per_s.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HEADER = ("You are shown a picture and asked about it. Answer with a short phrase. Look at the whole "
          "picture, the objects in it and their colours, before you answer.\n\n")
QUESTIONS = ["What is shown?", "What is in the picture?", "Describe the main object.", "What do you see?"]
CHOICES = [" a man in a white space suit", " a small striped cat", " a cup of coffee on a table",
           " a page of printed text"]
IMAGES = ["astronaut.png", "chelsea.png", "coffee.png", "camera.png", "text.png", "rocket.jpg"]


def workloads(docs: int, shots: int):
    from ortevals.engine.generate.choice.settings import GenSettings
    from ortevals.engine.media.og import MediaRequest
    from ortevals.package.media import to_media
    from tests.fixtures.gemma4_mm import image_path

    media = [to_media(image_path(n)) for n in IMAGES]
    worked = "".join(f"Question: {q}\nAnswer:{c}\n\n" for q, c in zip(QUESTIONS * shots, CHOICES * shots))
    mc, fewshot, gen = [], [], []
    for d in range(docs):
        question = f"<image>Question {d + 1}: {QUESTIONS[d % len(QUESTIONS)]}\nAnswer:"
        img = (media[d % len(media)],)
        mc.extend(MediaRequest(HEADER + question, c, img) for c in CHOICES)
        fewshot.extend(MediaRequest(HEADER + worked + question, c, img) for c in CHOICES)
        gen.append(MediaRequest(HEADER + question, None, img, GenSettings(max_gen_toks=16)))
    return {"mc": mc, f"mc {shots}-shot": fewshot, "gen": gen}


def naive_loglikelihood(engine, reqs) -> list[float]:
    """A new processor run and Generator per request; the continuation appended to the prompt."""
    from ortevals.engine.media.og import split_context
    from ortevals.engine.score.scoring import continuation_logprob

    out = []
    for r in reqs:
        context, cont_text = split_context(r.context, r.continuation)
        cont = engine.continuation_ids(context, cont_text)
        processed = engine.runner.process(engine.prompt(context, r.media), r.media)
        gen = engine.runner.generator(processed, len(processed.input_ids) + len(cont))
        rows = [engine.runner.last_logits(gen)[None]]
        if len(cont) > 1:
            rows.append(engine.runner.append(gen, cont[:-1]))
        out.append(continuation_logprob(np.concatenate(rows), cont)[0])
    return out


def naive_generate(engine, reqs) -> list[str]:
    """One request at a time through og's path, so each prompt gets its own processor run and Generator."""
    return [engine.generate([r])[0] for r in reqs]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run(docs: int, shots: int, threads: int, out: Path) -> dict:
    from ortevals.engine.media.paths import open_media
    from ortevals.package.loader import ModelPackage
    from ortevals.package.tokenizer import Tokenizer
    from ortevals.runtime.providers import from_package
    from tests.fixtures.gemma4_mm import build_gemma4_mm

    cache = Path(os.environ.get("ORTEVALS_TEST_CACHE") or REPO / ".fixture-cache")  # as tests/conftest.py
    _, pkg_dir = build_gemma4_mm(cache / "gemma4")
    pkg = ModelPackage.load(pkg_dir)
    tok = Tokenizer.load(pkg)
    provider = from_package(pkg.decoder.session_options, threads=threads)
    work = workloads(docs, shots)
    engines = {name: open_media(pkg, tok, provider, path=path)
               for name, path in (("fast", "fast"), ("og", "og"), ("naive", "og"))}
    results: dict = {"docs": docs, "shots": shots, "threads": threads,
                     "machine": platform.processor() or platform.machine(), "package": str(pkg_dir), "workloads": {}}
    for wl, reqs in work.items():
        rows, answers = {}, {}
        for name, engine in engines.items():
            scoring = wl.startswith("mc")
            warm = reqs[:4] if scoring else reqs[:1]
            if scoring:
                call = (lambda e=engine, r=reqs: naive_loglikelihood(e, r)) if name == "naive" else \
                    (lambda e=engine, r=reqs: [lp for lp, _ in e.loglikelihood(r)])
                (naive_loglikelihood(engine, warm) if name == "naive" else engine.loglikelihood(warm))
            else:
                call = (lambda e=engine, r=reqs: naive_generate(e, r)) if name == "naive" else \
                    (lambda e=engine, r=reqs: e.generate(r))
                engine.generate(warm)
            seconds, answers[name] = timed(call)
            rows[name] = {"requests": len(reqs), "seconds": round(seconds, 3),
                          "requests_per_s": round(len(reqs) / seconds, 2)}
            print(f"{wl:<4} {name:<6} {len(reqs)} requests in {seconds:.2f} s: {len(reqs) / seconds:.1f} req/s",
                  flush=True)
        for name in rows:
            rows[name]["vs_naive"] = round(rows[name]["requests_per_s"] / rows["naive"]["requests_per_s"], 2)
            if wl.startswith("mc"):
                rows[name]["max_abs_diff_vs_og"] = float(np.max(np.abs(np.subtract(answers[name], answers["og"]))))
            else:
                rows[name]["same_text_as_og"] = sum(a == b for a, b in zip(answers[name], answers["og"]))
        results["workloads"][wl] = rows
    results["fast_prefix_cache"] = {"hits": engines["fast"].prefixes.hits, "misses": engines["fast"].prefixes.misses}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "table.md").write_text(table(results))
    plot(results, out / "requests_per_s.png")
    print(table(results))
    return results


def table(results: dict) -> str:
    lines = ["| workload | backend | requests | seconds | requests/s | × naive | agreement with og |",
             "|---|---|---:|---:|---:|---:|---|"]
    for wl, rows in results["workloads"].items():
        for name, r in rows.items():
            agree = (f"max abs Δ log-likelihood {r['max_abs_diff_vs_og']:.1e}" if "max_abs_diff_vs_og" in r
                     else f"{r['same_text_as_og']}/{r['requests']} identical texts")
            lines.append(f"| {wl} | {name} | {r['requests']} | {r['seconds']} | {r['requests_per_s']} | "
                         f"{r['vs_naive']} | {agree} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(results["workloads"])
    names = ["naive", "og", "fast"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.25
    for k, name in enumerate(names):
        vals = [results["workloads"][wl][name]["requests_per_s"] for wl in wls]
        ax.bar(np.arange(len(wls)) + (k - 1) * width, vals, width, label=name)
    ax.set_xticks(np.arange(len(wls)), [f"{wl} ({results['workloads'][wl]['og']['requests']} req)" for wl in wls])
    ax.set_ylabel("requests/s")
    ax.set_title(f"tiny Gemma-4 multimodal fixture, {results['threads']} threads, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--shots", type=int, default=5, help="worked examples before each question (few-shot)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-multimodal")
    args = parser.parse_args()
    run(args.docs, args.shots, args.threads, args.out)


if __name__ == "__main__":
    main()
