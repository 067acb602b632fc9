"""The probe's lines about scoring many questions a pass (issue 46), each one call of scripts/gpu/probe.py's ``check``.

* GroupQueryAttention on a past with two rows of several new tokens: refused (its message), or run;
* whether this onnxruntime's GroupQueryAttention takes ``query_seqlens`` (1.32: batched chunks, one past a row);
* the shared-prefix scoring graph (runtime/prefix_graph.py) against one full pass a row, and its time against
  one question a pass;
* one attention layer as the graph's plain ops against the kernel (flash on CUDA): max |diff| and microseconds;
* CUDA graphs on the decoder (``enable_cuda_graph=1``) and a PagedAttention kernel: there or not, and why;
* zeros written on the device by the replicator's session and read at once by another session (the ordering
  the device KV relies on: docs/runtime-facts.md).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np


def lines(check, same, package, provider, args) -> None:
    """Run every line through ``check(name, fn)``."""
    import functools

    from ortevals.runtime.sessions import DecoderRunner

    # opened by the first line that needs it: a package the provider cannot run fails those lines only
    runner = functools.cache(lambda: DecoderRunner.open(package, provider, args.work / "cache"))
    tol = 2e-2 if args.ep == "cuda" else 1e-4
    check("GroupQueryAttention, two rows of new tokens on a past", lambda: batched_on_past(runner()))
    check("GroupQueryAttention takes query_seqlens", query_seqlens)
    check("shared-prefix graph = one pass a row", lambda: shared_prefix(runner(), provider, args, same, tol))
    check("one attention layer, plain ops against the kernel", lambda: one_layer(provider, args.ep, same))
    check("CUDA graph on the decoder", lambda: cuda_graph(package, provider, args.ep))
    check("PagedAttention kernel", lambda: paged_attention(provider))
    check("zeros from one session read by another at once", lambda: zero_then_read(provider, args.ep))


def batched_on_past(runner) -> str:
    rng = np.random.default_rng(3)
    vocab = runner.package.vocab_size
    _, past = runner.forward(rng.integers(3, vocab, (1, 32)), np.ones((1, 32), np.int64), want_present=True)
    ids = rng.integers(3, vocab, (2, 4))
    try:
        runner.forward(ids, np.ones((2, 36), np.int64), runner.repeat_past(past, 2))
    except Exception as e:  # noqa: BLE001 - the refusal is the finding
        return f"refused: {str(e).split('Status Message: ')[-1][:200]}"
    return "accepted (onnxruntime ran it: the engine's one-row rule is then conservative)"


def query_seqlens() -> str:
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    gqa = next(s for s in state.get_all_operator_schema() if s.name == "GroupQueryAttention"
               and s.domain == "com.microsoft")
    names = [i.name for i in gqa.inputs]
    return f"{'yes' if 'query_seqlens' in names else 'no'} ({len(names)} inputs)"


def shared_prefix(runner, provider, args, same, tol) -> str:
    from ortevals.runtime.prefix_runner import PrefixRunner

    shared = PrefixRunner.open(runner, provider, args.work / "cache")
    rng = np.random.default_rng(4)
    vocab, prefix_len, rows, own = runner.package.vocab_size, 800, 8, 64
    prefix = rng.integers(3, vocab, (1, prefix_len))
    _, past = runner.forward(prefix, np.ones_like(prefix), want_present=True, positions=np.array([[prefix_len - 1]]))
    ids = rng.integers(3, vocab, (rows, own))
    positions, targets = np.full((rows, 1), own - 1), rng.integers(3, vocab, (rows, 1, 10))
    shared.score(ids, past, positions, targets)  # warm-up
    t0 = time.perf_counter()
    lp, _ = shared.score(ids, past, positions, targets)
    batched = time.perf_counter() - t0
    mask = np.ones((1, prefix_len + own), np.int64)
    t0 = time.perf_counter()
    one = [runner.score(ids[b:b + 1], mask, past, positions[b:b + 1], targets[b:b + 1])[0] for b in range(rows)]
    single = time.perf_counter() - t0
    return (f"{same(lp, np.concatenate(one), tol)}; {rows} rows of {own} on {prefix_len}: {batched * 1e3:.1f} ms in "
            f"one pass, {single * 1e3:.1f} ms one a pass")


def _one_layer_models(nq: int, nk: int, d: int, elem: int, max_pos: int):
    """(a one-node GroupQueryAttention model on a past, the same node as the shared-prefix graph's plain ops)."""
    from onnx import helper, numpy_helper

    from ortevals.runtime.prefix_graph import PREFIX_KEY, PREFIX_LENGTH, PREFIX_VALUE, _positions, _rewrite_node

    rng = np.random.default_rng(5)
    dtype = np.float16 if elem == 10 else np.float32
    cos, sin = (numpy_helper.from_array(f(rng.random((max_pos, d // 2))).astype(dtype), n)
                for f, n in ((np.cos, "cos_cache"), (np.sin, "sin_cache")))
    node = helper.make_node("GroupQueryAttention", ["query", "", "", "past_key", "past_value", "seqlens_k", "total",
                                                    "cos_cache", "sin_cache"], ["out", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=nq, kv_num_heads=nk, do_rotary=1)
    width = (nq + 2 * nk) * d
    io = [helper.make_tensor_value_info("query", elem, ["B", "S", width])]
    past = [helper.make_tensor_value_info(n, elem, ["B", nk, "P", d]) for n in ("past_key", "past_value")]
    lengths = [helper.make_tensor_value_info("seqlens_k", 6, ["B"]), helper.make_tensor_value_info("total", 6, [])]
    outs = [helper.make_tensor_value_info(n, elem, None) for n in ("out", "present_key", "present_value")]
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    gqa = helper.make_model(helper.make_graph([node], "gqa", io + past + lengths, outs, [cos, sin]),
                            opset_imports=opsets)
    spec = SimpleNamespace(layer=0, dtype="float16" if elem == 10 else "float32", head_size=d, kv_heads=nk,
                           window=None)
    g, pos, own = _positions(node)
    nodes, inits = _rewrite_node(node, spec, {"cos_cache": [max_pos, d // 2], "sin_cache": [max_pos, d // 2]}, 21,
                                 (pos, own), {})  # GroupQueryAttention: no standard Attention masks
    prefix = [helper.make_tensor_value_info(n % 0, elem, [nk, "P", d]) for n in (PREFIX_KEY, PREFIX_VALUE)]
    prefix.append(helper.make_tensor_value_info(PREFIX_LENGTH, 7, [1]))
    plain = helper.make_model(helper.make_graph(g.nodes + nodes, "shared", io + prefix, outs[:1],
                                                [cos, sin, *g.inits, *inits]), opset_imports=opsets)
    return gqa, plain


def one_layer(provider, ep: str, same) -> str:
    import onnxruntime as ort

    nq, nk, d, prefix_len, own, rows = (16, 8, 128, 800, 200, 8) if ep == "cuda" else (4, 2, 32, 200, 40, 4)
    elem, dtype = (10, np.float16) if ep == "cuda" else (1, np.float32)
    gqa, plain = _one_layer_models(nq, nk, d, elem, 4096)
    sessions = [ort.InferenceSession(m.SerializeToString(), providers=[provider.ort_name]) for m in (gqa, plain)]
    rng = np.random.default_rng(6)
    q = rng.standard_normal((rows, own, (nq + 2 * nk) * d)).astype(dtype)
    k, v = (rng.standard_normal((1, nk, prefix_len, d)).astype(dtype) for _ in range(2))
    total = np.array(prefix_len + own, np.int32)

    def kernel():
        return np.concatenate([sessions[0].run(["out"], {
            "query": q[b:b + 1], "past_key": k, "past_value": v, "seqlens_k": np.array([prefix_len + own - 1],
                                                                                       np.int32), "total": total})[0]
            for b in range(rows)])

    def shared():
        return sessions[1].run(["out"], {"query": q, "ortevals_prefix.0.key": k[0], "ortevals_prefix.0.value": v[0],
                                         "ortevals_prefix_length": np.array([prefix_len])})[0]

    times = {}
    for name, fn in (("kernel", kernel), ("plain", shared)):
        fn()
        t0 = time.perf_counter()
        for _ in range(5):
            out = fn()
        times[name] = ((time.perf_counter() - t0) / 5 * 1e6, out)
    diff = same(times["plain"][1], times["kernel"][1], 2e-2 if ep == "cuda" else 1e-4)
    return (f"{diff}; {rows} rows of {own} on {prefix_len}: kernel one row a call {times['kernel'][0]:.0f} us, "
            f"plain ops all rows {times['plain'][0]:.0f} us")


def cuda_graph(package, provider, ep: str) -> str:
    if ep != "cuda":
        return "not on this provider (CPU: no CUDA graphs)"
    import onnxruntime as ort

    so = ort.SessionOptions()
    try:
        session = ort.InferenceSession(str(package.decoder.path), so, providers=[
            (provider.ort_name, {**provider.raw_options, "enable_cuda_graph": "1"})])
    except Exception as e:  # noqa: BLE001 - the refusal is the finding
        return f"refused at open: {str(e).splitlines()[0][:200]}"
    return f"opened ({session.get_providers()[0]}); capture needs fixed shapes and device inputs: not used by ortevals"


def paged_attention(provider) -> str:
    import onnxruntime as ort
    from onnx import helper

    node = helper.make_node("PagedAttention", ["q", "k", "v", "kc", "vc", "cu", "ps", "bt"], ["o"],
                            domain="com.microsoft", num_heads=2, kv_num_heads=2)
    io = [helper.make_tensor_value_info(n, 10, None) for n in ("q", "k", "v", "kc", "vc")]
    io += [helper.make_tensor_value_info(n, 6, None) for n in ("cu", "ps", "bt")]
    model = helper.make_model(helper.make_graph([node], "paged", io, [helper.make_tensor_value_info("o", 10, None)]),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    if provider.on_device:  # a CPU kernel must not stand in for the device's
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=[provider.ort_name])
    except Exception as e:  # noqa: BLE001 - the refusal is the finding
        return f"no kernel on {provider.ort_name}: {str(e).split('] : ')[-1].splitlines()[0][:160]}"
    return f"a kernel on {provider.ort_name}"


def zero_then_read(provider, ep: str) -> str:
    """A 64 MiB buffer of NaN bits, cleared by the replicator's ConstantOfShape session and copied to the host by
    an Identity session right after, twenty times: the second session must see the zeros (onnxruntime completes
    a run's device work before ``run_with_iobinding`` returns, or orders the two sessions' streams)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ortevals.runtime.buffers import device_buffer, fill_nan
    from ortevals.runtime.replicate import Replicator

    n = 16 * 2**20
    view = device_buffer((n,), TensorProto.FLOAT, ep if ep == "cuda" else "cpu")
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "read",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])])
    reader = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
                                  .SerializeToString(), providers=[provider.ort_name])
    rep = Replicator(provider, view.device)
    for _ in range(20):
        fill_nan(view)
        rep.zero(view)
        binding = reader.io_binding()
        view.bind_input(binding, "x")
        binding.bind_output("y", "cpu")
        reader.run_with_iobinding(binding)
        got = binding.get_outputs()[0].numpy()
        if np.isnan(got).any() or got.any():
            raise AssertionError(f"{int(np.isnan(got).sum())} NaN and {int((got != 0).sum())} non-zero of {n} read")
    return f"20 times {n * 4 >> 20} MiB: all zeros"
