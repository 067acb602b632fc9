"""A Phi package with a head size of 16 (issue 37 item 4): one line naming why it cannot run, on every path.

The builder fuses Phi's partial rotary (factor 0.5: rotary dim 8) into GroupQueryAttention with a cos_cache
of width 4; onnxruntime's kernel takes only widths that are multiples of 8. Before: a config-vs-graph
message from the probe pass on the prefill path, ``internal error`` on ``path=incremental``.
"""

import numpy as np
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.errors import PackageError
from ortevals.package.loader import ModelPackage
from tests.test_cli import assert_one_line_error

REASON = ("rotates inside the kernel with a cos_cache of width 4 (rotary dim 8) on head size 16; onnxruntime's "
          "kernel takes only widths that are multiples of 8 up to 8")


def test_onnxruntime_itself_cannot_run_the_package(phi16):
    """The ground truth behind the refusal: a plain session on the package fails in GroupQueryAttention."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(phi16[1] / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.ones((1, 2), np.int64), "attention_mask": np.ones((1, 2), np.int64)}
    feeds |= {i.name: np.zeros((1, 4, 0, 16), np.float32) for i in session.get_inputs() if i.name.startswith("past")}
    with pytest.raises(Exception, match="cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8"):
        session.run(None, feeds)


def test_the_load_names_the_rotary_cache_in_one_line(phi16):
    with pytest.raises(PackageError) as err:
        ModelPackage.load(phi16[1])
    assert REASON in str(err.value) and "\n" not in str(err.value) and "config and graph" not in str(err.value)


@pytest.mark.parametrize("path", ["prefill", "incremental"])
def test_every_path_is_one_line_exit_2(phi16, path):
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(phi16[1]), "--data", "bundled", "--limit", "1",
                                      "--no-resume", "--model-args", f"path={path}"], catch_exceptions=False)
    assert_one_line_error(result, REASON)


def test_a_runtime_failure_on_onnxruntime_genai_is_one_line_naming_the_package(phi16, monkeypatch):
    """Past the load (its rotary check off), og's own failure is a PackageError naming the package and og's
    words, not an internal error."""
    from lm_eval.api.instance import Instance

    from ortevals.integrations.lm import ModelArgs, OrtLM
    from ortevals.package import loader

    monkeypatch.setattr(loader, "_check_fused_rotary", lambda pkg: None)
    lm = OrtLM.from_package(ModelArgs(pkg=str(phi16[1]), path="incremental"))
    with pytest.raises(PackageError) as err:
        lm.loglikelihood([Instance("loglikelihood", {}, ("The capital", " of"), 0)], disable_tqdm=True)
    assert str(err.value).startswith(f"{phi16[1]}: onnxruntime-genai failed in append_tokens: ")
    assert "cos_cache dimension 1" in str(err.value) and "\n" not in str(err.value)
