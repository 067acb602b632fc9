"""What a decoder's raw sessions are checked against when they open.

Owns the refusal of element types the provider has no kernels for (bfloat16 on CPU), and the reading of a
failed probe pass (:meth:`~ortevals.runtime.sessions.DecoderRunner.probe`): a refusal of the past KV it was
handed, where the config filled the graph's symbolic KV dims, is the config-vs-graph mismatch it is, named
by the fields; any other refusal stands as onnxruntime's own words.
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
    if provider.name == "cpu" and "bfloat16" in package_dtypes(package):
        raise PackageError(f"{package.decoder.path}: bfloat16 KV/logits need an accelerator provider; "
                           "onnxruntime's CPU kernels do not run this graph (use --ep cuda, or a fp32/fp16/int4 "
                           "package on CPU)")


def package_dtypes(package: ModelPackage) -> set[str]:
    """The element types of the decoder's KV and logits."""
    logits = package.decoder.output(package.logits_name)
    return {s.dtype for s in package.kv} | ({logits.dtype} if logits is not None else set())


def symbolic_mismatch(package: ModelPackage, ort_message: str | None) -> PackageError | None:
    """The probe failed: name the config fields that filled the graph's symbolic KV dims, if any did.

    Returns None when every KV dim is concrete in the graph (the load already
    compared those with the config) or onnxruntime's refusal is not about the past KV
    it was handed, so the generic failure stands.
    """
    if ort_message is None or "past" not in ort_message.lower():
        return None
    for spec in package.kv:
        graph = package.decoder.input(spec.key_name)
        symbolic = [d for d in (graph.shape[1], graph.shape[3]) if not isinstance(d, int)] if graph else []
        if symbolic:
            break
    else:
        return None
    reason = ort_message.split("Status Message:", 1)[-1].strip()
    dims = ", ".join(repr(d) if isinstance(d, str) else str(d) for d in graph.shape)
    return PackageError(
        f"{package.root / 'genai_config.json'}: layer {spec.layer} KV is [heads={spec.kv_heads}, "
        f"head_size={spec.head_size}] by model.decoder.num_key_value_heads/head_size, but "
        f"{package.decoder.path.name} declares {spec.key_name} as [{dims}] and refused past KV of that shape in "
        f"a probe pass ({reason}); config and graph must agree")
