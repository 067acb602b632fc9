"""Step-level search (engine/generate/search/steps.py, engine/generate/search/guided.py) against brute-force
references on a toy.

Sampled searches: the exact distribution of the answer, enumerated from the specification
(tests/fixtures/stepsearch_toy.py), against the answers of many seeded runs (scipy chi-square, alpha 1e-3;
cells with fewer than 5 expected runs pooled); mutated algorithms must fail the same check.
Choices: every iteration's kept beams, forks and final answer recomputed from the candidates the
PRM saw; particle filtering step for step against an independent trace of the documented draws.
Every PRM call checks that the decoder's rows hold the solutions it scores (the forks were right).
"""

import itertools
import math

import numpy as np
import pytest
from scipy.stats import chisquare

import ortevals.engine.generate.search.guided as ss
from ortevals.engine.generate.search.guided import SearchSettings, dvts, particle_filter, prm_beam_search, weighted_vote
from ortevals.engine.generate.search.steps import (
    SampleChooser,
    StepRows,
    StepRules,
    aggregate,
    fork_moves,
    text_separator,
)
from tests.fixtures.stepsearch_toy import (
    MAX_TOKENS,
    RULES,
    E,
    S,
    ToyModel,
    ToyPRM,
    answer_of,
    end_of,
    prm_value,
    probs,
    ref_beam,
    ref_dvts,
    ref_particles,
)

RUNS, ALPHA = 3000, 1e-3
BEAM = SearchSettings(n=4, width=2, max_steps=3, aggregation="min")
DVTS = SearchSettings(n=4, width=2, max_steps=3, aggregation="prod")
PF = SearchSettings(n=3, max_steps=3, aggregation="last")


def _pf(model, prompt, prm, rules, chooser, s, seed=0):
    return particle_filter(model, prompt, prm, rules, chooser, s, np.random.default_rng([seed, 2]))


def _run(search, s, seed, prm_cls=ToyPRM):
    model = ToyModel()
    prm = prm_cls(model)
    kw = {"seed": seed} if search is _pf else {}
    out = search(model, [9], prm, RULES, SampleChooser(np.random.default_rng([seed, 1])), s, **kw)
    return out, prm, model


def _answers(search, s, runs=RUNS) -> dict:
    seen: dict = {}
    for seed in range(runs):
        out = _run(search, s, seed)[0]
        key = out.solutions[out.best].tokens
        seen[key] = seen.get(key, 0) + 1
    return seen


def _p_value(exact: dict, seen: dict) -> float:
    """Chi-square of the observed answers against the exact distribution (cells under 5 pooled)."""
    assert set(seen) <= set(exact), f"answers the reference gives probability 0: {set(seen) - set(exact)}"
    runs = sum(seen.values())
    keys = sorted(exact, key=lambda k: -exact[k])
    expected = np.array([exact[k] * runs for k in keys])
    observed = np.array([seen.get(k, 0) for k in keys], dtype=float)
    big = expected >= 5
    if not big.all():
        observed = np.append(observed[big], observed[~big].sum())
        expected = np.append(expected[big], expected[~big].sum())
    return float(chisquare(observed, expected).pvalue)


def test_toy_prm_tells_solutions_apart():
    """The references treat particles as multisets: distinct solutions must never tie."""
    seqs = [s for n in range(1, MAX_TOKENS + 1) for s in itertools.product(range(3), repeat=n)]
    assert len({prm_value(s) for s in seqs}) == len(seqs)


@pytest.mark.parametrize(("search", "s", "reference"), [
    (prm_beam_search, BEAM, lambda: ref_beam(4, 2, 3, "min")),
    (dvts, DVTS, lambda: ref_dvts(4, 2, 3, "prod")),
    (_pf, PF, lambda: ref_particles(3, 3, "last")),
], ids=["beam", "dvts", "particles"])
def test_answer_distribution_equals_enumeration(search, s, reference):
    exact = reference()
    assert len(exact) > 20 and max(exact.values()) < 0.6  # a real spread of answers, not one likely path
    assert _p_value(exact, _answers(search, s)) > ALPHA


def test_particle_weighted_vote_distribution_equals_enumeration():
    """The weighted-majority answer of the final particles (weighted_vote over their weights)."""
    exact = ref_particles(3, 3, "last", vote=True)
    seen: dict = {}
    for seed in range(RUNS):
        out = _run(_pf, PF, seed)[0]
        answers = [answer_of(sol.tokens) for sol in out.solutions]
        key = answers[weighted_vote(answers, out.weights)]
        seen[key] = seen.get(key, 0) + 1
    assert len(exact) >= 4 and _p_value(exact, seen) > ALPHA


@pytest.mark.parametrize("mutant", ["bottom", "unweighted", "raw_reward", "hot"])
def test_mutations_fail_the_distribution_check(mutant, monkeypatch):
    """Keeping the worst beams, resampling without weights, or other weights: rejected."""
    if mutant == "bottom":
        monkeypatch.setattr(ss, "_keep_top", lambda scores, keep: sorted(np.argsort(scores, kind="stable")[:keep]))
        exact, seen = ref_beam(4, 2, 3, "min"), _answers(prm_beam_search, BEAM, 1000)
    elif mutant == "unweighted":
        monkeypatch.setattr(ss, "_resample", lambda rng, probs, n: rng.choice(len(probs), size=n))
        exact, seen = ref_particles(3, 3, "last"), _answers(_pf, PF, 1000)
    else:
        s = SearchSettings(n=3, max_steps=3, reward="raw") if mutant == "raw_reward" else \
            SearchSettings(n=3, max_steps=3, temperature=2.0)
        exact, seen = ref_particles(3, 3, "last"), _answers(_pf, s, 1000)
    assert _p_value(exact, seen) < ALPHA


def _ends(cands, final):
    """Why each candidate's last step ended, from the rules (None: it had not ended)."""
    return [end_of(c[-1], sum(map(len, c)), final) for c in cands]


def _score(cand, how, coarse=False) -> float:
    """A candidate's aggregated PRM score from the toy's step values (rounded: CoarsePRM)."""
    upto, scores = (), []
    for step in cand:
        upto += step
        scores.append(round(prm_value(upto), 1) if coarse else prm_value(upto))
    return {"last": scores[-1], "min": min(scores), "prod": math.prod(scores)}[how]


class CoarsePRM(ToyPRM):
    """Step scores rounded to one decimal: many ties, so tie rules are exercised."""

    def score(self, prompt, solutions):
        return [[round(x, 1) for x in row] for row in super().score(prompt, solutions)]


@pytest.mark.parametrize("prm_cls", [ToyPRM, CoarsePRM])
@pytest.mark.parametrize("sort_completed", [False, True])
def test_beam_choices_recomputed_from_candidates(prm_cls, sort_completed):
    s = SearchSettings(n=4, width=2, max_steps=3, aggregation="min", sort_completed=sort_completed)
    for seed in range(40):
        out, prm, _ = _run(prm_beam_search, s, seed, prm_cls)
        def score(c):
            return _score(c, "min", prm_cls is CoarsePRM)
        completed = []
        for t, cands in enumerate(prm.calls):
            ends = _ends(cands, t == s.max_steps - 1)
            assert None not in ends
            completed += [c for c, e in zip(cands, ends, strict=True) if e in ("eos", "length")]
            live = [c for c, e in zip(cands, ends, strict=True) if e not in ("eos", "length")]
            if t + 1 < len(prm.calls):
                order = sorted(range(len(live)), key=lambda i: (score(live[i]), i))  # ties: the later row
                kept = [live[i] for i in sorted(order[-2:])]
                assert [c[:-1] for c in prm.calls[t + 1]] == (kept * 4)[:4]
            else:
                assert not live
        if sort_completed:
            completed = sorted(completed, key=lambda c: -score(c))
        final = (completed[:4] * 4)[:4]
        assert [tuple(st.tokens for st in sol.steps) for sol in out.solutions] == final
        scores = [score(c) for c in final]
        assert out.best == scores.index(max(scores))


def test_dvts_choices_recomputed_from_candidates():
    for seed in range(40):
        out, prm, _ = _run(dvts, DVTS, seed)
        bases, last = [()] * 2, [None] * 2
        alive = [0, 1]
        for t, cands in enumerate(prm.calls):
            assert [c[:-1] for c in cands] == [bases[tr] for tr in alive for _ in range(2)]
            ends = _ends(cands, t == DVTS.max_steps - 1)
            still = []
            for j, tr in enumerate(alive):
                group = cands[2 * j:2 * j + 2]
                scores = [_score(c, "prod") for c in group]
                pick = scores.index(max(scores))
                bases[tr], last[tr] = group[pick], group
                if ends[2 * j + pick] not in ("eos", "length"):
                    still.append(tr)
            alive = still
        assert not alive
        final = [c for g in last for c in g]
        assert [tuple(st.tokens for st in sol.steps) for sol in out.solutions] == final
        scores = [_score(c, "prod") for c in final]
        assert out.best == scores.index(max(scores))


def _trace_pf(seed: int, n: int, steps: int) -> tuple[list[tuple[int, ...]], int, list[np.ndarray]]:
    """Particle filtering by hand: per decode pass one ``rng.random(live rows)`` and the inverse CDF of
    the toy's distribution; per iteration ``rng2.choice(n, n, p=softmax(logit(last PRM score)))``."""
    rng, rng2 = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 2])
    parts = [((), False)] * n  # (steps, finished)
    draws = []
    for it in range(steps):
        final = it == steps - 1
        running = [i for i, (_, done) in enumerate(parts) if not done]
        cur = {i: () for i in running}
        live = list(running)
        while live:
            u = rng.random(len(live))
            going = []
            for a, i in enumerate(live):
                ctx = sum(parts[i][0], ()) + cur[i]
                tok = int(np.searchsorted(np.cumsum(probs(ctx)), u[a], side="right"))
                cur[i] += (tok,)
                end = end_of(cur[i], len(ctx) + 1, final)
                if end is None:
                    going.append(i)
                else:
                    parts[i] = (parts[i][0] + (cur[i],), end in ("eos", "length"))
            live = going
        logw = np.array([math.log(prm_value(sum(p, ())) / (1 - prm_value(sum(p, ())))) for p, _ in parts])
        w = np.exp(logw - logw.max())
        drawn = rng2.choice(n, size=n, p=w / w.sum())
        draws.append(drawn)
        parts = [parts[j] for j in drawn]
        if all(done for _, done in parts):
            break
    logw = [prm_value(sum(p, ())) for p, _ in parts]
    return [sum(p, ()) for p, _ in parts], int(np.argmax(logw)), draws


def test_particle_filter_equals_hand_trace():
    for seed in range(60):
        out = _run(_pf, PF, seed)[0]
        tokens, best, _ = _trace_pf(seed, 3, 3)
        assert [sol.tokens for sol in out.solutions] == tokens
        assert out.best == best
        w = np.array([math.log(prm_value(t) / (1 - prm_value(t))) for t in tokens])
        np.testing.assert_allclose(out.weights, np.exp(w - w.max()) / np.exp(w - w.max()).sum(), rtol=1e-12)


def test_particle_filter_seed_3_by_hand():
    """Seed 3 traced by hand (A=0, S=1, E=2; u: the token generator's draws, v: the resampler's).

    Iteration 1: p(.|()) cdf [.315, .727, 1]; u .253 .407 .341 → A, S, S: particles 2 and 3 end
    their step [S]; particle 1 draws again, u .427 on p(.|A) cdf [.527, .827, 1] → A: step [A, A]
    (the 2-token cap). PRM .617, .264, .264 → logit .476, -1.023, -1.023 → softmax .691, .155, .155;
    v .026 .743 .813 → particles 0, 1, 1. Iteration 2: u .539 on p(.|AA) cdf [.104, .330, 1] → E;
    u .907 on p(.|S) cdf [.477, .847, 1] → E; u .329 → A, then u .522 on p(.|SA) cdf [.726, .871, 1]
    → A (cap). PRM of AAE .067 (logit -2.64), of SE .693 (.815): weight of AAE under .032 / 1.03;
    v .126 .0001 .045 → particles 1, 0, 1: all finished. Answer: SE, the first of largest weight."""
    out = _run(_pf, PF, 3)[0]
    assert [sol.tokens for sol in out.solutions] == [(S, E), (0, 0, E), (S, E)]
    assert out.best == 0
    tokens, best, draws = _trace_pf(3, 3, 3)
    assert (tokens, best, [d.tolist() for d in draws]) == ([(S, E), (0, 0, E), (S, E)], 0, [[0, 1, 1], [1, 0, 1]])


def test_greedy_is_the_greedy_path():
    """Temperature 0: every row follows argmax p; the solution is the greedy path cut by the rules."""
    path, steps, step = (), [], ()
    for _ in range(MAX_TOKENS):
        tok = int(np.argmax(probs(path + step)))
        step += (tok,)
        end = end_of(step, len(path) + len(step), len(steps) == BEAM.max_steps - 1)
        if end:
            steps.append(step)
            path, step = path + step, ()
            if end in ("eos", "length"):
                break
    model = ToyModel()
    out = prm_beam_search(model, [9], ToyPRM(model), RULES, SampleChooser(np.random.default_rng(0), 0.0), BEAM)
    assert {sol.tokens for sol in out.solutions} == {path}
    assert out.solutions[0].steps[-1].tokens == steps[-1]


def test_stepsearch_counts_work():
    out, prm, model = _run(prm_beam_search, BEAM, 5)
    assert out.scored == sum(len(c) for c in prm.calls)
    assert out.passes == model.calls
    assert out.scored_tokens == sum(len(t) for call in prm.calls for c in call for t in c)
    assert out.generated_tokens >= max(len(s.tokens) for s in out.solutions)


def test_fork_moves_in_place_equal_a_gather():
    """Every parents array on up to 4 rows (up to 5 new rows): the copies, run in order on one buffer,
    give rows[parents]; one copy per changed row plus one per cycle."""
    for rows in range(1, 5):
        for new in range(1, 6):
            for parents in itertools.product(range(rows), repeat=new):
                buf = list(range(rows)) + [None] * (max(rows, new) + 1 - rows)
                moves = fork_moves(parents, rows)
                for src, dst in moves:
                    assert buf[src] is not None
                    buf[dst] = buf[src]
                assert buf[:new] == list(parents)
                changed = [d for d, p in enumerate(parents) if p != d]
                assert len(moves) == len(changed) + _cycles(parents)


def _cycles(parents) -> int:
    seen, count = set(), 0
    for d in range(len(parents)):
        path, x = [], d
        while x < len(parents) and parents[x] != x and x not in seen and x not in path:
            path.append(x)
            x = parents[x]
        if x in path:
            count += 1
        seen.update(path)
    return count


def test_fork_moves_rejects_unknown_rows():
    with pytest.raises(ValueError, match="outside 0..1"):
        fork_moves([0, 2], 2)


def test_sample_chooser_is_the_inverse_cdf():
    logits = np.log(np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]]))
    chooser = SampleChooser(np.random.default_rng(4), temperature=1.0)
    u = np.random.default_rng(4).random(2)
    want = [int(np.searchsorted(np.cumsum(p), x, side="right")) for p, x in zip(np.exp(logits), u, strict=True)]
    assert chooser.choose(logits, np.arange(2)).tolist() == want
    hot = SampleChooser(np.random.default_rng(4), temperature=2.0).choose(logits, np.arange(2))
    p2 = np.sqrt(np.exp(logits))
    p2 /= p2.sum(axis=1, keepdims=True)
    assert hot.tolist() == [int(np.searchsorted(np.cumsum(p), x, side="right")) for p, x in zip(p2, u, strict=True)]
    assert SampleChooser(None, 0.0).choose(logits, np.arange(2)).tolist() == [1, 0]


def test_step_rows_wait_and_feed_lazily():
    """A row whose step ended is not fed until the next step; its last token is fed after the fork."""
    model = ToyModel()
    rows = StepRows(model, [9], 2, RULES, SampleChooser(np.random.default_rng(1)))
    first = rows.extend()
    assert [tuple(r) for r in model.rows] == [s.tokens[:-1] for s in first]
    assert all(s.end in ("sep", "cap", "eos", "length") for s in first)
    keep = [i for i, s in enumerate(first) if not s.finishes]
    if keep:
        rows.fork([keep[0]] * 2)
        rows.extend()
        assert model.rows[0][:len(first[keep[0]].tokens)] == list(first[keep[0]].tokens)
    with pytest.raises(ValueError, match="have finished"):
        r2 = StepRows(ToyModel(), [9], 1, StepRules(frozenset({0, 1, 2}), lambda s: False), SampleChooser(None, 0))
        r2.extend()
        r2.extend()


def test_aggregate_and_separator():
    assert aggregate([0.9, 0.2, 0.5], "last") == 0.5
    assert aggregate([0.9, 0.2, 0.5], "min") == 0.2
    assert aggregate([0.9, 0.2, 0.5], "prod") == pytest.approx(0.09)
    with pytest.raises(ValueError, match="no step score"):
        aggregate([], "last")
    with pytest.raises(ValueError, match="unknown PRM aggregation"):
        aggregate([1.0], "mean")
    pieces = {1: "x", 2: ".\n", 3: "\n", 4: ".\n\n"}
    ends = text_separator(lambda ids: "".join(pieces[i] for i in ids))
    assert not ends((1, 2)) and ends((1, 2, 3)) and ends((4,)) and not ends((1, 3))


def test_weighted_vote_by_hand():
    assert weighted_vote(["a", "b", "b", "a"], [0.9, 0.4, 0.4, 0.0]) == 0  # a: 0.9 > b: 0.8
    assert weighted_vote(["a", "b", "b"], [0.8, 0.4, 0.4]) == 0  # tie 0.8 = 0.8: a seen first
    assert weighted_vote([None, "b", "a", "b"], [5.0, 0.1, 0.3, 0.1]) == 2
    assert weighted_vote([None, None], [1.0, 1.0]) is None


def test_bad_settings_and_prm_replies():
    with pytest.raises(ValueError, match="multiple of the beam width"):
        _run(prm_beam_search, SearchSettings(n=3, width=2), 0)
    with pytest.raises(ValueError, match="aggregation"):
        _run(dvts, SearchSettings(n=4, width=2, aggregation="mean"), 0)

    class Short(ToyPRM):
        def score(self, prompt, solutions):
            return [row[:-1] for row in super().score(prompt, solutions)]

    with pytest.raises(ValueError, match="step scores for solutions of"):
        _run(prm_beam_search, BEAM, 0, Short)

    class Big(ToyPRM):
        def score(self, prompt, solutions):
            return [[3.0 * x for x in row] for row in super().score(prompt, solutions)]

    with pytest.raises(ValueError, match=r"PRM scores in \[0, 1\]"):
        _run(_pf, SearchSettings(n=3, max_steps=3), 0, Big)
    assert _run(_pf, SearchSettings(n=3, max_steps=3, reward="raw"), 0, Big)[0].best >= 0
    assert S != E
