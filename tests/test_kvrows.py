"""The sampler's decode KV (engine/generate/rows/kv.py, issue 20 §1): the memory a batch really needs and the
rows chosen from the free memory; device KV kept in place (bound by pointer as past and present),
proven on CPU through the same OrtValue code path a device takes (``bind_device='cpu'``)."""

from types import SimpleNamespace

import numpy as np
import pytest

from ortevals.engine.generate.choice.settings import parse_gen_kwargs
from ortevals.engine.generate.rows.kv import CopyKV, InplaceKV
from ortevals.engine.generate.rows.sampler import Job, SharedPromptSampler
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage

PROMPT = "Question: what is the river of the city? Answer: the river"
HEADER = "Question: one two three. Answer: four five six seven eight nine ten.\n\n"


@pytest.fixture(scope="module")
def lm(tiny_pkg):
    return OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=512, gen_path="raw"))


@pytest.fixture(scope="module")
def device_runner(tiny_pkg):
    """The tiny decoder with KV in OrtValues bound through IOBinding, as on a GPU, on device 'cpu'."""
    from ortevals.runtime.providers import ProviderConfig
    from ortevals.runtime.sessions import DecoderRunner

    return DecoderRunner.open(ModelPackage.load(tiny_pkg), ProviderConfig("cpu"), io_binding=True)


# --- the peak, by hand ----------------------------------------------------------------------------

def holders(package):
    stub = SimpleNamespace(package=package)  # peak() reads the package's KV spec and logits only
    return InplaceKV(stub), CopyKV(stub)


def test_peak_equals_a_hand_computation_tiny(tiny_pkg):
    package = ModelPackage.load(tiny_pkg)
    # the fixture's LlamaConfig: 2 layers, 2 KV heads of 64/4 = 16, fp32 KV and logits, 512 tokens
    assert [(s.kv_heads, s.head_size, s.dtype) for s in package.kv] == [(2, 16, "float32")] * 2
    per_token = 2 * 2 * (2 * 16) * 4  # layers × (K, V) × heads·head_size × 4 bytes = 512
    tokens = 20 + 100 + 1  # prompt 20, max_gen_toks 100, one spare: the capacity the sampler allocates
    logits = 512 * 4
    inplace, copy = holders(package)
    peak = inplace.peak(tokens)
    assert (peak.fixed, peak.per_row) == (tokens * per_token, tokens * per_token * 5 // 4 + logits) == (61952, 79488)
    peak = copy.peak(tokens)  # past and present of a pass side by side
    assert (peak.fixed, peak.per_row) == (61952, 2 * 61952 + 2048) == (61952, 125952)
    assert peak.total(3) == 61952 + 3 * 125952


def test_peak_equals_a_hand_computation_smollm2_and_rows_for_free_memory(smollm2):
    package = ModelPackage.load(smollm2[1])
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32; vocabulary 49152
    assert len(package.kv) == 30 and {(s.kv_heads, s.head_size, s.dtype) for s in package.kv} == {(3, 64, "float32")}
    assert package.vocab_size == 49152
    per_token = 30 * 2 * 3 * 64 * 4  # 46080 bytes
    tokens = 900 + 256 + 1
    row = tokens * per_token  # 53,314,560 bytes
    inplace, copy = holders(package)
    assert (inplace.peak(tokens).fixed, inplace.peak(tokens).per_row) == (row, row + row // 4 + 49152 * 4)
    assert inplace.peak(tokens).per_row == 66_839_808
    assert copy.peak(tokens).per_row == 2 * row + 49152 * 4 == 106_825_728
    # rows for 8 GiB free: 80% of it, less the prompt's row, over the per-row peak, by hand
    budget = int(0.8 * 8 * 2**30)  # 6,871,947,673
    assert inplace.peak(tokens).rows_within(budget, 1000) == (6_871_947_673 - 53_314_560) // 66_839_808 == 102
    assert copy.peak(tokens).rows_within(budget, 1000) == 63
    assert inplace.peak(tokens).rows_within(budget, 16) == 16  # never more rows than samples
    assert inplace.peak(tokens).rows_within(10, 16) == 1  # one row at least: it runs or fails loudly


# --- rows per decode batch, on the real sampler ------------------------------------------------

def chunk_widths(s: SharedPromptSampler, lm, k: int, max_gen: int) -> tuple[list[int], int]:
    """Decode-batch widths the sampler uses for k samples of PROMPT (rows stop at the first space:
    the widths are planned for max_gen tokens, decoding them all is not needed)."""
    widths = []
    decode = s.decode
    s.decode = lambda logits, past, settings, rngs, names, prompt=(): (
        widths.append(len(rngs)) or decode(logits, past, settings, rngs, names, prompt))
    prompt = tuple(lm.tok_encode(PROMPT))
    settings = parse_gen_kwargs({"until": [" ", "e", "a"], "max_gen_toks": max_gen, "do_sample": True}, max_gen)
    s.run([Job(prompt, settings, tuple(range(k)))], lambda i, c=None: np.random.default_rng(i),
          lambda i, sample: None, str)
    return widths, len(prompt)


@pytest.mark.parametrize("kind", ["in-place", "copy"])
def test_rows_per_batch_from_the_real_peak(lm, kind):
    """A 1 MiB budget, 8 samples, max_gen_toks 400: the rows that fit when each grows to prompt + 400
    tokens. (The old sizing counted only the prompt's KV: 2 rows in place, all 8 with copies.)"""
    s = SharedPromptSampler(lm.run.generation.sampler().runner, lm.tokenizer, set(lm.run.generation.sampler().eos_ids),
                            kv_budget_mb=1)
    if kind == "copy":
        s._kv_rows = CopyKV(s.runner)
    assert s.kv_rows.name == kind
    widths, p = chunk_widths(s, lm, 8, 400)
    row = (p + 401) * 512  # bytes of one row grown to prompt + 400 + 1 tokens (tiny: 512 bytes a token)
    per_row = (row + row // 4 if kind == "in-place" else 2 * row) + 512 * 4
    width = (2**20 - row) // per_row
    assert width == (3 if kind == "in-place" else 1)  # the prompt is 14-17 tokens: the figure by hand
    assert widths == [width] * (8 // width) + ([8 % width] if 8 % width else [])


def test_rows_per_batch_from_the_free_memory_reading(lm):
    """The free-memory reading (injected) sets the budget: FREE_SHARE of it, plus the arenas already
    held, which the next batch reuses."""
    from ortevals.engine.generate.rows.sampler import FREE_SHARE

    prompt_len = len(lm.tok_encode(PROMPT))
    row = (prompt_len + 201) * 512
    per_row = row + row // 4 + 2048
    start = int((row + 5.5 * per_row) / FREE_SHARE)  # free before the first batch: room for 5 rows and a half
    s = SharedPromptSampler(lm.run.generation.sampler().runner, lm.tokenizer, set(lm.run.generation.sampler().eos_ids),
                            free_memory=lambda: start - s.kv_rows.held_bytes())  # what a device would report
    widths, _ = chunk_widths(s, lm, 12, 200)
    assert FREE_SHARE == 0.8 and widths == [5, 5, 2]
    # the arenas of the first batch (kept: later batches reuse them): 4 tensors of 5 rows × 2 heads ×
    # (prompt + 201) × 16 float32, each with a quarter more room
    elements = 5 * 2 * (prompt_len + 201) * 16
    assert s.kv_rows.held_bytes() == 4 * 4 * (elements + elements // 4)
    assert s.budget() == int(0.8 * start)


def test_unknown_free_memory_is_said_once_and_a_fixed_budget_used(lm, caplog):
    s = SharedPromptSampler(lm.run.generation.sampler().runner, lm.tokenizer, set(lm.run.generation.sampler().eos_ids),
                            free_memory=lambda: None)
    with caplog.at_level("INFO", logger="ortevals"):
        assert s.budget() == s.budget() == 4 * 2**30
    assert sum("free memory where the KV lives is unknown" in r.getMessage() for r in caplog.records) == 1


def test_free_memory_readings():
    from ortevals.runtime import memory

    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
    got = memory.free_bytes("cpu")
    assert abs(got - meminfo["MemAvailable"]) < 256 * 2**20  # the kernel's figure, read a moment apart
    assert memory.free_bytes("dml") is None


def test_gpu_reading_through_a_real_cuda_runtime_without_a_gpu(monkeypatch):
    """The ctypes binding against a real libcudart: with no GPU (or no driver) the runtime returns an
    error code, and the reading is None, not a number."""
    import ctypes
    import glob

    from ortevals.runtime import memory

    found = sorted(glob.glob("/usr/local/cuda*/lib*/libcudart.so*"))
    if not found:
        pytest.skip("no CUDA runtime library on this machine")
    monkeypatch.setattr(memory, "_gpu_runtime", lambda: (ctypes.CDLL(found[0]), "cuda"))
    assert memory.gpu_free(0) is None


# --- device KV in place ----------------------------------------------------------------------------

class Allocations:
    """Counts what allocates memory where a session runs: OrtValues made by shape, and outputs bound
    by device alone (onnxruntime allocates them at run time). Logits (to the host) are not KV."""

    def __init__(self, monkeypatch, logits_name: str) -> None:
        import onnxruntime as ort

        self.count = 0
        make, bind = ort.OrtValue.ortvalue_from_shape_and_type, ort.IOBinding.bind_output

        def counted_make(*args, **kwargs):
            self.count += 1
            return make(*args, **kwargs)

        def counted_bind(binding, name, device_type="cpu", device_id=0, element_type=None, shape=None,
                         buffer_ptr=None):
            self.count += buffer_ptr is None and name != logits_name
            return bind(binding, name, device_type, device_id, element_type, shape, buffer_ptr)

        monkeypatch.setattr(ort.OrtValue, "ortvalue_from_shape_and_type", staticmethod(counted_make))
        monkeypatch.setattr(ort.IOBinding, "bind_output", counted_bind)


def decode(s: SharedPromptSampler, lm, kwargs: dict, seeds, prompt: str = PROMPT, counter=None):
    settings = parse_gen_kwargs(kwargs, kwargs["max_gen_toks"])
    logits, past = s.prompt(tuple(lm.tok_encode(prompt)), settings.max_gen_toks)
    before = counter.count if counter else 0
    out = s.decode(logits, past, settings, [np.random.default_rng(x) for x in seeds], ["r"] * len(seeds))
    return [o.ids for o in out], (counter.count - before if counter else 0)


def host_plain(lm) -> SharedPromptSampler:
    """The reference: host numpy KV, a new cache per pass (no buffer shared, no OrtValue)."""
    s = SharedPromptSampler(lm.run.generation.sampler().runner, lm.tokenizer, set())
    s._kv_rows = CopyKV(s.runner)
    return s


def test_device_kv_is_in_place_token_equal_and_allocates_nothing_per_step(lm, device_runner, monkeypatch):
    """Device KV (OrtValues bound through IOBinding, device 'cpu'): the sampler keeps it in place, so
    decoding 6 or 30 tokens allocates the same (the arenas, once); the tokens are the plain pass's."""
    s = SharedPromptSampler(device_runner, lm.tokenizer, set())  # no EOS: every row runs to max_gen_toks
    assert s.kv_rows.name == "in-place (device)"
    counter = Allocations(monkeypatch, device_runner.package.logits_name)
    kw = {"until": [], "do_sample": True, "temperature": 1.0}
    short, few = decode(s, lm, {**kw, "max_gen_toks": 6}, [1, 2, 3], counter=counter)
    s._kv_rows._arenas.clear()  # the longer run allocates its own arenas, as the first one did
    long, many = decode(s, lm, {**kw, "max_gen_toks": 30}, [1, 2, 3], counter=counter)
    assert len(long[0]) == 30 and len({t for t in long}) == 3
    assert few == many == 2 * len(device_runner.package.kv)  # one arena per K and V tensor, per decode
    assert long == decode(host_plain(lm), lm, {**kw, "max_gen_toks": 30}, [1, 2, 3])[0]
    assert short == decode(host_plain(lm), lm, {**kw, "max_gen_toks": 6}, [1, 2, 3])[0]


def test_device_kv_rows_that_stop_early_and_prefix_reuse_are_token_equal(lm, device_runner):
    """Rows leave at different steps (their KV moved forward on the device) and a second prompt reuses
    the first one's KV cut to the shared header (fitted into a new buffer on the device)."""
    seeds = [21, 22, 23, 24, 25]
    free = decode(host_plain(lm), lm, {"until": [], "max_gen_toks": 16, "do_sample": True}, seeds)[0]
    texts = [lm.tok_decode(list(ids)) for ids in free]
    stop = texts[0][len(texts[0]) // 3:][:2]
    kw = {"until": [stop], "max_gen_toks": 16, "do_sample": True}
    dev = SharedPromptSampler(device_runner, lm.tokenizer, set())
    ours = decode(dev, lm, kw, seeds)[0]
    assert ours == decode(host_plain(lm), lm, kw, seeds)[0]
    assert len({len(ids) for ids in ours}) > 1  # rows really stopped at different steps
    for prompt in (HEADER + "Question: the city of Paris? Answer:", HEADER + "Question: the river Seine? Answer:"):
        assert decode(dev, lm, kw, seeds, prompt)[0] == decode(host_plain(lm), lm, kw, seeds, prompt)[0]
    assert dev.stats["reused_tokens"] > 16


def test_a_device_graph_that_refuses_the_shared_buffer_falls_back_once(lm, device_runner, caplog):
    """Where the in-place check fails, the copy path serves, and the log says so once."""
    from ortevals.errors import PackageError

    class Refusing(type(device_runner)):
        def forward_inplace(self, *args, **kwargs):
            raise PackageError("shared KV buffer not supported by this provider")

    runner = Refusing(device_runner.package, device_runner.decoder, None, "cpu", 0, device_runner.replicator)
    with caplog.at_level("INFO", logger="ortevals"):
        s = SharedPromptSampler(runner, lm.tokenizer, set())
        kw = {"until": [], "max_gen_toks": 8, "do_sample": True}
        got = [decode(s, lm, kw, [5, 6])[0] for _ in range(2)]
    assert s.kv_rows.name == "copy"
    said = [r for r in caplog.records if "shared past/present buffer refused" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    assert got[0] == got[1] == decode(host_plain(lm), lm, kw, [5, 6])[0]


@pytest.mark.parametrize("op", ["expand", "copy", "fit"])
def test_the_in_place_check_catches_a_row_op_that_writes_nothing(device_runner, monkeypatch, caplog, op):
    """The check runs every row op the sampler uses on buffers that start as NaN: a device copy that
    does not happen cannot pass because the allocator handed back memory holding the right values."""
    from ortevals.engine.generate.rows.kv import choose_kv
    from ortevals.runtime.replicate import Replicator

    original = getattr(Replicator, op)

    def writes_nothing(self, value, *args, into=None):  # the plain path's own calls (no ``into``) still work
        return into if into is not None else original(self, value, *args)

    monkeypatch.setattr(Replicator, op, writes_nothing)
    with caplog.at_level("INFO", logger="ortevals"):
        assert choose_kv(device_runner).name == "copy"
    assert "the shared buffer differs from the plain pass (rel. " in caplog.text


# --- rows leave in place ------------------------------------------------------------------------------

def test_rows_that_leave_move_only_the_rows_they_must():
    """Rows 1 (of the first prompt's four) and 5 (of the second's three) end: each group keeps its slots, a hole
    filled by its own last row; the second group starts one slot earlier (its last row moves to its first)."""
    from ortevals.engine.generate.rows.batch import placed

    first = placed([(0, "a"), (2, "c"), (3, "d")], 0)
    second = placed([(4, "e"), (6, "g")], len(first))
    assert first == [(0, "a"), (3, "d"), (2, "c")]  # d takes b's slot
    assert second == [(6, "g"), (4, "e")]  # slots 3 and 4: e stays at 4, g moves to 3
    assert placed([(2, "x"), (3, "y")], 0) == [(2, "x"), (3, "y")]  # no slot held: the order kept


def test_in_place_keep_refuses_a_row_moved_past_its_own_slot(lm):
    """A row moved to a slot after its own would be read after a row was written over it."""
    kv = InplaceKV(lm.run.generation.sampler().runner)
    past = kv.empty(3, 4)
    for pair in past.layers:
        for t in pair:
            t[:] = np.arange(3)[:, None, None, None]  # each row holds its index
    past = kv.KVCache(past.layers, 4)
    with pytest.raises(ValueError, match="after its own"):
        kv.keep(past, [1, 0])
    kept = kv.keep(past, [2, 1])  # each row to a slot at or before its own
    assert all((t[:, 0, :, 0] == [[2] * 4, [1] * 4]).all() for pair in kept.layers for t in pair)
