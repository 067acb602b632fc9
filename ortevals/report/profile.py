"""What `ortevals profile` leaves behind: the speed table, ``profile.json`` and ``profile.png``.

Owns the presentation of an :class:`~ortevals.engine.profile.Profile`: one row per (setting,
backend) with prefill and decode tokens/s, TTFT, TPOT and peak memory, and the ratio raw / og per
setting (the same invocation, so a busy machine slows both alike); the JSON (strict: ``null`` for
no value, every repeat's times kept); a plot of the two rates per setting (matplotlib, report/plots.py).
"""

from __future__ import annotations

from pathlib import Path

from ortevals.engine.profile import BACKENDS, Profile
from ortevals.files import atomic_write, atomic_write_bytes, json_text
from ortevals.report.plots import figure, png

COLUMNS = (("backend", "{}"), ("batch", "{}"), ("prompt_len", "{}"), ("gen_len", "{}"),
           ("prefill_tok_s", "{:.1f}"), ("decode_tok_s", "{:.1f}"), ("ttft_ms", "{:.1f}"),
           ("tpot_ms", "{:.2f}"), ("peak_mib", "{:.1f}"))
HEADERS = ("backend", "batch", "prompt", "gen", "prefill tok/s", "decode tok/s", "TTFT ms", "TPOT ms",
           "peak MiB")


def rows(profile: Profile) -> list[dict]:
    return [t.summary() for t in profile.trials]


def ratios(profile: Profile) -> list[dict]:
    """Per setting with both backends: raw / og of the rates, og / raw of the latencies (>1: raw is faster)."""
    by = {}
    for r in rows(profile):
        by.setdefault((r["batch"], r["prompt_len"], r["gen_len"]), {})[r["backend"]] = r
    out = []
    for (b, p, g), pair in by.items():
        if set(BACKENDS) <= set(pair):
            raw, og = pair["raw"], pair["og"]
            out.append({"batch": b, "prompt_len": p, "gen_len": g,
                        "prefill": raw["prefill_tok_s"] / og["prefill_tok_s"],
                        "decode": _div(raw["decode_tok_s"], og["decode_tok_s"]),
                        "ttft": og["ttft_ms"] / raw["ttft_ms"]})
    return out


def _div(a, b):
    return None if a is None or b is None else a / b


def _cell(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def format_table(profile: Profile) -> str:
    """The speed table, then the ratios and any backend that did not run."""
    body = [[_cell(fmt, r[k]) for k, fmt in COLUMNS] for r in rows(profile)]
    widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h) for i, h in enumerate(HEADERS)]
    lines = [f"{profile.package} on {profile.provider}, {profile.threads} threads; means over repeats "
             "(raw: ortevals' raw path; og: onnxruntime-genai's Generator)",
             "  ".join(h.rjust(w) for h, w in zip(HEADERS, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in body]
    for r in ratios(profile):
        lines.append(f"raw/og at batch {r['batch']}, prompt {r['prompt_len']}, gen {r['gen_len']}: prefill "
                     f"{r['prefill']:.2f}x, decode {_cell('{:.2f}', r['decode'])}x, TTFT {r['ttft']:.2f}x")
    for name, why in profile.skipped.items():
        lines.append(f"{name}: not run ({why})")
    return "\n".join(lines)


def to_json(profile: Profile) -> dict:
    trials = [{**t.summary(), "prefill_s": t.prefill_s, "first_token_s": t.first_token_s,
               "decode_s": t.decode_s, "wall_each_s": t.wall_s} for t in profile.trials]
    return {"package": profile.package, "provider": profile.provider, "threads": profile.threads,
            "method": "benchmark_e2e.py's timers (microsoft/onnxruntime-genai): prefill = the prompt pass, "
                      "TTFT = prefill + first token's choice, TPOT = mean of later steps (pass + choice); "
                      "greedy, EOS masked until gen_len; prompts: random ids below 100, each row its own (the "
                      "script's --use_random_tokens), seeded; each (setting, backend) in a fresh process; "
                      "peak (host) = that process's peak resident set above its size before the model opened",
            "trials": trials, "ratios": ratios(profile), "skipped": profile.skipped,
            "interrupted": profile.interrupted, "planned_runs": profile.planned}


def plot(profile: Profile) -> bytes:
    """Prefill and decode tokens/s per setting, one bar per backend."""
    data = rows(profile)
    keys = list(dict.fromkeys((r["batch"], r["prompt_len"], r["gen_len"]) for r in data))
    plt, fig, axes = figure(width=max(7.0, 1.2 * len(keys) + 3), height=4.0, cols=2)
    width = 0.8 / len(BACKENDS)
    for ax, metric, title in ((axes[0], "prefill_tok_s", "prefill tokens/s"),
                              (axes[1], "decode_tok_s", "decode tokens/s")):
        for j, name in enumerate(BACKENDS):
            got = {(r["batch"], r["prompt_len"], r["gen_len"]): r[metric] for r in data if r["backend"] == name}
            xs = [i + j * width for i, k in enumerate(keys) if got.get(k) is not None]
            ax.bar(xs, [got[k] for k in keys if got.get(k) is not None], width, label=name)
        ax.set_xticks([i + width * (len(BACKENDS) - 1) / 2 for i in range(len(keys))])
        ax.set_xticklabels([f"b{b} p{p}\ng{g}" for b, p, g in keys], fontsize=8)
        ax.set_title(title)
        ax.legend()
    return png(plt, fig)


def write(profile: Profile, folder: Path) -> list[Path]:
    """``profile.json`` and ``profile.png`` in ``folder`` (made if needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "profile.json", folder / "profile.png"]
    atomic_write(paths[0], json_text(to_json(profile)))
    atomic_write_bytes(paths[1], plot(profile))
    return paths
