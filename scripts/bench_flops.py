"""FLOP accounting for the benchmark: the work that must be done, and this machine's peak.

* ``required_flops``: model FLOPs for the tokens that must be processed: every
  distinct prefix of the prompts once (a shared 5-shot header counts once),
  2 × matmul parameters per token, attention over the tokens before it, and
  the LM head once per scored position.
* ``matmul_peak``: fp32 GFLOP/s of onnxruntime's MatMul on this machine, in a
  shape like the model's (tokens × hidden × intermediate), with the same threads.
"""

from __future__ import annotations

import time
from pathlib import Path


def matmul_params(model_path: Path, logits_name: str = "logits") -> tuple[int, int]:
    """(body matmul parameters, LM head parameters) from initializer shapes, weights not loaded."""
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    dims = {i.name: list(i.dims) for i in m.graph.initializer}
    body = head = 0
    for node in m.graph.node:
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in dims:
            n = 1
            for d in dims[node.input[1]]:
                n *= d
            if logits_name in node.output or node.name.startswith("/lm_head"):
                head += n
            else:
                body += n
    return body, head


def required_flops(prompts: list[list[int]], body: int, head: int, layers: int, attn_width: int,
                   scored_per_prompt: int = 1) -> tuple[int, float]:
    """(distinct tokens, FLOPs) to score ``prompts`` with each distinct prefix computed once."""
    seqs = sorted(tuple(p) for p in prompts)
    tokens = 0
    flops = 0.0
    prev: tuple[int, ...] = ()
    for s in seqs:
        lcp = 0
        while lcp < min(len(s), len(prev)) and s[lcp] == prev[lcp]:
            lcp += 1
        n = len(s) - lcp
        tokens += n
        positions = sum(range(lcp, len(s)))  # keys each new token attends to (before itself)
        flops += 2.0 * body * n + 4.0 * layers * attn_width * (positions + n)
        flops += 2.0 * head * scored_per_prompt
        prev = s
    return tokens, flops


def matmul_peak(threads: int = 0, m: int = 256, k: int = 576, n: int = 1536, seconds: float = 3.0) -> float:
    """GFLOP/s of an fp32 onnxruntime MatMul [m,k]x[k,n] on CPU."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    for _ in range(5):
        sess.run(None, {"x": x})
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sess.run(None, {"x": x})
        runs += 1
    return 2.0 * m * k * n * runs / (time.perf_counter() - start) / 1e9
