"""Execution providers that ship as plugin packages (issue 48 §7, runtime/plugins.py).

Without the package, ``--ep NAME`` is one line naming the package to install. With it installed (a venv with
``pip install onnxruntime-ep-openvino``: the test below runs only there), the plugin is registered with
onnxruntime and its devices are used; on a machine where it offers none (OpenVINO's plugin 1.8.1 offers no device
on an AMD EPYC, although OpenVINO's own runtime lists that CPU) the refusal says so in one line; where it offers
one, the package is scored on it and the run records the provider and the plugin's version in its scope.
"""

from __future__ import annotations

import importlib.util

import pytest
from lm_eval.api.instance import Instance

from ortevals.errors import OrtEvalsError
from tests.test_cli import assert_one_line_error, run


@pytest.mark.parametrize("ep, package", [("openvino", "onnxruntime-ep-openvino"), ("webgpu", "onnxruntime-ep-webgpu"),
                                         ("nvtensorrtrtx", "onnxruntime-ep-nv-tensorrt-rtx")])
def test_a_plugin_provider_not_installed_names_its_package(tiny_pkg, ep, package):
    if importlib.util.find_spec(package.replace("-", "_")) is not None:
        pytest.skip(f"{package} is installed here")
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--ep", ep, "--limit", "1"),
                          "is not available in this onnxruntime install",
                          f"it ships as a plugin package: pip install {package}, or pass --ep cpu")


def test_an_installed_plugin_is_registered_and_used_or_refused_in_one_line(tiny_int4):
    pytest.importorskip("onnxruntime_ep_openvino")
    import onnxruntime as ort

    from ortevals.integrations.lm import ModelArgs, OrtLM
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.providers import from_package
    from ortevals.runtime.reads import session_reads

    package = ModelPackage.load(tiny_int4)
    assert "onnxruntime-ep-openvino" in session_reads(package.decoder, from_package({}, "openvino")).dists
    pairs = [("The capital of France is", " Paris"), ("one two three four", " five six")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    try:
        lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_int4), ep="openvino"))
        ours = lm.loglikelihood(reqs, disable_tqdm=True)
    except OrtEvalsError as e:
        devices = [d for d in ort.get_ep_devices() if d.ep_name == "OpenVINOExecutionProvider"]
        assert not devices and "offers no device on this machine" in str(e) and "\n" not in str(e)
        return
    cpu = OrtLM.from_package(ModelArgs(pkg=str(tiny_int4), ep="cpu")).loglikelihood(reqs, disable_tqdm=True)
    assert lm.get_model_info()["execution_provider"] == "OpenVINOExecutionProvider"
    print("OpenVINO against the CPU EP, max |Δ|:", max(abs(a - b) for (a, _), (b, _) in zip(ours, cpu)))
