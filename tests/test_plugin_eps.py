"""Execution providers that ship as plugin packages (issue 48 §7, runtime/plugins.py).

Without the package, ``--ep NAME`` is one line naming the package to install, before any work. With it installed
(install.sh installs ``onnxruntime-ep-openvino``), the plugin is registered with onnxruntime and a session is handed
its devices, every time (:func:`~ortevals.runtime.plugins.route`): on a machine where it offers none (the plugin
1.8.1 offers no device on an AMD EPYC, although OpenVINO's own runtime lists that CPU) the refusal says so in one
line; where it offers one (CPU devices on an Intel Xeon), the package is scored on it in f32, within 1e-3 of the CPU
provider, and the run records the plugin's version and the precision in its scope. Both cases run with the real
plugin where it is installed, the one this machine does not offer skipped with the reason; the routing decision is
also tested directly and against onnxruntime as it behaves on the Intel machine.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from lm_eval.api.instance import Instance

from ortevals.errors import OrtEvalsError, ProviderError
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from ortevals.runtime import opening, plugins
from ortevals.runtime.providers import from_package
from tests.test_cli import assert_one_line_error, run

OPENVINO = "OpenVINOExecutionProvider"
PAIRS = [("The capital of France is", " Paris"), ("one two three four", " five six")]
TOLERANCE = 1e-3  # |log-likelihood(OpenVINO, f32) - log-likelihood(CPU provider)|: both float32, other kernels


@pytest.mark.parametrize("ep, package", [
    ("openvino", "onnxruntime-ep-openvino"), ("webgpu", "onnxruntime-ep-webgpu"),
    ("nvtensorrtrtx", "onnxruntime-ep-nv-tensorrt-rtx"), ("qnn", "onnxruntime-qnn")])
def test_a_plugin_provider_not_installed_names_its_package_before_any_work(tiny_pkg, monkeypatch, ep, package):
    """Where the package is installed (OpenVINO here), it is taken away from ortevals' lookup. QNN runs on the
    incremental path (onnxruntime-genai), which refused it only at its first request, after the progress bar."""
    monkeypatch.setattr(plugins, "find_plugin", lambda ep_name: None)
    monkeypatch.setattr(plugins, "_REGISTERED", {})
    result = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--ep", ep, "--limit", "1", "--truncate",
                 "left")
    assert_one_line_error(result, "is not available in this onnxruntime install",
                          f"it ships as a plugin package: pip install {package}, or pass --ep cpu")
    assert "questions" not in result.output and "it/s" not in result.output  # no progress bar: refused before work


@pytest.mark.parametrize("ep, package", [("openvino", "onnxruntime-ep-openvino"), ("qnn", "onnxruntime-qnn")])
def test_a_session_landing_on_the_cpu_names_the_plugin_package(tiny_pkg, ep, package):
    """onnxruntime puts a session it cannot give the provider on the CPU provider with a warning: the refusal names
    the plugin package that provides it."""
    session = SimpleNamespace(get_providers=lambda: ["CPUExecutionProvider"])
    with pytest.raises(ProviderError) as err:
        opening.check_provider(session, from_package({}, ep), tiny_pkg / "model.onnx")
    assert "requested but the session runs on CPUExecutionProvider" in str(err.value)
    assert f"install its plugin package (pip install {package})" in str(err.value)


@pytest.mark.parametrize("registered, listed, devices, way", [
    (False, True, 0, plugins.BY_NAME),  # built into this onnxruntime (CUDA in onnxruntime-gpu): its name
    (False, False, 0, plugins.REGISTER),  # not listed: a plugin package to find and register
    (True, True, 1, plugins.BY_DEVICES),  # registered, offering a device, and so listed (Intel Xeon): its devices
    (True, False, 0, plugins.NO_DEVICE),  # registered, offering none, not listed (AMD EPYC): refused
    (True, True, 0, plugins.NO_DEVICE),
])
def test_the_route_follows_the_registration_record_not_the_provider_list(registered, listed, devices, way):
    assert plugins.route(registered, listed, devices) == way


class IntelOrt:
    """onnxruntime 1.32 as it behaves on an Intel Xeon with onnxruntime-ep-openvino 1.8.1 (issue 57): once the plugin
    is registered it is listed among the available providers and offers a CPU device; a session handed the provider
    by name lands on the CPU provider, one handed the plugin's devices runs on it."""

    GraphOptimizationLevel = SimpleNamespace(ORT_ENABLE_ALL="all")

    def __init__(self):
        self.registered: list[str] = []
        self.sessions: list[SimpleNamespace] = []

    def get_available_providers(self):
        return [*self.registered, "CPUExecutionProvider"]

    def register_execution_provider_library(self, name, path):
        self.registered.append(name)

    def get_ep_devices(self):
        return [SimpleNamespace(ep_name=name, device=SimpleNamespace(type="CPU", vendor="Intel"))
                for name in ["CPUExecutionProvider", *self.registered]]

    def SessionOptions(self):  # noqa: N802 - onnxruntime's name
        so = SimpleNamespace(entries={}, devices=None, ep_options=None)
        so.add_session_config_entry = so.entries.__setitem__
        so.add_provider_for_devices = lambda devices, options: so.__dict__.update(devices=devices, ep_options=options)
        return so

    def InferenceSession(self, source, so, providers=None):  # noqa: N802 - onnxruntime's name
        on = [d.ep_name for d in so.devices] if so.devices else ["CPUExecutionProvider"]  # by name: the CPU
        session = SimpleNamespace(so=so, providers=providers, get_providers=lambda: [*on, "CPUExecutionProvider"])
        self.sessions.append(session)
        return session


def test_a_registered_plugin_listed_as_available_is_still_handed_its_devices(tiny_pkg, monkeypatch):
    """The second lookup of a session's opening (after registration, the plugin listed as available) took the
    built-in route, and the session landed on the CPU provider (issue 57 item 4)."""
    ort = IntelOrt()
    monkeypatch.setattr(opening, "import_ort", lambda: ort)
    monkeypatch.setattr(plugins, "_REGISTERED", {})
    monkeypatch.setattr(plugins, "find_plugin", lambda ep_name: plugins.Plugin(
        ep_name, Path("/plugin/libonnxruntime_providers_openvino_plugin.so"), "onnxruntime-ep-openvino"))
    provider = from_package({}, "openvino")
    opening.open_session(ModelPackage.load(tiny_pkg).decoder, provider)
    (session,) = ort.sessions
    assert ort.registered == [OPENVINO]  # registered once
    assert [d.ep_name for d in session.so.devices] == [OPENVINO] and session.providers is None
    assert json.loads(session.so.ep_options["load_config"])["CPU"] == {"INFERENCE_PRECISION_HINT": "f32"}
    assert session.get_providers()[0] == OPENVINO


@pytest.fixture(scope="module")
def openvino_devices() -> int:
    """How many devices the installed OpenVINO plugin offers on this machine, asked of onnxruntime itself in a fresh
    process (so this process's registration record stays ortevals' own)."""
    pytest.importorskip("onnxruntime_ep_openvino")
    code = ("import onnxruntime as o, onnxruntime_ep_openvino as p; "
            f"o.register_execution_provider_library({OPENVINO!r}, p.get_library_path()); "
            f"print(sum(d.ep_name == {OPENVINO!r} for d in o.get_ep_devices()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.split()[-1])


def _requests():
    return [Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)]


def test_the_installed_openvino_plugin_offering_no_device_is_refused_in_one_line(tiny_int4, openvino_devices):
    if openvino_devices:
        pytest.skip(f"the OpenVINO plugin offers {openvino_devices} device(s) on this machine: "
                    "test_the_installed_openvino_plugin_offering_a_device_scores_on_it_in_f32 runs instead")
    from ortevals.runtime.reads import session_reads

    package = ModelPackage.load(tiny_int4)
    assert "onnxruntime-ep-openvino" in session_reads(package.decoder, from_package({}, "openvino")).dists
    with pytest.raises(OrtEvalsError) as err:
        OrtLM.from_package(ModelArgs(pkg=str(tiny_int4), ep="openvino"))
    version = importlib.metadata.version("onnxruntime-ep-openvino")
    assert f"{OPENVINO} registered from onnxruntime-ep-openvino {version} offers no device on this machine" in str(
        err.value) and "\n" not in str(err.value)
    result = run("mmlu-pro", "--pkg", str(tiny_int4), "--data", "bundled", "--ep", "openvino", "--limit", "1")
    assert_one_line_error(result, "offers no device on this machine", "pass --ep cpu")


def test_the_installed_openvino_plugin_offering_a_device_scores_on_it_in_f32(tiny_pkg, openvino_devices):
    if not openvino_devices:
        pytest.skip("the OpenVINO plugin offers no device on this machine (none on AMD EPYC machines; CPU devices on "
                    "an Intel Xeon): test_the_installed_openvino_plugin_offering_no_device_is_refused_in_one_line "
                    "runs instead")
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), ep="openvino"))
    ours = lm.loglikelihood(_requests(), disable_tqdm=True)
    assert lm.run.backends.prefill.runner.decoder.get_providers()[0] == OPENVINO  # onnxruntime's own word
    options = lm.get_model_info()["provider_options"]  # the run info; the scope records the same options
    assert json.loads(options["load_config"])["CPU"] == {"INFERENCE_PRECISION_HINT": "f32"}
    cpu = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), ep="cpu")).loglikelihood(_requests(), disable_tqdm=True)
    deltas = [abs(a - b) for (a, _), (b, _) in zip(ours, cpu, strict=True)]
    assert max(deltas) <= TOLERANCE, deltas


def test_the_og_path_scope_records_the_plugin_version(tiny_pkg):
    """onnxruntime-genai's path runs the plugin provider too (registered with og): its scope names the plugin's
    distribution, as the raw sessions' does (issue 55 item 7b)."""
    pytest.importorskip("onnxruntime_ep_openvino")
    from ortevals.runtime.genai import genai_reads
    from ortevals.runtime.media import media_reads

    package, openvino = ModelPackage.load(tiny_pkg), from_package({}, "openvino")
    for reads in (genai_reads(package, openvino), media_reads(package, openvino)):
        assert reads.dists == ("onnxruntime-genai", "onnxruntime", "onnxruntime-ep-openvino")
    assert genai_reads(package, from_package({}, "cpu")).dists == ("onnxruntime-genai", "onnxruntime")


