"""Decode rows on one shared prompt KV (issue 26, cascade attention: runtime/cascade.py,
engine/generate/rows/cascade_kv.py).

The cascade decode graph against a plain onnxruntime session on the package's unmodified decoder
(each row's whole sequence in one pass: no ortevals code in the oracle), at 1, 4 and 16 rows, with
rows leaving; the sampler's samples token-equal to the current path (rows stopping early, prompts
sharing a prefix, host and device KV); the prompt read from one ``[1,H,P,D]`` copy that every pass
binds as it is, no replicated arena; refusals fall back (auto) or are one-line errors (on)."""

import functools

import numpy as np
import onnx
import pytest

from ortevals.engine.generate.choice.settings import parse_gen_kwargs
from ortevals.engine.generate.rows.cascade_kv import Cascade, CascadeKV, SharedRows
from ortevals.engine.generate.rows.kv import CopyKV, DeviceKV, InplaceKV
from ortevals.engine.generate.rows.sampler import SharedPromptSampler
from ortevals.errors import OrtEvalsError
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from ortevals.runtime.cascade import PROMPT_KEY, Refused, cascade_decoder
from ortevals.runtime.providers import ProviderConfig
from ortevals.runtime.sessions import DecoderRunner
from tests.test_sampler import raw_ort_logprobs, repeats

PROMPT = "Question: what is the river of the city? Answer: the river"
HEADER = "Question: one two three. Answer: four five six seven eight nine ten.\n\n"
SAMPLED = {"until": [], "max_gen_toks": 24, "do_sample": True, "temperature": 0.7}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cascade-cache")


@pytest.fixture(scope="module")
def raw(tiny_pkg):
    return OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="raw", cascade="off"))


def holder(runner, cache, mode="on", device=False) -> CascadeKV:
    base = DeviceKV(runner) if device else InplaceKV(runner)
    return CascadeKV(base, CopyKV(runner), Cascade(mode, functools.partial(runner.cascade, ProviderConfig("cpu"),
                                                                           cache)))


def sampler(lm, cache, mode="on", **kw) -> SharedPromptSampler:
    base = lm.run.generation.sampler()
    cascade = Cascade(mode, functools.partial(base.runner.cascade, lm.backends.provider, cache))
    return SharedPromptSampler(base.runner, lm.tokenizer, base.eos_ids, cascade=cascade, **kw)


def rows(s, lm, prompt: str, kwargs: dict, seeds) -> list:
    settings = parse_gen_kwargs(kwargs, 24, lm.tok_decode([lm.eot_token_id]))
    logits, past = s.prompt(tuple(lm.tok_encode(prompt)), settings.max_gen_toks)
    return s.decode(logits, past, settings, [np.random.default_rng(x) for x in seeds], ["r"] * len(seeds))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def teacher_forced(kv, prompt: np.ndarray, tokens: np.ndarray, leave_after: int, shared: bool):
    """Log-softmax of every decode step of ``tokens [R, steps]`` after ``prompt``, rows 1 and 3 leaving
    after ``leave_after`` steps: ``{(row, step): [V]}``. ``shared``: rows on one prompt KV (cascade)."""
    n, steps = tokens.shape
    logits, past = kv.run(prompt[None], kv.empty(1, prompt.size + steps + 1), last=True)
    past = kv.share(past, n) if shared else kv.repeat(past, n)
    live, out = list(range(n)), {}
    for s in range(steps):
        if s == leave_after and n >= 4:
            keep = [b for b, r in enumerate(live) if r not in (1, 3)]
            past, live = kv.keep(past, keep), [live[b] for b in keep]
        logits, past = kv.run(tokens[live, s:s + 1], past)
        out.update({(r, s): log_softmax(logits[b]) for b, r in enumerate(live)})
    return out


def oracle_errors(pkg, got: dict, prompt: np.ndarray, tokens: np.ndarray) -> float:
    """Largest |Δ log-prob| of ``got`` against each row's whole sequence in one plain onnxruntime pass."""
    worst = 0.0
    for r in {r for r, _ in got}:
        logp = raw_ort_logprobs(pkg, [*prompt.tolist(), *tokens[r].tolist()])
        for (row, s), lp in got.items():
            if row == r:
                worst = max(worst, float(np.abs(lp - logp[prompt.size + s]).max()))
    return worst


# --- the graph against a raw onnxruntime oracle on the unmodified decoder -----------------------------

@pytest.mark.parametrize("n", [1, 4, 16])
def test_cascade_logprobs_equal_a_raw_onnxruntime_oracle(tiny_pkg, cache, n):
    runner = DecoderRunner.open(ModelPackage.load(tiny_pkg), ProviderConfig("cpu"))
    kv = holder(runner, cache)
    assert kv.ready()
    rng = np.random.default_rng(n)
    prompt, tokens = rng.integers(3, 512, 37), rng.integers(3, 512, (n, 6))
    got = teacher_forced(kv, prompt, tokens, leave_after=3, shared=True)
    assert len(got) == n * 6 - (2 * 3 if n >= 4 else 0)  # rows 1 and 3 left after 3 steps
    assert oracle_errors(tiny_pkg, got, prompt, tokens) <= 1e-5


@pytest.mark.slow
def test_cascade_logprobs_on_smollm2_are_as_close_to_the_oracle_as_the_current_path(smollm2, cache):
    """fp32 SmolLM2: the current path (each row its own prompt copy) is itself a few 1e-5 from the one-pass
    oracle (the sums run in another order); the cascade graph stays within twice that and 1e-4."""
    pkg = smollm2[1]
    runner = DecoderRunner.open(ModelPackage.load(pkg), ProviderConfig("cpu"))
    kv = holder(runner, cache)
    assert kv.ready()
    rng = np.random.default_rng(0)
    prompt, tokens = rng.integers(3, 49152, 300), rng.integers(3, 49152, (4, 5))
    cascade = oracle_errors(pkg, teacher_forced(kv, prompt, tokens, 2, shared=True), prompt, tokens)
    current = oracle_errors(pkg, teacher_forced(kv.base, prompt, tokens, 2, shared=False), prompt, tokens)
    assert cascade <= max(1e-5, 2 * current) and cascade <= 1e-4, (cascade, current)


def teacher_forced_pair(kv, prompts: list, tokens: list, leave: dict) -> list[dict]:
    """Two prompts' rows decoded together on the cascade graph (teacher-forced ``tokens[g] [R_g, steps]``),
    ``leave[step]``: (group, row) pairs that leave before that step → per group ``{(row, step): log-softmax}``."""
    started = [kv.run(p[None], kv.empty(1, p.size + t.shape[1] + 1), last=True)[1] for p, t in zip(prompts, tokens)]
    past = kv.share(started[0], tokens[0].shape[0], started[1], tokens[1].shape[0])
    live = [(g, r) for g, t in enumerate(tokens) for r in range(t.shape[0])]
    out = [{}, {}]
    for s in range(tokens[0].shape[1]):
        if s in leave:
            keep = [b for b, x in enumerate(live) if x not in leave[s]]
            past, live = kv.keep(past, keep), [live[b] for b in keep]
        ids = np.asarray([[tokens[g][r, s]] for g, r in live])
        logits, past = kv.run(ids, past)
        for b, (g, r) in enumerate(live):
            out[g][(r, s)] = log_softmax(logits[b])
    return out


@pytest.mark.parametrize("lengths", [(37, 21), (21, 37), (29, 29)])
def test_two_prompts_decoded_together_equal_a_raw_onnxruntime_oracle(tiny_pkg, cache, lengths):
    """The rows of two prompts in one pass (the graph's two groups), prompts of different lengths either way
    round, rows leaving from both groups and one group emptied, against each row's whole sequence in one plain
    onnxruntime pass; and bit-equal to the same rows decoded one prompt at a time (a row's numbers do not
    depend on the rows beside it)."""
    runner = DecoderRunner.open(ModelPackage.load(tiny_pkg), ProviderConfig("cpu"))
    kv = holder(runner, cache)
    assert kv.ready()
    rng = np.random.default_rng(lengths[0])
    prompts = [rng.integers(3, 512, n) for n in lengths]
    tokens = [rng.integers(3, 512, (4, 6)), rng.integers(3, 512, (3, 6))]
    got = teacher_forced_pair(kv, prompts, tokens, {2: [(0, 1), (1, 0)], 4: [(1, 1), (1, 2)]})
    assert [len(g) for g in got] == [4 * 6 - 4, 3 * 6 - 4 - 2 * 2]
    for g in range(2):
        assert oracle_errors(tiny_pkg, got[g], prompts[g], tokens[g]) <= 1e-5
    alone = teacher_forced(kv, prompts[0], tokens[0], leave_after=99, shared=True)
    assert all(np.array_equal(got[0][k], alone[k]) for k in got[0])


def test_a_rows_numbers_do_not_depend_on_how_many_rows_share_its_prompt(tiny_pkg, cache):
    """A 700-token prompt (onnxruntime's CPU GEMM sums K in blocks of 128 to 1024, wider as N shrinks):
    rows 0 and 1 bit-equal whether 16 rows or 2 read the prompt. Fails when the rows sit in the GEMM's N (the
    prompt part as ``V^T x probs``: the sum over the prompt blocked by the row count)."""
    runner = DecoderRunner.open(ModelPackage.load(tiny_pkg), ProviderConfig("cpu"))
    kv = holder(runner, cache)
    assert kv.ready()
    rng = np.random.default_rng(7)
    prompt, tokens = rng.integers(3, 512, 700), rng.integers(3, 512, (16, 4))
    many = teacher_forced(kv, prompt, tokens, leave_after=99, shared=True)
    few = teacher_forced(kv, prompt, tokens[:2], leave_after=99, shared=True)
    assert all(np.array_equal(many[k], few[k]) for k in few) and len(few) == 2 * 4


# --- the sampler: token-equal to the current path -------------------------------------------------------

@pytest.mark.parametrize("k", [1, 4, 16])
def test_samples_equal_the_current_path_with_rows_leaving(raw, cache, k):
    seeds = list(range(100, 100 + k))
    free = rows(sampler(raw, cache, "off"), raw, PROMPT, SAMPLED, seeds)
    stop = free[0].text[len(free[0].text) // 3:][:2]  # rows that print it stop early, the others run on
    cut = {**SAMPLED, "until": [stop]}
    off, s = sampler(raw, cache, "off"), sampler(raw, cache, "on")
    want, got = rows(off, raw, PROMPT, cut, seeds), rows(s, raw, PROMPT, cut, seeds)
    assert [g.ids for g in got] == [w.ids for w in want]
    assert np.allclose([g.logprob for g in got], [w.logprob for w in want], atol=1e-4, rtol=0)
    assert ("cascade" in s.kv_rows.name) == (k > 1)  # one row reads its prompt once anyway
    if k > 1:
        assert got[0].tokens < 24 and max(g.tokens for g in got) > got[0].tokens  # rows really left early
        assert s.stats["row_steps"] == sum(g.tokens - 1 for g in got)


def test_two_questions_decode_together_and_give_the_current_paths_samples(raw, cache):
    """Two sampled prompts of different lengths (jobs in a row) decode in one batch on the cascade graph, rows
    stopping early in both, with fewer passes than one prompt at a time: every sample token-equal to the
    current path's (each row its own copy of the prompt, one prompt at a time)."""
    from ortevals.engine.generate.rows.sampler import plan_jobs, run_sampling

    def run(mode: str, until: list) -> tuple:
        st = parse_gen_kwargs({**SAMPLED, "until": until}, 24, raw.tok_decode([raw.eot_token_id]))
        items = [(tuple(raw.tok_encode(p)), st) for p in (PROMPT, HEADER + PROMPT) for _ in range(4)]
        s, done = sampler(raw, cache, mode), {}
        run_sampling(s, items, [[i // 4, i % 4] for i in range(len(items))], done.__setitem__, str)
        return s, items, [done[i] for i in range(len(items))]

    free = run("off", [])[2]
    stop = [free[0].text[len(free[0].text) // 3:][:2], free[5].text[len(free[5].text) // 2:][:2]]
    out = {mode: run(mode, stop) for mode in ("off", "on")}
    s, items = out["on"][0], out["on"][1]
    out = {mode: (x[0], [d.ids for d in x[2]]) for mode, x in out.items()}
    s = out["on"][0]
    assert [len(p) for p in s.streams(plan_jobs(items))] == [2]
    assert out["on"][1] == out["off"][1]
    lens = [len(x) for x in out["on"][1]]
    assert min(lens[:4]) < 24 and min(lens[4:]) < 24 and max(lens) == 24  # rows of both stopped early
    assert len(set(out["on"][1])) >= 6
    assert s.stats["decode_passes"] < out["off"][0].stats["decode_passes"]


def test_prompts_join_a_running_batch_and_give_the_current_paths_samples(raw, cache):
    """Sampled prompts of different lengths, three rows each, rows ending at different steps: more prompts
    than the graph takes at once, so later ones join the batch while earlier rows are still running (a new
    group beside groups already holding tokens). Every sample token-equal to the current path's."""
    from ortevals.runtime.cascade import GROUPS

    prompts = [" ".join(["word"] * (3 + 5 * j)) + f" {PROMPT}" for j in range(GROUPS + 3)]
    early, late = [" ", "a", "e", "i", "t"], []  # common letters end a row within a few tokens

    def run(mode: str) -> tuple:
        from ortevals.engine.generate.rows.sampler import run_sampling

        eot = raw.tok_decode([raw.eot_token_id])
        st = [parse_gen_kwargs({**SAMPLED, "until": u}, 24, eot) for u in (early, late)]
        items = [(tuple(raw.tok_encode(p)), st[j % 2]) for j, p in enumerate(prompts) for _ in range(3)]
        s, done = sampler(raw, cache, mode), {}
        run_sampling(s, items, [[i // 3, i % 3] for i in range(len(items))], done.__setitem__, str)
        return s, [done[i].ids for i in range(len(items))]

    joined = []
    join = CascadeKV.join

    def spy(self, past, prompt, n):
        joined.append((len(past.counts), max(past.lengths, default=0)))
        return join(self, past, prompt, n)

    off, want = run("off")
    CascadeKV.join = spy
    try:
        on, got = run("on")
    finally:
        CascadeKV.join = join
    assert got == want
    assert len({len(x) for x in got}) >= 3  # rows end at different steps
    assert max(n for n, _ in joined) == GROUPS - 1  # the graph filled
    assert any(held > 0 for _, held in joined)  # a prompt joined rows already decoding
    assert on.stats["decode_passes"] < off.stats["decode_passes"] / 2


def test_tokens_chosen_on_several_threads_give_the_same_samples(raw, cache):
    """The decode loop cuts the live rows into pieces of consecutive rows, each chosen on its own thread, a cut
    falling inside a prompt's rows (three rows a prompt, pieces of 8 and more): every sample (ids, text,
    log-prob, self-certainty) bit-equal to one thread's, with and without a repetition penalty (each row's
    history)."""
    from ortevals.engine.generate.rows.batch import PIECE_ROWS
    from ortevals.engine.generate.rows.sampler import run_sampling

    prompts = [" ".join(["word"] * (2 + 3 * j)) + f" {PROMPT}" for j in range(11)]
    eot = raw.tok_decode([raw.eot_token_id])
    st = [parse_gen_kwargs(SAMPLED, 24, eot), parse_gen_kwargs({**SAMPLED, "repetition_penalty": 1.3}, 24, eot)]
    items = [(tuple(raw.tok_encode(p)), st[j % 2]) for j, p in enumerate(prompts) for _ in range(3)]
    cuts = []

    def run(threads: int) -> list:
        s, done = sampler(raw, cache, "on", threads=threads), {}
        run_sampling(s, items, [[i // 3, i % 3] for i in range(len(items))], done.__setitem__, str)
        return [(d.ids, d.text, d.logprob, d.certainty, d.eos) for d in (done[i] for i in range(len(items)))]

    from ortevals.engine.generate.rows import batch as rowsteps

    choose = rowsteps.RowSteps._choose

    def spy(self, step_logits, spans):
        cuts.append(min(self.threads, int(spans[-1]) // PIECE_ROWS))
        return choose(self, step_logits, spans)

    want = run(1)
    rowsteps.RowSteps._choose = spy
    try:
        got = run(4)
    finally:
        rowsteps.RowSteps._choose = choose
    assert got == want
    assert max(cuts) >= 3  # three pieces at once: 24 rows, cut inside the third and sixth prompts' rows


def test_prompts_sharing_a_prefix_equal_the_current_path(raw, cache):
    prompts = [HEADER + "Question: the city of Paris? Answer:", HEADER + "Question: the river Seine? Answer:"]
    got = {}
    for mode in ("off", "on"):
        s = sampler(raw, cache, mode)
        got[mode] = [tuple(r.ids for r in rows(s, raw, p, SAMPLED, [1, 2, 3, 4])) for p in prompts]
        assert s.stats["reused_tokens"] > 16  # the second prompt ran on the first one's KV cut to the header
    assert got["on"] == got["off"]


def test_device_kv_path_decodes_two_prompts_together_as_the_oracle(tiny_pkg, cache):
    """Two prompts' rows in one pass with the KV in OrtValues (the GPU's code path, on device 'cpu'): each prompt
    copied once on the device, the rows' arenas bound by pointer, rows leaving from both groups."""
    runner = DecoderRunner.open(ModelPackage.load(tiny_pkg), ProviderConfig("cpu"), io_binding=True)
    kv = holder(runner, cache, device=True)
    assert kv.ready()
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 512, 23), rng.integers(3, 512, 14)]
    tokens = [rng.integers(3, 512, (3, 5)), rng.integers(3, 512, (2, 5))]
    got = teacher_forced_pair(kv, prompts, tokens, {2: [(0, 1), (1, 0)]})
    for g in range(2):
        assert oracle_errors(tiny_pkg, got[g], prompts[g], tokens[g]) <= 1e-5


def test_device_kv_path_equals_the_current_path(tiny_pkg, cache):
    """KV in OrtValues bound through IOBinding (a GPU's code path, on device 'cpu'): the prompt copied once
    on the device, the rows' arenas bound by pointer."""
    runner = DecoderRunner.open(ModelPackage.load(tiny_pkg), ProviderConfig("cpu"), io_binding=True)
    kv = holder(runner, cache, device=True)
    rng = np.random.default_rng(5)
    prompt, tokens = rng.integers(3, 512, 21), rng.integers(3, 512, (4, 5))
    got = teacher_forced(kv, prompt, tokens, 2, shared=True)
    want = teacher_forced(kv.base, prompt, tokens, 2, shared=False)
    assert "cascade" in kv.name and got.keys() == want.keys()
    assert max(float(np.abs(got[k] - want[k]).max()) for k in got) <= 1e-5


@pytest.mark.slow
def test_smollm2_sixteen_samples_equal_the_current_path(smollm2, cache):
    lm = OrtLM.from_package(ModelArgs(pkg=str(smollm2[1]), gen_path="raw", cascade="off"))
    prompt = ("The following are questions about history. Think step by step.\n\n" * 12
              + "Question: Why did the Roman Empire fall? Answer: Let's think step by step.")
    kwargs = {"until": ["Question:"], "max_gen_toks": 32, "do_sample": True, "temperature": 0.7}
    want = rows(sampler(lm, cache, "off"), lm, prompt, kwargs, range(16))
    s = sampler(lm, cache, "on")
    got = rows(s, lm, prompt, kwargs, range(16))
    assert "cascade" in s.kv_rows.name
    assert [g.ids for g in got] == [w.ids for w in want] and len({g.ids for g in got}) >= 8


def test_the_front_door_option_gives_the_same_texts(tiny_pkg, raw):
    reqs = repeats([PROMPT, "The capital of France is"], SAMPLED, 4)
    on = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="raw", cascade="on"))
    assert on.generate_until(reqs, disable_tqdm=True) == raw.generate_until(reqs, disable_tqdm=True)
    assert "cascade" in on.run.generation.sampler().kv_rows.name
    # the summary's mode line says the rows shared the prompt (summed in another order than the current path)
    assert "one shared prompt KV (cascade" in on.run.stats["mode"]
    assert "cascade" not in raw.run.stats["mode"]


# --- the prompt is read from one copy ---------------------------------------------------------------------

def test_the_prompt_kv_is_one_row_bound_by_every_pass_and_no_arena_holds_it(tiny_pkg, cache):
    package = ModelPackage.load(tiny_pkg)
    graph = onnx.load(str(cascade_decoder(package, cache)), load_external_data=False).graph
    prompt_inputs = [i for i in graph.input if i.name.startswith("ortevals_prompt.")]
    assert len(prompt_inputs) == 2 * len(package.kv)
    dims = {(i.name.rsplit(".", 1)[1], *(d.dim_value for d in i.type.tensor_type.shape.dim)) for i in prompt_inputs}
    assert dims == {("key", 2, 0, 16), ("value", 2, 0, 16)}  # [H,P,D]
    kv = holder(DecoderRunner.open(package, ProviderConfig("cpu")), cache)
    assert kv.ready()
    bound = []
    forward = kv.runner.forward_inplace

    def spy(ids, past, positions=None, prompts=None):
        ((prompt, rows, _),) = prompts
        assert rows == ids.shape[0]
        bound.append([id(t) for pair in prompt.layers for t in pair])
        assert all(t.shape[0] == 1 and t.flags.c_contiguous for pair in prompt.layers for t in pair)
        return forward(ids, past, positions, prompts)

    kv.runner.forward_inplace = spy
    k, p, new = 16, 29, 10
    _, past = kv.run(np.arange(3, 3 + p)[None], kv.empty(1, p + new + 1), last=True)
    held = kv.repeat(past, k)
    assert isinstance(held, SharedRows) and [t.shape for t in held.prompts[0].layers[0]] == [(1, 2, p, 16)] * 2
    for _ in range(new - 1):
        _, held = kv.run(np.full((k, 1), 7), held)
    assert len(bound) == new - 1 and all(b == bound[0] for b in bound)  # the same arrays, never copied again
    # the arenas hold each row's own tokens only: 2 layers x (K, V) x 16 rows x 2 heads x (10 + 1) x 16
    # floats, plus a quarter of headroom; the current path's arenas held 16 copies of the 29-token prompt too
    rows_bytes = 2 * 2 * 16 * 2 * (new + 1) * 16 * 4
    assert kv.held_bytes() == rows_bytes + rows_bytes // 4


def test_a_streams_prompts_are_read_where_their_prompt_pass_wrote_them(raw, cache):
    """Several sampled prompts decoded together: each group's prompt KV is the buffer its prompt pass wrote
    (allocated to the prompt's length, no room: the rows' tokens live in the arenas), not a copy of it, and the
    samples are the current path's."""
    from ortevals.engine.generate.rows.sampler import run_sampling

    eot = raw.tok_decode([raw.eot_token_id])
    st = parse_gen_kwargs(SAMPLED, 24, eot)
    prompts = [tuple(raw.tok_encode(" ".join(["word"] * (2 + j)) + f" {PROMPT}")) for j in range(3)]
    items = [(p, st) for p in prompts for _ in range(2)]
    written, pairs = {}, []
    join, prompt = CascadeKV.join, SharedPromptSampler.prompt

    def spy_prompt(self, *args, **kw):
        logits, kv = prompt(self, *args, **kw)
        written[id(kv)] = kv
        return logits, kv

    def spy_join(self, past, kv, n):
        out = join(self, past, kv, n)
        if id(kv) in written:  # a prompt pass's KV (not the graph's own self-check)
            pairs.extend(zip((t for pair in kv.layers for t in pair),
                             (t for pair in out.prompts[-1].layers for t in pair), strict=True))
        return out

    def run(mode: str) -> list:
        s, done = sampler(raw, cache, mode), {}
        run_sampling(s, items, [[i // 2, i % 2] for i in range(len(items))], done.__setitem__, str)
        return [done[i].ids for i in range(len(items))]

    want = run("off")
    CascadeKV.join, SharedPromptSampler.prompt = spy_join, spy_prompt
    try:
        got = run("on")
    finally:
        CascadeKV.join, SharedPromptSampler.prompt = join, prompt
    assert got == want
    assert len(pairs) >= 3 * 2 * len(raw.run.package.kv)
    assert all(bound is kv for kv, bound in pairs)


# --- refusals ------------------------------------------------------------------------------------------

def edited(copy_pkg, tiny_pkg, change):
    pkg = copy_pkg(tiny_pkg)
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    change(model.graph)
    onnx.save(model, str(pkg / "model.onnx"))
    return pkg


def set_attr(name, value):
    def change(graph):
        for node in graph.node:
            if node.op_type == "GroupQueryAttention":
                for a in node.attribute:
                    if a.name == name:
                        a.CopyFrom(onnx.helper.make_attribute(name, value))
    return change


def past_through_identity(graph):
    node = next(n for n in graph.node if n.op_type == "GroupQueryAttention")
    graph.node.insert(0, onnx.helper.make_node("Identity", [node.input[3]], ["copied_past"]))
    node.input[3] = "copied_past"


@pytest.mark.parametrize("change, why", [
    (set_attr("local_window_size", 8), "sliding window of 8 tokens"),
    (set_attr("softcap", 30.0), "softcap=30.0"),
    (past_through_identity, "past KV past_key_values.0.key feeds Identity input 0, not one GroupQueryAttention"),
])
def test_graphs_it_cannot_rewrite_exactly_keep_the_current_path(copy_pkg, tiny_pkg, cache, caplog, change, why):
    pkg = edited(copy_pkg, tiny_pkg, change)
    with pytest.raises(Refused, match=why):
        cascade_decoder(ModelPackage.load(pkg), cache)
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=256, gen_path="raw"))
    s = sampler(lm, cache, "auto")
    with caplog.at_level("INFO", logger="ortevals.engine.generate.rows.cascade_kv"):
        got = [rows(s, lm, PROMPT, SAMPLED, [1, 2, 3]) for _ in range(2)]
    assert [r.ids for r in got[0]] == [r.ids for r in rows(sampler(lm, cache, "off"), lm, PROMPT, SAMPLED, [1, 2, 3])]
    assert caplog.text.count("each decode row keeps its own copy") == 1 and why in caplog.text
    assert "cascade off: " in s.kv_rows.name
    with pytest.raises(OrtEvalsError, match=f"^cascade=on is impossible for this package: .*{why}") as e:
        rows(sampler(lm, cache, "on"), lm, PROMPT, SAMPLED, [1, 2, 3])
    assert "\n" not in str(e.value)


def test_a_bad_cascade_value_is_one_line():
    with pytest.raises(OrtEvalsError, match=r"^cascade must be one of auto, on, off, got 'maybe'$"):
        ModelArgs.parse({"pkg": "x", "cascade": "maybe"})


def test_the_graph_is_cached_under_a_scope_of_what_the_rewrite_reads(tiny_pkg, cache):
    import json

    package = ModelPackage.load(tiny_pkg)
    path = cascade_decoder(package, cache)
    stamp = path.stat().st_mtime_ns
    assert cascade_decoder(package, cache) == path and path.stat().st_mtime_ns == stamp  # built once
    scope = json.loads((path.parent / "scope.json").read_text())
    assert scope["purpose"] == "cascade" and list(scope["files"]) == ["model.onnx"]  # the graph, not the weights
    assert not (path.parent / "model.onnx.data").exists() and PROMPT_KEY % 0 in {
        i.name for i in onnx.load(str(path), load_external_data=False).graph.input}


def test_auto_declines_a_second_session_that_would_take_half_the_free_memory(tiny_pkg, cache, caplog):
    from ortevals.engine.generate.rows.cascade_kv import decoder_bytes

    package = ModelPackage.load(tiny_pkg)
    runner = DecoderRunner.open(package, ProviderConfig("cpu"))
    cost = decoder_bytes(package)
    assert cost == sum(f.stat().st_size for f in (tiny_pkg / "model.onnx", tiny_pkg / "model.onnx.data"))
    opener = functools.partial(runner.cascade, ProviderConfig("cpu"), cache)
    for mode, free, used in (("auto", 2 * cost - 1, False), ("auto", 2 * cost, True), ("on", cost, True)):
        kv = CascadeKV(InplaceKV(runner), CopyKV(runner), Cascade(mode, opener, cost, lambda f=free: f))
        with caplog.at_level("INFO", logger="ortevals.engine.generate.rows.cascade_kv"):
            assert kv.ready() == used
    mib = cost / 2**20
    assert caplog.text.count("each decode row keeps its own copy") == 1
    assert f"cascade: a second session of the decoder ({mib:.1f} MiB of weights) would take more than half of " \
        f"the {(2 * cost - 1) / 2**20:.1f} MiB free; each decode row" in caplog.text


def test_cascade_passes_are_metered_with_the_run(tiny_pkg):
    """Issue 38 item 8: the cascade runner kept a meter of its own, so a run's decode tokens/s and TPOT
    described only the passes outside it (the canary's 24 tokens beside 246 generated). Every generated token
    after a row's first comes from a decode pass, so the run's meter counts at least that many decode rows, on
    either path (more: rows that finished ride along, and the one-time checks of the KV kind and the graph)."""
    reqs = repeats([PROMPT, "The capital of France is"], SAMPLED, 4)
    for mode in ("on", "off"):
        lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="raw", cascade=mode,
                                          check=False))
        before = lm.backends.meter.counts()
        lm.generate_until(reqs, disable_tqdm=True)
        after = lm.backends.meter.counts()
        assert ("cascade off" not in lm.run.generation.sampler().kv_rows.name) == (mode == "on")
        decode = after.decode_tokens - before.decode_tokens
        assert decode >= lm.stats["generated_tokens"] - len(reqs) > 100, (mode, decode, lm.stats)
        assert after.decode_row_seconds > before.decode_row_seconds


def test_device_kv_buffers_start_at_zero_whatever_the_memory_held(tiny_pkg, monkeypatch):
    """Fresh device memory holds whatever was there before (cudaMalloc and onnxruntime's arena do not clear it:
    here it holds NaN bits). GroupQueryAttention never writes the positions past a row's length, and on an H200
    a kernel handed the buffer's whole width (onnxruntime's cuDNN SDPA) turned such bits into NaN outputs: the
    device holder clears each new buffer, as onnxruntime-genai does, and keeps NaN only while it checks."""
    from ortevals.runtime import buffers

    runner = DecoderRunner.open(ModelPackage.load(tiny_pkg), ProviderConfig("cpu"), io_binding=True)
    allocate = buffers.device_buffer

    def stale(*args, **kwargs):
        view = allocate(*args, **kwargs)
        buffers.fill_nan(view)
        return view

    monkeypatch.setattr(buffers, "device_buffer", stale)
    kv = DeviceKV(runner)
    host_zeros = []  # the zeros are written where the buffer lives, not copied from a host array of its size
    write = buffers.import_ort().OrtValue.update_inplace

    def from_host(value, array):
        host_zeros.extend([array.nbytes] if not array.any() else [])
        write(value, array)

    monkeypatch.setattr(buffers.import_ort().OrtValue, "update_inplace", from_host)
    held = [t.owner.numpy() for pair in kv.empty(2, 8).layers for t in pair]
    assert held and all(np.all(a == 0) for a in held)
    assert host_zeros == []
    kv.poison = True
    assert all(np.isnan(t.owner.numpy()).all() for pair in kv.empty(2, 8).layers for t in pair)
