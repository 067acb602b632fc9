"""Run inside the installed environment (``PYTHONPATH=TARGET:…``) by ``kit.py install``: is it the real thing?

* onnxruntime (and onnxruntime_genai) are imported from TARGET, not from a copy they should shadow;
* ``onnxruntime.preload_dlls()`` where it exists (the CUDA/cuDNN libraries of the nvidia packages);
* a tiny in-memory ONNX model runs on the expected provider, with no fallback to CPU allowed, and its
  output equals numpy's;
* onnxruntime-genai (where installed) runs one token of its Generator on ``--og-package`` on the
  expected provider: its own provider library really loads;
* each module named in ``--modules`` imports, and ortevals (if there) accepts the install;
* each installed wheel's requirements are met by what this interpreter sees (a list, not an error: the
  box cannot fetch anything, so the import checks decide).

Prints one JSON line ``VERIFY {...}``; exits 2 with one line on the first failure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from importlib import metadata, util
from pathlib import Path


class Failed(Exception):
    pass


def under(module, target: Path) -> None:
    where = Path(module.__file__).resolve()
    if not where.is_relative_to(target.resolve()):
        raise Failed(f"{module.__name__} is imported from {where.parent}, not from the target {target}: "
                     f"put {target} first on PYTHONPATH")


def session_check(ort, provider: str, preload: list[str]) -> dict:
    import numpy as np
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 3], [0.5, -1.0, 2.0, 1.5, 0.25, -0.75, 1.0, 3.0, -2.0])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Softmax", ["m"], ["y"], axis=-1)]
    model = helper.make_model(helper.make_graph(nodes, "kit_check", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    if provider != "CPUExecutionProvider":  # every node on the provider asked for, or no session
        opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=[provider])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types; report the first line
        said = f" (preload_dlls: {preload[0][:160]})" if preload else ""
        raise Failed(f"no {provider} session: {str(e).strip().splitlines()[0][:300]}{said}") from None
    got = sess.get_providers()
    if not got or got[0] != provider:
        raise Failed(f"the session runs on {got[0] if got else 'nothing'}, not {provider} "
                     f"(available: {', '.join(ort.get_available_providers())})")
    xv = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]], np.float32)
    m = xv @ np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75], [1.0, 3.0, -2.0]], np.float32)
    want = np.exp(m - m.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    out = sess.run(None, {"x": xv})[0]
    if not np.allclose(out, want, atol=1e-5):
        raise Failed(f"the {provider} session computed {out.tolist()}, numpy {want.tolist()}")
    return {"session_providers": got}


def generator_check(og, pkg: Path, provider: str) -> dict:
    """One token through onnxruntime-genai's Generator on ``pkg`` (scripts/gpu/tinypkg.py) and ``provider``:
    its own provider library loads, a session opens and a pass runs (not only ``import onnxruntime_genai``)."""
    import numpy as np

    config = og.Config(str(pkg))
    config.clear_providers()
    ep = {"CUDAExecutionProvider": "cuda", "CPUExecutionProvider": None}.get(provider, provider)
    if ep:
        config.append_provider(ep)
    try:
        model = og.Model(config)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=4)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array([[1]], dtype=np.int32))
        logits = np.asarray(gen.get_logits())
    except Exception as e:  # noqa: BLE001 - onnxruntime-genai's own error types; its first line is the finding
        raise Failed(f"onnxruntime-genai's Generator on {ep or 'cpu'} failed: {str(e).strip().splitlines()[0][:300]}"
                     ) from None
    if logits.shape[-1] != 512 or not np.isfinite(logits).all():
        raise Failed(f"onnxruntime-genai's Generator returned logits of shape {logits.shape} (finite: "
                     f"{bool(np.isfinite(logits).all())}), expected 512 finite values")
    return {"og_generator": {"provider": ep or "cpu", "package": str(pkg), "logits_shape": list(logits.shape)}}


def unmet_requirements(target: Path) -> list[str]:
    """Requirements (no extras) of the wheels in ``target`` that this interpreter does not meet."""
    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
    except ImportError:
        return ["packaging is not importable: requirements not checked"]
    env, out = default_environment(), []
    for dist in metadata.distributions(path=[str(target)]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                out.append(f"{dist.metadata['Name']} needs {req} (missing)")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                out.append(f"{dist.metadata['Name']} needs {req} (has {have})")
    return sorted(set(out))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--expect-provider", required=True)
    ap.add_argument("--modules", default="")
    ap.add_argument("--og-package", type=Path, default=None, help="a tiny package for one Generator token")
    args = ap.parse_args()
    report_env = {k: os.environ.get(k) for k in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    report = {"python": sys.version.split()[0], "executable": sys.executable, "env": report_env}
    try:
        import onnxruntime as ort

        under(ort, args.target)
        report["onnxruntime"] = ort.__version__
        report["available_providers"] = ort.get_available_providers()
        if hasattr(ort, "preload_dlls"):
            said = io.StringIO()
            with contextlib.redirect_stdout(said):
                ort.preload_dlls()
            report["preload_dlls"] = said.getvalue().strip().splitlines()
        report.update(session_check(ort, args.expect_provider, report.get("preload_dlls", [])))
        if util.find_spec("onnxruntime_genai") is not None:
            import onnxruntime_genai as og

            under(og, args.target)
            report["onnxruntime_genai"] = og.__version__
            if hasattr(og, "is_cuda_available"):
                report["og_cuda_available"] = bool(og.is_cuda_available())
            if args.og_package:
                report.update(generator_check(og, args.og_package, args.expect_provider))
        for name in filter(None, args.modules.split(",")):
            try:
                __import__(name)
            except Exception as e:  # noqa: BLE001 - any import failure is the finding
                raise Failed(f"import {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
        if util.find_spec("ortevals") is not None:  # ortevals' own install check must accept the shadowing
            from ortevals.install import check_install

            try:
                check_install()
            except Exception as e:  # noqa: BLE001 - its one-line error is the finding
                raise Failed(f"ortevals refuses this install: {e}") from None
        report["unmet_requirements"] = unmet_requirements(args.target)
    except Failed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("VERIFY " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
