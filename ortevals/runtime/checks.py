"""The element types a decoder's raw sessions hold, checked before they open.

Owns the decoder's KV and logits element types (``package_dtypes``: numpy has no bfloat16, so such KV stays
in OrtValues) and the refusal of those the provider has no kernels for (bfloat16 on CPU, an fp8 KV cache on
CPU). What a failed pass means is runtime/pass_errors.py's.
"""

from __future__ import annotations

from ortevals.errors import PackageError
from ortevals.package.loader import ModelPackage
from ortevals.runtime.providers import ProviderConfig


def check_dtypes(package: ModelPackage, provider: ProviderConfig) -> None:
    """Refuse bfloat16 KV or logits on CPU: onnxruntime has no bfloat16 CPU kernels for them.

    Measured with onnxruntime 1.32: the builder's ``-p bf16 -e cpu`` package fails to
    load (no bfloat16 Where kernel) and GroupQueryAttention has no bfloat16 CPU kernel.
    """
    check_fp8_kv(package, provider)
    if provider.name == "cpu" and "bfloat16" in package_dtypes(package):
        raise PackageError(f"{package.decoder.path}: bfloat16 KV/logits need an accelerator provider; "
                           "onnxruntime's CPU kernels do not run this graph (use --ep cuda, or a fp32/fp16/int4 "
                           "package on CPU)")


def check_fp8_kv(package: ModelPackage, provider: ProviderConfig) -> None:
    """Refuse an fp8 KV cache on CPU: onnxruntime 1.32's CPU GroupQueryAttention has no kernel for a
    ``float8e4m3fn`` cache (the builder's ``kv_cache_quant_scheme=fp8_*``: "Could not find an implementation");
    onnxruntime-genai's session fails the same way."""
    fp8 = sorted({s.dtype for s in package.kv if s.dtype.startswith("float8")})
    if provider.name == "cpu" and fp8:
        raise PackageError(f"{package.decoder.path}: a {fp8[0]} KV cache needs an accelerator provider; "
                           "onnxruntime's CPU GroupQueryAttention has no kernel for it (use --ep cuda, or an int8 or "
                           "int4 KV cache on CPU: kv_cache_quant_scheme=int8_per_channel)")


def package_dtypes(package: ModelPackage) -> set[str]:
    """The element types of the decoder's KV and logits."""
    logits = package.decoder.output(package.logits_name)
    return {s.dtype for s in package.kv} | ({logits.dtype} if logits is not None else set())
