"""The sensitivity stage of ``ortevals diagnose``: measured, not guessed.

Owns choosing which weight groups to try (those of the blocks that add the most error, from the
per-layer stage, in that order, up to ``--candidates``, and the LM head, whose error no hidden
state shows), their size against the budget, and measuring: for each group a derived candidate
with only that group at the reference's precision (:func:`ortevals.runtime.swap.swapped_package`)
gets its token KL against the saved reference (:mod:`ortevals.diagnose.measure`); the greedy order
(:func:`ortevals.diagnose.stats.greedy_steps`: KL recovered per megabyte) then gives cumulative sets,
each built and measured again (groups do not add up exactly), and on each of those the choice-KL
and flips on the fixed MMLU-Pro sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ortevals.diagnose import resume
from ortevals.diagnose.inputs import decoder_graph
from ortevals.diagnose.int8 import MARK, at_int8, base, bytes_added, mixed_package
from ortevals.diagnose.measure import ChoiceKL, TokenKL, choice_kl, choice_run, token_kl
from ortevals.diagnose.stats import BlockRow, Gain, greedy_steps
from ortevals.package.loader import ModelPackage
from ortevals.runtime.roles import Unit, unit_sort_key, weight_units
from ortevals.runtime.swap import Refused, size_delta

ATTN_GROUPS, MLP_GROUPS = ("qkv", "o"), ("gate_up", "down")


@dataclass(frozen=True)
class Candidate:
    """A derived candidate: ``units`` at the reference's precision, measured against the reference."""

    label: str
    units: tuple[str, ...]
    nodes: tuple[str, ...]
    bytes_added: int
    token: TokenKL
    recovered: float
    recovered_se: float
    package: Path | None
    choice: ChoiceKL | None = None


@dataclass(frozen=True)
class Skipped:
    unit: str
    reason: str


def block_of(unit: Unit) -> str | None:
    """``attn``, ``mlp``, ``embeddings`` or None (the LM head)."""
    if unit.group in ATTN_GROUPS or any("/attn/" in n for n in unit.nodes):
        return "attn"
    if unit.group in MLP_GROUPS or any("/mlp/" in n for n in unit.nodes):
        return "mlp"
    return "embeddings" if unit.group == "embeddings" else None


def in_order(ranked_rows: list[BlockRow], units: dict[str, Unit]) -> list[Unit]:
    """The groups of the blocks that add the most error, in that order, then the LM head (and any group left)."""
    chosen: list[Unit] = []
    for row in ranked_rows:
        chosen += [u for u in sorted(units.values(), key=unit_sort_key)
                   if block_of(u) == row.block and u.layer == row.layer and u not in chosen]
    head = [units["lm_head"]] if "lm_head" in units else []
    return chosen + head + [u for u in sorted(units.values(), key=unit_sort_key) if u not in chosen + head]


def choose(cand, ref, ranked_rows: list[BlockRow], units: dict[str, Unit], limit: int,
           budget: float, int8: ModelPackage | None = None) -> tuple[list[tuple[Unit, int]], list[Skipped]]:
    """Up to ``limit`` groups to measure, in :func:`in_order`'s order, each with its bytes added, and the LM head
    besides (with an ``int8`` package, each group also at int8); a group already at full precision (or
    unmatched) or over the budget is skipped and listed."""
    kept, skipped = [], []
    for u in in_order(ranked_rows, units):
        if len({base(k.name) for k, _ in kept if k.group != "lm_head"}) >= limit and u.group != "lm_head":
            continue
        for option, donor in ((u, ref), (at_int8(u), int8)) if int8 is not None else ((u, ref),):
            try:
                size = size_delta(cand, donor, tuple(n.removesuffix(MARK) for n in option.nodes))
            except Refused as e:
                skipped.append(Skipped(option.name, str(e)))
                continue
            if size > budget:
                skipped.append(Skipped(option.name, f"+{size / 1e6:.1f} MB, over the budget of +{budget / 1e6:.1f} MB"))
            else:
                kept.append((option, size))
    return kept, skipped


@dataclass(frozen=True)
class Bench:
    """Where candidates are built and measured: both packages, the candidate's own measurement, the saved
    reference, the cache for derived packages, the provider and a progress callback."""

    cand: ModelPackage
    ref: ModelPackage
    baseline: TokenKL
    reference_file: Path
    cache: Path
    ep: str | None
    say: Callable[[str], None]
    int8: ModelPackage | None = None  # --int8: the builder's int8 export, a cheaper choice per group

    def measure(self, label: str, units: tuple[Unit, ...], size: int) -> Candidate:
        nodes = tuple(n for u in units for n in u.nodes)
        package = mixed_package(self.cand, self.ref, self.int8, nodes, self.cache)
        tk = resume.token_kl(package, self.reference_file, self.ep, self.cache,
                             lambda: token_kl(package, self.reference_file, self.ep))
        rec, se = tk.recovered(self.baseline)
        return Candidate(label, tuple(u.name for u in units), nodes, size, tk, rec, se, package)

    def singles(self, todo: list[tuple[Unit, int]]) -> list[Candidate]:
        out = []
        for i, (u, size) in enumerate(todo):
            c = self.measure(u.name, (u,), size)
            self.say(f"  {i + 1}/{len(todo)} {u.name}: token KL {c.token.kl:.4g} (recovered {c.recovered:+.4g}), "
                     f"+{size / 1e6:.2f} MB")
            out.append(c)
        return out

    def steps(self, singles: list[Candidate], budget: float) -> list[Candidate]:
        """The greedy's cumulative sets, each measured (the first is its single group's measurement)."""
        by_name = {c.units[0]: c for c in singles}
        order = greedy_steps(self.baseline.kl, [Gain(c.units[0], c.token.kl, c.bytes_added) for c in singles],
                             budget)
        units = weight_units(decoder_graph(self.cand))
        units.update({u.name: u for u in map(at_int8, list(units.values()))})
        steps = []
        for k, name in enumerate(order, 1):
            if k == 1:
                steps.append(replace(by_name[name], label="step 1"))
                continue
            chosen = tuple(units[n] for n in order[:k])
            size = bytes_added(self.cand, self.ref, self.int8, tuple(n for u in chosen for n in u.nodes))
            c = self.measure(f"step {k}", chosen, size)
            self.say(f"  step {k} (+{name}): token KL {c.token.kl:.4g}, +{c.bytes_added / 1e6:.2f} MB")
            steps.append(c)
        return steps


def with_choices(cands: list[Candidate], ref_run, questions: int, data: str | None, ep: str | None,
                 say: Callable[[str], None]) -> list[Candidate]:
    """Each candidate with its choice-KL and flips on the fixed sample (its package run through lm-eval)."""
    out = []
    for c in cands:
        run = choice_run(c.package, questions, data, ep, c.label)
        out.append(replace(c, choice=choice_kl(ref_run, run)))
        say(f"  {c.label}: choice-KL {out[-1].choice.kl:.4g}, {out[-1].choice.flips} flips")
    return out


def best(steps: list[Candidate]) -> Candidate | None:
    """The measured step with the lowest token KL (fewer bytes among equals)."""
    return min(steps, key=lambda c: (c.token.kl, c.bytes_added)) if steps else None
