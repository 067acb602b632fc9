"""What ``ortevals diagnose`` says: ``diagnose.json`` (:func:`summary`) and the printed tables (:func:`format_text`).

Owns the layout of the results: the candidate and reference, the text, the per-layer block table
(relative L2 error and cosine after each block, the error it adds, ± window-clustered standard
errors), the candidate's token KL and choice-KL, each group measured alone, the greedy's measured
cumulative sets, the recommendation with the builder's command line and the Olive pass that make
it, and ``--verify``'s measurements beside the prediction. The text is drawn from the JSON
summary alone, so the two never disagree.
"""

from __future__ import annotations

import json
import math

from ortevals.diagnose.recommend import builder_command, olive_pass, shell
from ortevals.diagnose.stats import ranked, recovered_share
from ortevals.package.graph import graph_facts

MB = 1e6
FULL_ALREADY = "at full precision already"  # the end of runtime/swap.py's reason for a group not quantized


def _choice(c) -> dict | None:
    return None if c is None else {"questions": c.n, "kl": c.kl, "kl_se": c.kl_se, "flips": c.flips,
                                   "flip_rate": c.flip_rate, "answer_changes": c.answer_changes,
                                   "accuracy": c.accuracy, "ref_accuracy": c.ref_accuracy}


def _candidate(c, base, size: int) -> dict:
    return {"label": c.label, "units": list(c.units), "nodes": list(c.nodes), "bytes_added": c.bytes_added,
            "size_percent": 100 * c.bytes_added / size, "kl": c.token.kl, "kl_se": c.token.kl_se,
            "same_top1": c.token.same_top1, "recovered": c.recovered, "recovered_se": c.recovered_se,
            "recovered_share": recovered_share(base, c.token.kl),
            "recovered_per_mb": c.recovered / (c.bytes_added / MB) if c.bytes_added > 0 else None,
            "package": str(c.package) if c.package else None, "choice": _choice(c.choice)}


def summary(r) -> dict:
    """The JSON of a :class:`~ortevals.diagnose.run.DiagnoseReport`."""
    base = r.baseline.kl
    rows = [b.__dict__ for b in r.layers.rows]
    out = {
        "candidate": {"path": str(r.cand.root), "precision": graph_facts(r.cand.decoder.path).precision,
                      "bytes": r.cand_size},
        "reference": {"path": str(r.ref.root), "precision": graph_facts(r.ref.decoder.path).precision},
        "text": {"tokens_scored": r.plan.n_scored, "windows": r.plan.n_windows, "n_ctx": r.plan.n_ctx,
                 "positions_compared": r.layers.tokens, "source": str(r.options.text or r.options.data or "bundled")},
        "layers": {"coverage": r.layers.coverage(len(r.cand.kv)), "compared": list(r.layers.compared),
                   "not_compared": list(r.layers.missing), "blocks": rows,
                   "ranked": [b.name for b in ranked(list(r.layers.rows))]},
        "token_kl": {"candidate": {"mean": base, "se": r.baseline.kl_se, "same_top1": r.baseline.same_top1,
                                   "ppl_ratio": r.baseline.ppl_ratio}},
        "choice": _choice(r.baseline_choice),
        "budget": {"percent": r.options.budget, "bytes": r.budget_bytes},
        "sensitivity": {"groups": [_candidate(c, base, r.cand_size) for c in r.singles],
                        "skipped": [{"unit": s.unit, "reason": s.reason} for s in r.skipped]},
        "greedy": [_candidate(c, base, r.cand_size) for c in r.steps],
        "recommendation": _recommendation(r),
        "verify": _verified(r),
        "notes": list(r.notes) + list(r.settings.notes),
    }
    return out


def _recommendation(r) -> dict | None:
    c = r.recommended
    if c is None:
        return None
    ckpt = str(r.checkpoint) if r.checkpoint else None
    cmd = builder_command(r.settings, c.nodes, ckpt, "OUT")
    return {**_candidate(c, r.baseline.kl, r.cand_size), "builder_args": cmd, "builder_command": shell(cmd),
            "olive_pass": olive_pass(r.settings, c.nodes), "expected_size": r.cand_size + c.bytes_added}


def _verified(r) -> dict | None:
    v = r.verified
    if v is None:
        return None
    return {"package": str(v.package), "builder_command": shell(list(v.command)), "bytes": v.size,
            "size_percent": 100 * (v.size - r.cand_size) / r.cand_size, "kl": v.token.kl, "kl_se": v.token.kl_se,
            "same_top1": v.token.same_top1, "recovered": v.recovered, "recovered_se": v.recovered_se,
            "recovered_share": recovered_share(r.baseline.kl, v.token.kl), "same_weights": v.same_weights,
            "choice": _choice(v.choice)}


def _pm(x: float, se: float, digits: int = 4) -> str:
    return f"{x:.{digits}f} ± {se:.{digits}f}" if math.isfinite(se) else f"{x:.{digits}f} ± n/a"


def _layer_lines(s: dict) -> list[str]:
    lines = ["", "Per layer: the residual stream against the reference after each block (mean over tokens; "
             "± a standard error clustered by window)",
             f"{'block':<18}{'rel L2 after':>14}{'cosine':>10}   {'error added by the block':<24}"]
    for b in s["layers"]["blocks"]:
        lines.append(f"{b['name']:<18}{b['rel_l2']:>14.4f}{b['cosine']:>10.4f}   "
                     f"{b['added']:+.4f} ± {b['added_se']:.4f}")
    top = [next(b for b in s["layers"]["blocks"] if b["name"] == n) for n in s["layers"]["ranked"][:5]]
    lines += [s["layers"]["coverage"], "largest added error: " + ", ".join(f"{b['name']} {b['added']:+.4f}"
                                                                           for b in top)]
    return lines


def _head_lines(s: dict) -> list[str]:
    c, t, k = s["candidate"], s["text"], s["token_kl"]["candidate"]
    lines = [f"candidate: {c['path']} ({c['precision']}, {c['bytes'] / MB:.1f} MB)",
             f"reference: {s['reference']['path']} ({s['reference']['precision']})",
             f"text: {t['source']}, {t['tokens_scored']} tokens scored in {t['windows']} windows of {t['n_ctx']} "
             f"(token KL); every position of those windows per layer ({t['positions_compared']} tokens)"]
    tail = [f"token KL of the candidate: {_pm(k['mean'], k['se'])} nats (same top-1 {100 * k['same_top1']:.1f}%)"]
    if s["choice"]:
        q = s["choice"]
        tail.append(f"choice-KL on {q['questions']} MMLU-Pro questions: {_pm(q['kl'], q['kl_se'])} nats, "
                    f"{q['flips']} flips ({100 * q['flip_rate']:.1f}%), accuracy {100 * q['accuracy']:.1f}% "
                    f"(reference {100 * q['ref_accuracy']:.1f}%)")
    return lines + _layer_lines(s) + [""] + tail


def _group_lines(s: dict) -> list[str]:
    b = s["budget"]
    lines = ["", f"Sensitivity: each group alone at the reference's precision (budget +{b['bytes'] / MB:.2f} MB = "
                 f"{b['percent']:g}% of the candidate)",
             f"{'group':<18}{'+MB':>8}  {'token KL':<18}{'KL recovered':<28}{'per MB':>8}"]
    for g in s["sensitivity"]["groups"]:
        per = f"{g['recovered_per_mb']:8.4f}" if g["recovered_per_mb"] is not None else f"{'-':>8}"
        rec = f"{_pm(g['recovered'], g['recovered_se'])} ({100 * g['recovered_share']:.1f}%)"
        lines.append(f"{g['label']:<18}{g['bytes_added'] / MB:>8.2f}  {_pm(g['kl'], g['kl_se']):<18}{rec:<28}{per}")
    skipped = s["sensitivity"]["skipped"]
    full = [k["unit"] for k in skipped if k["reason"].endswith(FULL_ALREADY)]
    lines += [f"not measured: {k['unit']}: {k['reason']}" for k in skipped if not k["reason"].endswith(FULL_ALREADY)]
    if full:  # one line for them all (a float candidate listed every group, one line each)
        shown = ", ".join(full[:6]) + (f" and {len(full) - 6} more" if len(full) > 6 else "")
        lines.append(f"not measured: {len(full)} groups at full precision in the candidate already ({shown})")
    return lines


def _step_lines(s: dict) -> list[str]:
    lines = ["", "Greedy: groups added by KL recovered per MB, each cumulative set built and measured",
             f"{'step':<6}{'adds':<18}{'+MB':>8}{'size':>8}  {'token KL':<18}{'recovered':>10}  "
             f"{'choice-KL':<18}{'flips':>8}"]
    base, choice = s["token_kl"]["candidate"], s["choice"]
    rows = [("0", "(candidate)", 0.0, 0.0, base["mean"], base["se"], 0.0, choice)]
    prev: list[str] = []
    for c in s["greedy"]:
        added = [u for u in c["units"] if u not in prev]
        rows.append((c["label"].split()[-1], "+" + ",".join(added), c["bytes_added"] / MB, c["size_percent"],
                     c["kl"], c["kl_se"], c["recovered_share"], c["choice"]))
        prev = c["units"]
    for step, adds, mb, pct, kl, se, share, ch in rows:
        cho = (_pm(ch["kl"], ch["kl_se"]), f"{ch['flips']}/{ch['questions']}") if ch else ("-", "-")
        lines.append(f"{step:<6}{adds:<18}{mb:>8.2f}{pct:>+7.1f}%  {_pm(kl, se):<18}{100 * share:>9.1f}%  "
                     f"{cho[0]:<18}{cho[1]:>8}")
    return lines


def _recommend_lines(s: dict) -> list[str]:
    r = s["recommendation"]
    if r is None:
        return ["", "No recommendation: " + "; ".join(s["notes"] or ["nothing measured"])]
    at = "at int8 (@int8) or the reference's precision" if any(u.endswith("@int8") for u in r["units"]) else \
        "at the reference's precision"
    lines = ["", f"Recommended: keep {', '.join(r['units'])} {at}",
             f"  size +{r['bytes_added'] / MB:.2f} MB ({r['size_percent']:+.1f}%, {r['expected_size'] / MB:.1f} MB); "
             f"expected token KL {_pm(r['kl'], r['kl_se'])} (recovers {100 * r['recovered_share']:.1f}% of the "
             "candidate's)" + (f", choice-KL {_pm(r['choice']['kl'], r['choice']['kl_se'])}" if r["choice"] else ""),
             f"  builder: {r['builder_command']}",
             f"  Olive pass: {json.dumps(r['olive_pass'])}" if r["olive_pass"] is not None else
             "  Olive pass: none (groups at int8 need the builder's --target_options, which the pass does not hand on)"]
    lines += [f"  note: {n}" for n in s["notes"]]
    v = s["verify"]
    if v:
        lines += [f"Verified: built {v['package']} ({v['bytes'] / MB:.1f} MB, {v['size_percent']:+.1f}%): token KL "
                  f"{_pm(v['kl'], v['kl_se'])} (predicted {_pm(r['kl'], r['kl_se'])}), recovers "
                  f"{100 * v['recovered_share']:.1f}% of the candidate's KL"
                  + (f"; choice-KL {_pm(v['choice']['kl'], v['choice']['kl_se'])}, {v['choice']['flips']}/"
                     f"{v['choice']['questions']} flips" if v["choice"] else ""),
                  f"  {v['same_weights']}"]
        if abs(v["bytes"] - r["expected_size"]) > 0.01 * r["expected_size"]:  # the builder exported more than asked
            lines.append(f"  warning: the build is {v['bytes'] / MB:.1f} MB, not the {r['expected_size'] / MB:.1f} MB "
                         "predicted: the builder exported other weights otherwise; the measurement above is the one "
                         "that counts")
    return lines


def format_text(s: dict) -> str:
    """The printed report of a summary."""
    return "\n".join(_head_lines(s) + _group_lines(s) + _step_lines(s) + _recommend_lines(s))
