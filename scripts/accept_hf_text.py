#!/usr/bin/env python
"""Acceptance (issue 22): ortevals generates the same text as lm-eval's hf backend on SmolLM2-135M.

    ORTEVALS_CACHE=… python scripts/accept_hf_text.py [--questions 24] [--max-gen-toks 96] [--json out.json]

One gsm8k-style task (a local copy of lm-eval's gsm8k chat layout: 3-shot as multi-turn chat,
``apply_chat_template``, greedy, stop strings that are special tokens ``<|im_start|>``/``<|im_end|>``
plus ``Question:``) run through ``lm_eval.simple_evaluate`` twice in one process: with lm-eval's
``HFLM`` (PyTorch, the SmolLM2 checkpoint, batch size 1) and with ortevals' ``OrtLM`` (the fp32
package built from the same checkpoint). The prompts (lm-eval built them with each model's chat
template) and the generated texts are compared string for string; the figure is how many of the
questions give the same text. The questions are grade-school word problems written for this script
(no data set is downloaded).
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHOTS = [("Tom has 3 apples and buys 5 more. How many apples does he have?", "Tom has 3 + 5 = 8 apples. #### 8"),
         ("A box holds 12 pens. How many pens are in 4 boxes?", "4 boxes hold 4 * 12 = 48 pens. #### 48"),
         ("Sara had 20 dollars and spent 7. How much does she have left?", "Sara has 20 - 7 = 13 dollars. #### 13")]
PROBLEMS = [
    "A farmer has 14 cows and buys 9 more. How many cows does he have now?",
    "There are 6 rows of chairs with 8 chairs in each row. How many chairs are there?",
    "Lena reads 15 pages a day. How many pages does she read in 6 days?",
    "A baker made 48 cookies and sold 29. How many cookies are left?",
    "Each bag has 7 marbles. How many marbles are in 9 bags?",
    "Mike is 12 years old. His sister is 5 years older. How old is his sister?",
    "A train travels 60 miles per hour. How far does it go in 3 hours?",
    "There are 35 students and 5 equal teams. How many students are on each team?",
    "Anna buys 4 notebooks at 3 dollars each. How much does she spend?",
    "A garden has 23 red roses and 18 white roses. How many roses are there in all?",
    "Paul had 100 stickers and gave away 37. How many stickers does he have?",
    "A pizza is cut into 8 slices. How many slices are in 5 pizzas?",
    "Jack runs 2 miles every morning. How many miles does he run in a week?",
    "A shop sells 45 shirts on Monday and 38 on Tuesday. How many shirts did it sell?",
    "There are 72 eggs packed 12 to a carton. How many cartons are there?",
    "A car park has 9 levels with 40 spaces each. How many spaces are there?",
    "Emma saves 25 dollars a month. How much does she save in 8 months?",
    "A class has 31 pupils; 14 are boys. How many girls are there?",
    "Ben has 3 packs of 24 cards and loses 10 cards. How many cards does he have?",
    "A tank holds 500 liters and is half full. How many liters are in it?",
    "Olivia walks 1200 meters to school and back each day. How far is school?",
    "A movie lasts 2 hours and 15 minutes. How many minutes is that?",
    "Sam buys a 7 dollar book and a 6 dollar pen with a 20 dollar bill. What change does he get?",
    "A spider has 8 legs. How many legs do 11 spiders have?",
    "Three friends share 57 sweets equally. How many does each get?",
    "A school orders 16 boxes of 25 pencils. How many pencils is that?",
]
UNTIL = ["Question:", "<|im_start|>", "<|im_end|>", "</s>"]


def task_config(folder: Path, questions: int, max_gen_toks: int) -> dict:
    """gsm8k's layout as a local lm-eval task: data files in ``folder``, 3-shot from its own train split."""
    for split, rows in (("train", [{"question": q, "answer": a} for q, a in SHOTS]),
                        ("test", [{"question": q, "answer": ""} for q in PROBLEMS[:questions]])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"task": "gsm8k_style_chat", "dataset_path": "json", "output_type": "generate_until",
            "dataset_kwargs": {"data_files": {s: str(folder / f"{s}.jsonl") for s in ("train", "test")}},
            "training_split": "train", "fewshot_split": "train", "test_split": "test", "num_fewshot": 3,
            "fewshot_config": {"sampler": "first_n"},
            "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": "{{answer}}",
            "target_delimiter": " ", "fewshot_delimiter": "\n\n",
            "generation_kwargs": {"until": UNTIL, "do_sample": False, "temperature": 0.0,
                                  "max_gen_toks": max_gen_toks},
            "metric_list": [{"metric": "exact_match"}]}


def generations(model, cfg: dict) -> list[tuple[str, str]]:
    """(prompt, generated text) per question, in doc order, from lm-eval's simple_evaluate on ``model``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    res = lm_eval.simple_evaluate(model=model, tasks=[cfg], apply_chat_template=True, fewshot_as_multiturn=True,
                                  log_samples=True, task_manager=TaskManager(include_defaults=False),
                                  torch_random_seed=None if "OrtLM" in type(model).__name__ else 1234)
    samples = sorted(res["samples"][cfg["task"]], key=lambda s: s["doc_id"])
    return [(s["arguments"][0][0], s["resps"][0][0]) for s in samples]


def compare(questions: int = 24, max_gen_toks: int = 96) -> dict:
    """Run both and compare; returns the counts, timings and every difference."""
    from lm_eval.models.huggingface import HFLM

    from ortevals.integrations.lm import ModelArgs, OrtLM
    from ortevals.package.examples import smollm2_hf_dir, smollm2_package

    with tempfile.TemporaryDirectory() as tmp:
        cfg = task_config(Path(tmp), questions, max_gen_toks)
        start = time.perf_counter()
        ours = generations(OrtLM.from_package(ModelArgs(pkg=str(smollm2_package("fp32")), max_length=2048)), cfg)
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        hf = HFLM(pretrained=str(smollm2_hf_dir()), device="cpu", batch_size=1, dtype="float32", max_length=2048)
        theirs = generations(hf, cfg)
        hf_s = time.perf_counter() - start
    same_prompt = sum(a[0] == b[0] for a, b in zip(ours, theirs, strict=True))
    same_text = sum(a == b for a, b in zip(ours, theirs, strict=True))
    ended = sum(len(hf.tok_encode(t)) < max_gen_toks for _, t in theirs)  # by EOS or a stop, not the cap
    return {"questions": len(ours), "same_prompt": same_prompt, "same_text": same_text,
            "ended_before_max_gen_toks": ended, "ortevals_s": round(ours_s, 1), "hf_s": round(hf_s, 1),
            "differences": [{"doc": i, "prompt_equal": a[0] == b[0], "ortevals": a[1], "hf": b[1]}
                            for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b],
            "first_prompt": ours[0][0] if ours else "", "first_text": ours[0][1] if ours else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--max-gen-toks", type=int, default=96)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = compare(args.questions, args.max_gen_toks)
    print(f"{out['same_text']}/{out['questions']} questions: the same generated text as lm-eval hf "
          f"({out['same_prompt']} same prompts); ortevals {out['ortevals_s']} s, hf {out['hf_s']} s")
    for d in out["differences"]:
        print(json.dumps(d, ensure_ascii=False))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
