"""Mobius ``--static-cache`` exports (KV buffers written in place at ``write_indices``, ``nonpad_kv_seqlen``,
``updated_*`` outputs): onnxruntime-genai 0.18 cannot load them and ortevals feeds no such inputs, so they are
refused in one line that names the format, before any data is read."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.errors import PackageError
from ortevals.package.loader import ModelPackage


@pytest.fixture(scope="module")
def static_pkg(fixture_cache):
    from tests.fixtures import mobius

    if mobius.version() == "absent":
        pytest.skip("mobius-onnx is not installed")
    return mobius.static_cache(fixture_cache)


def test_a_mobius_static_cache_export_is_refused_in_one_line_naming_the_format(static_pkg):
    import onnx

    graph = onnx.load(str(static_pkg / "model.onnx"), load_external_data=False).graph
    assert {"write_indices", "nonpad_kv_seqlen"} <= {i.name for i in graph.input}  # the format, as Mobius writes it
    with pytest.raises(PackageError) as err:
        ModelPackage.load(static_pkg)
    message = str(err.value)
    assert "a Mobius static-cache export" in message and "write_indices" in message and "\n" not in message
    result = CliRunner().invoke(cli, ["mmlu-pro", "--model-args", f"pkg={static_pkg}", "--limit", "1"])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert line.startswith("Error: ") and "\n" not in line and "a Mobius static-cache export" in line, line
