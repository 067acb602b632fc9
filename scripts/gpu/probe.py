#!/usr/bin/env python
"""The first GPU command: the calls of ortevals that only a device can answer, one PASS/FAIL line each.

    python3 scripts/gpu/probe.py --ep cuda --work /root/probe      # after kit.py install + env
    python scripts/gpu/probe.py --ep cpu --work /tmp/probe         # the same calls on the CPU (a test runs it)

OrtValues made on the device, written in place and read back; IOBinding by pointer into the middle of a
buffer; the past-KV copy and zero graphs of runtime/replicate.py; the free device memory of runtime/memory.py
(cudaMemGetInfo through ctypes); the derived scoring graph (float64 sums) opened with no node on the CPU
and scored against the full-logit path; 12 never-seen shapes timed with flash attention pinned
(``sdpa_kernel=3``, ortevals' default) and with onnxruntime's own choice; the cascade decode graph against
plain sessions at a 1,024-token prompt; then scripts/gpu/probe_scoring.py's lines on scoring many questions a
pass. The package is scripts/gpu/tinypkg.py's (fp16 on CUDA, fp32 on the CPU) unless ``--pkg``.
Exit 1 if any line fails.
"""

import argparse
import functools
import logging
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "scripts" / "gpu"), str(REPO / "tests")]
import probe_scoring  # noqa: E402 - beside this file (scripts/gpu/)

failed = []


def check(name, fn):
    t0 = time.perf_counter()
    try:
        print(f"PASS {name}: {fn()} ({time.perf_counter() - t0:.2f} s)", flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is one line, the next call still runs
        failed.append(name)
        print(f"FAIL {name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
              flush=True)


def same(a, b, tol=0.0):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape and np.abs(a - b).max(initial=0) <= tol, f"max |diff| {np.abs(a - b).max():.3g}"
    return f"max |diff| {np.abs(a - b).max(initial=0):.3g}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ep", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ortevals-probe"))
    ap.add_argument("--pkg", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.buffers import KVView
    from ortevals.runtime.memory import free_bytes
    from ortevals.runtime.providers import from_package
    from ortevals.runtime.replicate import Replicator

    logging.basicConfig(stream=sys.stdout, format="  %(message)s")  # which nodes onnxruntime put on the CPU
    logging.getLogger("ortevals.runtime.placement").setLevel(logging.INFO)
    if args.ep == "cuda":
        ort.preload_dlls()
    dev, dt = args.ep, np.float16 if args.ep == "cuda" else np.float32
    provider = from_package({}, args.ep)
    host = np.arange(2 * 3 * 4 * 5, dtype=dt).reshape(2, 3, 4, 5) / 8
    v = ort.OrtValue.ortvalue_from_shape_and_type(host.shape, dt, dev, 0)
    check("ortvalue_from_shape_and_type", lambda: f"{v.device_name()} {v.shape()}")
    check("update_inplace + numpy()", lambda: (v.update_inplace(host), same(v.numpy(), host))[1])
    check("data_ptr", lambda: f"{v.data_ptr():#x}" if v.data_ptr() else 1 / 0)
    elem = TensorProto.FLOAT16 if dt == np.float16 else TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "id",
                              [helper.make_tensor_value_info("x", elem, [1, 3, 4, 5])],
                              [helper.make_tensor_value_info("y", elem, [1, 3, 4, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8

    def by_pointer():  # row 1 of v in, row 1 of out written: both pointers into the middle of a buffer
        so = ort.SessionOptions()
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1") if dev != "cpu" else None
        s = ort.InferenceSession(model.SerializeToString(), so, providers=[provider.ort_name])
        out, row = ort.OrtValue.ortvalue_from_shape_and_type(host.shape, dt, dev, 0), host[0].nbytes
        out.update_inplace(np.zeros_like(host))
        b = s.io_binding()
        b.bind_input("x", dev, 0, dt, [1, 3, 4, 5], v.data_ptr() + row)
        b.bind_output("y", dev, 0, dt, [1, 3, 4, 5], out.data_ptr() + row)
        s.run_with_iobinding(b)
        return same(out.numpy(), np.stack([np.zeros_like(host[1]), host[1]]))
    check("IOBinding by pointer into a buffer", by_pointer)
    rep = Replicator(provider, dev)
    view = KVView(v, host.shape, elem, dev)
    check("replicate expand", lambda: same(rep.expand(view.rows(1, 2), 3).numpy(), np.repeat(host[1:2], 3, 0)))
    check("replicate gather", lambda: same(rep.gather(v, [1, 0]).numpy(), host[[1, 0]]))
    check("replicate narrow", lambda: same(rep.narrow(v, 2).numpy(), host[:, :, :2]))
    arena = ort.OrtValue.ortvalue_from_shape_and_type(host.shape, dt, dev, 0)
    dest = KVView(arena, host.shape, elem, dev)
    check("replicate copy", lambda: (rep.copy(view.rows(0, 1), dest.rows(1, 2)), same(arena.numpy()[1], host[0]))[1])
    fitted = np.concatenate([host[:, :, :2], 0 * host[:, :, 2:]], 2)
    check("replicate fit", lambda: (rep.fit(view, 2, dest), same(arena.numpy(), fitted))[1])

    def zeroed():  # all-ones bits (NaN) in; row 0 cleared in 8-byte words, row 1 from its 3rd byte on byte by byte
        bits = {2: np.uint16, 4: np.uint32}[np.dtype(dt).itemsize]
        arena.update_inplace(np.full(host.shape, np.iinfo(bits).max, bits).view(dt))
        half = dest.nbytes // 2
        rep.zero(dest.rows(0, 1))
        rep.zero(KVView(arena, (half - 2,), TensorProto.UINT8, dev, 0, half + 2))
        got = arena.numpy().view(np.uint8).reshape(-1)
        kept = got[half:half + 2]
        return "ok" if not got[:half].any() and (kept == 255).all() and not got[half + 2:].any() else 1 / 0
    check("replicate zero", zeroed)
    check("free device memory", lambda: f"{free_bytes(dev) / 2**30:.2f} GiB" if free_bytes(dev) else 1 / 0)
    pkg = args.pkg
    if pkg is None:
        from tinypkg import build
        pkg = build(args.work / "tiny", "fp16" if dev == "cuda" else "fp32", args.ep)
    scoring_and_cascade(ModelPackage.load(pkg), provider, args)
    probe_scoring.lines(check, same, ModelPackage.load(pkg), provider, args)  # issue 46: many questions a pass
    return 1 if failed else 0


def scoring_and_cascade(package, provider, args):
    from test_cascade import log_softmax, teacher_forced  # the cascade tests' teacher-forced decode

    from ortevals.engine.generate.rows.cascade_kv import Cascade, CascadeKV
    from ortevals.engine.generate.rows.kv import CopyKV, DeviceKV, InplaceKV
    from ortevals.runtime.sessions import DecoderRunner

    cache, tol = args.work / "cache", 1e-2 if args.ep == "cuda" else 1e-4
    runners = {}
    check("decoder session, no node on the CPU", lambda: runners.setdefault(
        "full", DecoderRunner.open(package, provider)).decoder.get_providers()[0])
    check("derived scoring graph (float64 sums), no node on the CPU", lambda: runners.setdefault(
        "derived", DecoderRunner.open(package, provider, cache)).decoder.get_providers()[0])
    rng = np.random.default_rng(0)
    ids = rng.integers(3, package.vocab_size, (2, 40))
    targets = rng.integers(3, package.vocab_size, (2, 3, 2))
    positions = np.asarray([[[5], [20], [39]], [[0], [9], [30]]])

    def scored():
        lp, _ = runners["derived"].score(ids, np.ones_like(ids), None, positions[..., 0], targets)
        logits, _ = runners["full"].forward(ids, np.ones_like(ids))
        want = np.take_along_axis(log_softmax(logits)[np.arange(2)[:, None], positions[..., 0]], targets, 2)
        return same(lp, want, tol)
    check("derived scores = full logits", scored)

    def new_shapes():  # onnxruntime's cuDNN SDPA builds a graph per new shape on sm90+; sdpa_kernel=3 pins flash
        from ortevals.runtime.providers import from_package

        ms = {}
        for kernel in ("3", "0"):
            runner = DecoderRunner.open(package, from_package({}, args.ep, {"sdpa_kernel": kernel}))
            runner.forward(ids[:1, :8], np.ones((1, 8), np.int64))  # warm-up: the session's first pass
            t0 = time.perf_counter()
            for n in range(20, 32):  # 12 lengths never run before
                x = rng.integers(3, package.vocab_size, (2, n))
                runner.forward(x, np.ones_like(x))
            ms[kernel] = (time.perf_counter() - t0) / 12 * 1e3
        return f"sdpa_kernel=3 {ms['3']:.1f} ms a pass, sdpa_kernel=0 (onnxruntime's choice) {ms['0']:.1f} ms"
    check("attention at 12 new shapes", new_shapes)

    def cascade():
        base = runners["full"]
        inplace = DeviceKV(base) if args.ep != "cpu" else InplaceKV(base)
        kv = CascadeKV(inplace, CopyKV(base), Cascade("on", functools.partial(base.cascade, provider, cache)))
        prompt, tokens = rng.integers(3, package.vocab_size, args.tokens), rng.integers(3, package.vocab_size, (4, 4))
        got = teacher_forced(kv, prompt, tokens, 2, shared=True)
        plain = teacher_forced(kv.base, prompt, tokens, 2, shared=False)
        return same([got[k] for k in sorted(got)], [plain[k] for k in sorted(got)], tol)
    check(f"cascade graph = plain sessions at {args.tokens} tokens", cascade)


if __name__ == "__main__":
    sys.exit(main())
