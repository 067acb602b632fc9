"""The sharding planner and dispatcher (engine/shard.py): pure Python, hand-made token lists."""

import random

import pytest

from ortevals.engine.shard import NO_GROUP, Dispatcher, merge, plan_shards
from ortevals.errors import OrtEvalsError


def mmlu_like(subjects=3, questions=(40, 25, 9), header=200, seed=0):
    """Subjects with their own few-shot header (all headers open with the same 12 tokens); each question
    has 4 one-token choices: requests (input tokens, unit key, subject)."""
    rng = random.Random(seed)
    common = tuple(range(1, 13))
    reqs = []
    for s in range(subjects):
        head = common + tuple(1000 * (s + 1) + t for t in range(header))
        for _q in range(questions[s]):
            body = tuple(rng.randrange(100_000, 200_000) for _ in range(rng.randrange(20, 80)))
            for choice in range(4):
                reqs.append((head + body + (choice,), head + body, s))
    rng.shuffle(reqs)  # lm-eval hands requests in its own order
    return reqs


def run_all(plan, workers, cost=lambda c: c.cost):
    """Simulated pull loop: the worker that frees up first takes the next chunk."""
    d = Dispatcher(plan.chunks)
    clock = {w: 0.0 for w in range(workers)}
    warm: dict[int, int] = {}
    ran = []
    while True:
        w = min(clock, key=lambda k: (clock[k], k))
        c = d.next(w)
        if c is None:
            break
        clock[w] += cost(c) + (c.prefix if warm.get(w) != c.group else 0)
        warm[w] = c.group
        ran.append((w, c))
    return ran, clock


def test_no_question_is_split_and_every_request_is_planned_once():
    reqs = mmlu_like()
    plan = plan_shards([r[0] for r in reqs], workers=4, units=[r[1] for r in reqs])
    where = {}
    for c in plan.chunks:
        for i in c.requests:
            assert i not in where
            where[i] = c.index
    assert sorted(where) == list(range(len(reqs)))
    by_unit = {}
    for i, (_, unit, _) in enumerate(reqs):
        by_unit.setdefault(unit, set()).add(where[i])
    assert all(len(chunks) == 1 for chunks in by_unit.values())


def test_groups_are_subjects_not_the_shared_opening_and_chunks_balance():
    reqs = mmlu_like()
    plan = plan_shards([r[0] for r in reqs], workers=4, units=[r[1] for r in reqs])
    subjects_of_group = {}
    for c in plan.chunks:
        subjects_of_group.setdefault(c.group, set()).update(reqs[i][2] for i in c.requests)
    assert NO_GROUP not in subjects_of_group
    assert sorted(len(s) for s in subjects_of_group.values()) == [1, 1, 1]  # one subject per group
    assert set(plan.prefix.values()) == {212}  # 12 common + 200 header tokens: the subject's header
    # the big subject is cut; no chunk is far above the target (twice it at most, plus one question)
    target = plan.suffix_cost / (4 * 8)
    assert len([c for c in plan.chunks if c.group == plan.chunks[0].group]) > 1
    assert max(c.cost for c in plan.chunks) <= 2 * target + 4 * 80


def test_dispatch_keeps_workers_on_their_subject_and_balances():
    reqs = mmlu_like(questions=(120, 90, 60))
    plan = plan_shards([r[0] for r in reqs], workers=3, units=[r[1] for r in reqs])
    ran, clock = run_all(plan, 3)
    per_worker_groups = {}
    for w, c in ran:
        per_worker_groups.setdefault(w, []).append(c.group)
    # a worker changes group only when its group has nothing left: changes <= groups + workers
    changes = sum(sum(1 for a, b in zip(g, g[1:]) if a != b) for g in per_worker_groups.values())
    assert changes <= 3 + 3
    assert sum(clock.values()) / 3 / max(clock.values()) >= 0.9
    # extra prefix work: prefixes computed beyond one per group
    starts = sum(1 + sum(1 for a, b in zip(g, g[1:]) if a != b) for g in per_worker_groups.values())
    assert starts - 3 <= 6


def test_merge_restores_order_drops_duplicates_and_names_a_missing_result():
    reqs = mmlu_like()
    plan = plan_shards([r[0] for r in reqs], workers=2, units=[r[1] for r in reqs])
    pieces = [(i, f"r{i}") for c in reversed(plan.chunks) for i in c.requests]
    pieces += [(i, "dup") for i in plan.chunks[0].requests]  # a chunk run twice after a restart
    assert merge(len(reqs), pieces) == [f"r{i}" for i in range(len(reqs))]
    with pytest.raises(OrtEvalsError, match=r"lost 1 of \d+ results \(first: request 5\)"):
        merge(len(reqs), [p for p in pieces if p[0] != 5])


def test_requeued_chunk_comes_back_first_for_its_group():
    reqs = mmlu_like()
    plan = plan_shards([r[0] for r in reqs], workers=2, units=[r[1] for r in reqs])
    d = Dispatcher(plan.chunks)
    first = d.next("a")
    d.requeue(first)  # worker a died mid-chunk
    assert d.next("a") == first  # a restarted worker (same group) takes it again
    assert first not in [c for cs in d.left.values() for c in cs]


def test_prompts_sharing_nothing_and_identical_prompts():
    prompts = [(i, i + 1, i + 2) for i in range(10)] * 3  # three samples of each prompt
    plan = plan_shards(prompts, workers=4)
    for c in plan.chunks:
        assert c.group == NO_GROUP and c.prefix == 0
    chunk_of = {i: c.index for c in plan.chunks for i in c.requests}
    for i in range(10):
        assert chunk_of[i] == chunk_of[i + 10] == chunk_of[i + 20]
    with pytest.raises(OrtEvalsError, match="workers must be > 0"):
        plan_shards(prompts, workers=0)
