"""What a failed forward pass means: a kernel's limit on this provider, or a config that disagrees with the graph.

Owns the two readings of onnxruntime's error text when the decoder's first pass (the probe,
runtime/sessions.py) or a later one fails. :func:`kernel_limit`: a kernel says it does not support
something on this provider (onnxruntime's wording: "... are not supported", "implemented only on the
CUDA and WebGPU EPs"), e.g. the CUDA build of a Qwen3 package, whose GroupQueryAttention takes the
per-head q/k RMS-norm weights (``q_norm_weight``/``k_norm_weight``) that only the CUDA and WebGPU kernels
apply: one line naming the kernel's own reason, the provider and the provider the package was built
for, never blaming genai_config.json. :func:`symbolic_mismatch`: the graph's symbolic KV dims were filled
by config fields the kernel refused. Pure: reads the package's config and the error text only.
"""

from __future__ import annotations

import re

from ortevals.errors import PackageError
from ortevals.package.loader import ModelPackage
from ortevals.package.session_options import provider_entries

# onnxruntime kernels' own words for "this provider (or type) cannot do that" (contrib_ops/*, e.g.
# contrib_ops/cpu/bert/group_query_attention.cc), matched case-insensitively
KERNEL_LIMIT = re.compile(r"\bnot supported\b|\bnot implemented\b|\bimplemented only on\b|\bonly supported on\b",
                          re.IGNORECASE)


def kernel_limit(package: ModelPackage, session, ort_message: str | None) -> PackageError | None:
    """One line when ``ort_message`` is a kernel refusing this graph on ``session``'s provider, else None."""
    if not ort_message or not KERNEL_LIMIT.search(ort_message):
        return None
    reason = ort_message.split("Status Message:", 1)[-1].strip()
    provider = (session.get_providers() or ["?"])[0]
    built = [name for name, _ in provider_entries(package.decoder.session_options)]
    hint = (f"; the package was built for {built[0]} (genai_config.json provider_options): run it with --ep {built[0]}"
            if built and built[0] != "cpu" else "")
    return PackageError(f"{package.decoder.path}: a kernel of {provider} cannot run this graph: {reason} "
                        f"(a limit of onnxruntime's kernel on this provider, not of the package's config){hint}")


def symbolic_mismatch(package: ModelPackage, ort_message: str | None) -> PackageError | None:
    """The probe failed: name the config fields that filled the graph's symbolic KV dims, if any did.

    Returns None when every KV dim is concrete in the graph (the load already
    compared those with the config) or onnxruntime's refusal is not about the past KV
    it was handed (a kernel that refuses the graph itself: the generic failure stands).
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
