"""Which provider option names an execution provider takes: the user's ``--provider-option`` checked by name.

onnxruntime handles an option it does not know in one of three ways, by provider:

* **CPU** takes no options. onnxruntime silently ignores any (``get_provider_options()`` shows
  ``{}``) and onnxruntime-genai 0.18 refuses every one ("CPU execution provider does not support
  provider options"): a user option on CPU is a **warning** naming it, ignored (ortevals never hands
  onnxruntime-genai CPU options, and onnxruntime drops them).
* **CUDA** parses its options with onnxruntime's ``ProviderOptionsParser``, which refuses an unknown
  name when the session opens (``Unknown provider option``). The names below are those of
  ``cuda_execution_provider_info.cc`` (onnxruntime 1.17–1.22); a name outside them is a **warning**
  naming the closest known one, since a newer onnxruntime may add names (it refuses a wrong one
  itself when the session opens, in one line).
* Other providers: not checked here (their option sets change from release to release); logged at info.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ortevals.errors import did_you_mean

log = logging.getLogger(__name__)

KNOWN_OPTIONS: dict[str, frozenset[str]] = {
    "cpu": frozenset(),
    "cuda": frozenset({
        "device_id", "has_user_compute_stream", "user_compute_stream", "gpu_mem_limit", "arena_extend_strategy",
        "cudnn_conv_algo_search", "do_copy_in_default_stream", "gpu_external_alloc", "gpu_external_free",
        "gpu_external_empty_cache", "cudnn_conv_use_max_workspace", "enable_cuda_graph", "cudnn_conv1d_pad_to_nc1d",
        "tunable_op_enable", "tunable_op_tuning_enable", "tunable_op_max_tuning_duration_ms",
        "enable_skip_layer_norm_strict_mode", "prefer_nhwc", "use_ep_level_unified_stream", "use_tf32",
        "sdpa_kernel", "fuse_conv_bias"}),
}


def check_user_options(provider: str, keys: Iterable[str]) -> None:
    """The user's option names for ``provider`` (a short name): a warning on CPU (it takes none), a warning
    for an unknown CUDA name, nothing for providers whose names are not listed."""
    keys = list(keys)
    if not keys:
        return
    known = KNOWN_OPTIONS.get(provider)
    if known is None:
        log.info("%s provider options are passed on unchecked: %s", provider, ", ".join(keys))
        return
    if provider == "cpu":
        log.warning("--provider-option %s: the CPU execution provider takes no provider options, so %s ignored "
                    "(onnxruntime ignores them, onnxruntime-genai refuses them); use --threads for threads, or --ep "
                    "for another provider", ", ".join(keys), "it is" if len(keys) == 1 else "they are")
        return
    for key in keys:
        if key not in known:
            log.warning("--provider-option %s: not a %s option this version of ortevals knows%s; onnxruntime "
                        "refuses it when the session opens if it does not know it either", key, provider,
                        did_you_mean(key, known))
