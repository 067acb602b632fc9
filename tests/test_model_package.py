"""ONNX Runtime model packages (issue 48 §3): ``--pkg ROOT --ep NAME`` opens the variant onnxruntime chooses.

The package (tests/fixtures/model_package.py) is written by onnxruntime's own authoring API in the layout
onnxruntime-genai 0.18 loads: ``manifest.json``, a folder per variant, the tokenizer in ``shared_assets/sha256-…``
named by ``model.tokenizer_dir``. onnxruntime's model-package reader (``ModelPackageContext``) is the oracle for
which variant and which tokenizer folder; the variant folder run as a plain package is the oracle for the numbers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance

from ortevals.errors import PackageError
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from ortevals.package.tokenizer import Tokenizer, tokenizer_reads
from tests.test_cli import assert_one_line_error, run

PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " the city of light"),
         ("one two three four five", " six seven")]


@pytest.fixture(scope="module")
def package(tmp_path_factory, tiny_pkg, tiny_int4) -> tuple[Path, str]:
    from tests.fixtures.model_package import build_model_package

    return build_model_package(tmp_path_factory.mktemp("mp") / "tiny.ortpackage", tiny_int4, tiny_pkg)


def _scores(**args) -> list[tuple[float, bool]]:
    lm = OrtLM.from_package(ModelArgs(max_length=256, **args))
    return lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)], disable_tqdm=True)


def test_the_variant_and_tokenizer_are_those_onnxruntime_resolves(package):
    import onnxruntime as ort

    root, uri = package
    context = ort.ModelPackageContext(str(root))
    chosen = context.select_component("model", ort.ModelPackageOptions(ort.SessionOptions()))
    pkg = ModelPackage.load(root, "cpu")
    assert (pkg.variant.name, pkg.root) == (chosen.get_selected_variant_name(),
                                            Path(chosen.get_selected_variant_folder_path()))
    assert pkg.variant.name == "cpu-int4" and pkg.tokenizer_root == Path(context.resolve_string_ref(uri))
    assert not (pkg.root / "tokenizer.json").exists()  # the variant folder has none: only the shared asset
    assert ModelPackage.load(root, "OpenVINOExecutionProvider").variant.name == "openvino-fp32"
    assert ModelPackage.load(root / "openvino-fp32").variant.name == "openvino-fp32"  # a variant folder given directly
    assert tokenizer_reads(pkg).files[0] == pkg.tokenizer_root / "tokenizer.json"  # the run's scope keys it


@pytest.mark.parametrize("path", ["default", "incremental"])
def test_scores_equal_the_variant_run_as_a_plain_package(package, tiny_int4, path):
    """The prefill path reads the tokenizer from the shared asset; onnxruntime-genai (0.18 here, without
    model-package support) opens the variant folder with the shared asset as its tokenizer folder."""
    root, _ = package
    extra = {"path": "incremental"} if path == "incremental" else {}
    ours = _scores(pkg=str(root), ep="cpu", **extra)
    assert ours == _scores(pkg=str(tiny_int4), **extra)
    lm = OrtLM.from_package(ModelArgs(pkg=str(root), ep="cpu"))
    info = lm.get_model_info()
    assert info["model_variant"] == {"name": "cpu-int4", "execution_provider": "CPUExecutionProvider", "device": "cpu",
                                     "package": str(root.resolve())}


def test_the_cli_prints_and_records_the_variant(package, tmp_path, caplog):
    from ortevals.cli_common import NOTICES

    root, _ = package
    out = tmp_path / "run"
    result = run("mmlu-pro", "--pkg", str(root), "--ep", "cpu", "--data", "bundled", "--limit", "1", "--output",
                 str(out), "--no-resume", "--truncate", "left")
    assert result.exit_code == 0, result.output
    notice = [r for r in caplog.records if r.name == "ortevals.package.manifest"]  # printed as is (cli NOTICES)
    assert notice and notice[0].name in NOTICES
    assert notice[0].getMessage() == f"model package {root}: variant cpu-int4 (CPUExecutionProvider, cpu) for --ep cpu"
    assert f"variant cpu-int4 of {root.resolve()}" in result.output  # the summary's model line
    config = json.loads((out / "results.json").read_text())["config"]
    assert config["model_variant"]["name"] == "cpu-int4" and "ep=cpu" in config["model_args"]
    info = run("info", "--pkg", str(root), "--ep", "openvino")
    assert info.exit_code == 0 and "variant   openvino-fp32 (OpenVINOExecutionProvider) of model package" in info.output


def _break(root: Path, how: str) -> None:
    manifest = root / "manifest.json"
    data = json.loads(manifest.read_text())
    if how == "not json":
        manifest.write_text("{")
    elif how == "two components":
        data["components"]["vision"] = {"variants": {}}
        manifest.write_text(json.dumps(data))
    elif how == "variant folder":
        (root / "cpu-int4" / "genai_config.json").unlink()
    elif how == "asset missing":
        shutil.rmtree(next((root / "shared_assets").iterdir()))
    elif how == "escaping tokenizer_dir":
        config = json.loads((root / "cpu-int4" / "genai_config.json").read_text())
        config["model"]["tokenizer_dir"] = "../shared_assets"
        (root / "cpu-int4" / "genai_config.json").write_text(json.dumps(config))
    elif how == "olive 0.13":
        manifest.write_text(json.dumps({"schema_version": 1, "components": ["decoder"], "configs_dir": "configs"}))


@pytest.mark.parametrize("how, ep, needle", [
    ("none", "cuda", "no variant for execution provider 'cuda'; the package has cpu-int4 (CPUExecutionProvider, cpu), "
                     "openvino-fp32 (OpenVINOExecutionProvider, cpu): give --ep one of cpu, openvino"),
    ("none", None, "variants for 2 execution providers"),
    ("not json", "cpu", "not a readable JSON manifest"),
    ("two components", "cpu", "field components must hold exactly one component"),
    ("variant folder", "cpu", "variant 'cpu-int4' has no genai_config.json in"),
    ("asset missing", "cpu", "which is not a folder; expected the shared asset holding the tokenizer files"),
    ("escaping tokenizer_dir", "cpu", "model.tokenizer_dir='../shared_assets' must be a relative path inside"),
    ("olive 0.13", "cpu", "the layout Olive 0.13's generate-model-package writes"),
])
def test_a_package_that_cannot_be_opened_is_one_line(package, tmp_path, how, ep, needle):
    root = tmp_path / "pkg"
    shutil.copytree(package[0], root)
    _break(root, how)
    with pytest.raises(PackageError) as err:
        ModelPackage.load(root, ep)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert_one_line_error(run("info", "--pkg", str(root), *(("--ep", ep) if ep else ())), needle)


def test_a_plain_folder_honours_tokenizer_dir_and_refuses_a_shared_asset_reference(tiny_pkg, copy_pkg):
    pkg = copy_pkg(tiny_pkg)
    (pkg / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (pkg / name).rename(pkg / "tok" / name)
    config = json.loads((pkg / "genai_config.json").read_text())
    config["model"]["tokenizer_dir"] = "tok"
    (pkg / "genai_config.json").write_text(json.dumps(config))
    loaded = ModelPackage.load(pkg)
    assert loaded.tokenizer_root == pkg / "tok"
    text = "The capital of France is Paris"
    assert Tokenizer.load(loaded).encode(text) == Tokenizer.load(ModelPackage.load(tiny_pkg)).encode(text)
    assert _scores(pkg=str(pkg), path="incremental") == _scores(pkg=str(tiny_pkg), path="incremental")  # og: tok/
    config["model"]["tokenizer_dir"] = "sha256:" + "0" * 64
    (pkg / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(PackageError, match="is a sha256: shared-asset reference, valid only in a model package"):
        ModelPackage.load(pkg)


def test_an_unrelated_manifest_above_a_plain_package_changes_nothing(tiny_pkg, tmp_path):
    (tmp_path / "manifest.json").write_text('{"name": "a web app"}')
    pkg = tmp_path / "model"
    shutil.copytree(tiny_pkg, pkg)
    loaded = ModelPackage.load(pkg)
    assert loaded.variant is None and loaded.tokenizer_root == pkg


def _accepted_suggestions(message: str, flag: str) -> list[str]:
    """The values a refusal tells the user to give ``flag``: the list after ``give FLAG one of``."""
    listed = message.split(f"give {flag} one of ", 1)[1].split(" (", 1)[0]
    return listed.split(", ")


@pytest.mark.parametrize("ep, flag", [("cuda", "--ep"), (None, "--ep (model_args ep=)")])
def test_a_variant_for_a_provider_ortevals_does_not_run_is_never_suggested(package, tmp_path, ep, flag):
    """A variant tagged with a provider ortevals does not know (Xnnpack) was listed among the values to give --ep,
    which --ep then refused (issue 55 item 13): every value suggested opens a variant."""
    from ortevals.package.session_options import normalize

    root = tmp_path / "pkg"
    shutil.copytree(package[0], root)
    data = json.loads((root / "manifest.json").read_text())
    data["components"]["model"]["variants"]["xnnpack"] = {"ep": "XnnpackExecutionProvider", "device": "cpu",
                                                          "variant_directory": "cpu-int4"}
    (root / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackageError) as err:
        ModelPackage.load(root, ep)
    message = str(err.value)
    suggested = _accepted_suggestions(message, flag)
    assert sorted(suggested) == ["cpu", "openvino"]
    for value in suggested:  # each is a value --ep takes, and it opens its variant
        assert ModelPackage.load(root, normalize(value)).variant.ep == value
    assert "(XnnpackExecutionProvider: an execution provider ortevals does not run)" in message
    assert_one_line_error(run("info", "--pkg", str(root), *(("--ep", ep) if ep else ())), f"give {flag} one of")


def test_an_ep_naming_a_variant_ortevals_cannot_run_or_a_typo_is_one_line(package, tmp_path):
    root = tmp_path / "pkg"
    shutil.copytree(package[0], root)
    data = json.loads((root / "manifest.json").read_text())
    data["components"]["model"]["variants"]["xnnpack"] = {"ep": "XnnpackExecutionProvider",
                                                          "variant_directory": "cpu-int4"}
    (root / "manifest.json").write_text(json.dumps(data))
    assert_one_line_error(run("info", "--pkg", str(root), "--ep", "XnnpackExecutionProvider"),
                          "variant 'xnnpack' is for XnnpackExecutionProvider, an execution provider ortevals does "
                          "not run; give --ep one of cpu, openvino")
    assert_one_line_error(run("info", "--pkg", str(root), "--ep", "opnvino"),
                          "no variant for execution provider 'opnvino' (did you mean 'openvino'?)")
