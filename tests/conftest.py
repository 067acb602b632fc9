"""Session fixtures: packages built from code once per run and cached on disk.

The cache folder is ``$ORTEVALS_TEST_CACHE`` or ``.fixture-cache/`` in the
repo (git-ignored); a second run reuses what the first built. The real
SmolLM2-135M package goes to ortevals' own cache (``$ORTEVALS_CACHE``, set to
``.fixture-cache/ortevals`` unless already set).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CACHE = Path(os.environ.get("ORTEVALS_TEST_CACHE") or Path(__file__).resolve().parent.parent / ".fixture-cache")
REPO = Path(__file__).resolve().parent.parent
# derived graphs and the SmolLM2 example go to ortevals' cache: keep the user's apart unless asked
os.environ.setdefault("ORTEVALS_CACHE", str(CACHE / "ortevals"))


@pytest.fixture(scope="session")
def fixture_cache() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    return CACHE


@pytest.fixture(scope="session")
def tiny(fixture_cache) -> tuple[Path, Path]:
    """(hf_dir, package_dir) of the tiny random Llama."""
    from tests.fixtures.tiny import build_tiny

    return build_tiny(fixture_cache)


@pytest.fixture(scope="session")
def tiny_pkg(tiny) -> Path:
    return tiny[1]


@pytest.fixture(scope="session")
def tiny_int4(fixture_cache) -> Path:
    """The tiny random Llama's int4 package (the builder's MatMulNBits, accuracy_level 4)."""
    from tests.fixtures.tiny import build_tiny_int4

    return build_tiny_int4(fixture_cache)


@pytest.fixture(scope="session")
def longrope(fixture_cache) -> tuple[Path, Path]:
    """(hf_dir, package_dir) of the tiny Phi-3 LongRoPE package (rotary factors switch past 64 tokens)."""
    from tests.fixtures.longrope import build_longrope

    return build_longrope(fixture_cache)


@pytest.fixture(scope="session")
def gemma3(fixture_cache) -> tuple[Path, Path, Path]:
    """(hf_dir, windowed package, full-past package) of the tiny Gemma-3-shaped model (16-token windows)."""
    from tests.fixtures.gemma3 import build_gemma3

    hf_dir, windowed = build_gemma3(fixture_cache / "gemma3")
    return hf_dir, windowed, build_gemma3(fixture_cache / "gemma3", windowed=False)[1]


@pytest.fixture(scope="session")
def gemma4(fixture_cache) -> tuple[Path, Path]:
    """(hf_dir, package_dir) of the tiny Gemma-4-layout package (per-layer head sizes)."""
    from tests.fixtures.gemma4 import build_gemma4

    return build_gemma4(fixture_cache / "gemma4")


@pytest.fixture(scope="session")
def gemma4_mm(fixture_cache) -> tuple[Path, Path]:
    """(hf_dir, package_dir) of the tiny Gemma-4 multimodal package (vision + speech; og's processor
    runs on it). Built in about a second from the gemma4 fixture (issue 13)."""
    from tests.fixtures.gemma4_mm import build_gemma4_mm

    return build_gemma4_mm(fixture_cache / "gemma4")


@pytest.fixture(scope="session")
def gemma4_mm_windowed(fixture_cache) -> tuple[Path, Path]:
    """gemma4_mm on the builder's windowed sliding KV cache (rewinding is not exact there)."""
    from tests.fixtures.gemma4_mm import build_gemma4_mm

    return build_gemma4_mm(fixture_cache / "gemma4", windowed=True)


@pytest.fixture(scope="session")
def lfm2(fixture_cache) -> tuple[Path, Path]:
    """(hf_dir, package_dir) of the tiny LFM2 (short convolutions beside attention), fp32."""
    from tests.fixtures.hybrid import build_lfm2

    return build_lfm2(fixture_cache / "hybrid")


@pytest.fixture(scope="session")
def lfm2_int4(fixture_cache) -> tuple[Path, Path]:
    """(hf_dir, package_dir) of the tiny LFM2, int4 (MatMulNBits)."""
    from tests.fixtures.hybrid import build_lfm2

    return build_lfm2(fixture_cache / "hybrid", "int4")


@pytest.fixture(scope="session")
def qwen35(fixture_cache) -> tuple[Path, Path]:
    """(hf_dir, package_dir) of the tiny Qwen3.5 (gated delta-net linear attention beside attention), fp32."""
    from tests.fixtures.hybrid import build_qwen35

    return build_qwen35(fixture_cache / "hybrid")


@pytest.fixture(scope="session")
def phi16(fixture_cache) -> tuple[Path, Path]:
    """(hf_dir, package_dir) of the tiny Phi with a head size of 16 (a package onnxruntime cannot run)."""
    from tests.fixtures.phi16 import build_phi16

    return build_phi16(fixture_cache / "phi16")


@pytest.fixture(scope="session")
def smollm2() -> tuple[Path, Path]:
    """(hf_dir, package_dir) of the real SmolLM2-135M-Instruct, fp32."""
    from ortevals.package.examples import smollm2_hf_dir, smollm2_package

    return smollm2_hf_dir(), smollm2_package("fp32")


@pytest.fixture()
def copy_pkg(tmp_path):
    """Copy a package folder into tmp_path so a test can break it."""
    import shutil

    def _copy(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copytree(src, dst)
        return dst

    return _copy


@pytest.fixture(scope="session")
def reference_scores(tiny_pkg) -> list[float]:
    """Log-likelihoods of tests/test_properties.py's requests on the unmodified tiny package."""
    from lm_eval.api.instance import Instance

    from ortevals.integrations.lm import ModelArgs, OrtLM
    from tests.test_properties import REQS

    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), batch_size=1))
    return [lp for lp, _ in lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQS)],
                                             disable_tqdm=True)]


@pytest.fixture(scope="session")
def tiny_orm(fixture_cache, tiny) -> tuple[Path, Path]:
    """(hf_dir, onnx_dir) of the tiny outcome reward model (issue 25), on the tiny package's tokenizer."""
    from tests.fixtures.orm import build_orm

    return build_orm(fixture_cache, tiny[0])


@pytest.fixture(scope="session")
def tiny_orm2(fixture_cache, tiny) -> tuple[Path, Path]:
    """(hf_dir, onnx_dir) of the tiny two-label sequence classifier (softmax; label 1 the right answer's)."""
    from tests.fixtures.orm import build_orm

    return build_orm(fixture_cache, tiny[0], labels=2)
