"""Human-readable description of a loaded package (``ortevals info``).

Owns the text layout only: models that would be opened and those that are
skipped, per-layer KV shapes (runs of identical layers folded into one line),
and the providers the package asks for beside those this install has.
"""

from __future__ import annotations

from ortevals.package.loader import KVSpec, ModelPackage


def _size(path) -> str:
    from ortevals.package.graph import external_data_files

    total = path.stat().st_size + sum(f.stat().st_size for f in external_data_files(path))
    return f"{total / 2**20:.1f} MiB"


def _layer_runs(kv: tuple[KVSpec, ...]) -> list[str]:
    """Fold consecutive layers with the same shape: ``layers 0-3: float32 [B, 1, past, 32]``."""
    runs: list[list[KVSpec]] = []
    for spec in kv:
        key = (spec.dtype, spec.kv_heads, spec.head_size, spec.window)
        if runs and (runs[-1][0].dtype, runs[-1][0].kv_heads, runs[-1][0].head_size, runs[-1][0].window) == key:
            runs[-1].append(spec)
        else:
            runs.append([spec])
    lines = []
    for run in runs:
        first, last = run[0], run[-1]
        span = f"{first.layer}" if first is last else f"{first.layer}-{last.layer}"
        past = f"window {first.window}" if first.window else "past"
        lines.append(f"  layers {span:<7} {first.dtype} [B, {first.kv_heads}, {past}, {first.head_size}]")
    return lines


def describe_package(pkg: ModelPackage) -> str:
    from ortevals.runtime import available_providers
    from ortevals.runtime.providers import from_package

    lines = [f"package   {pkg.root}", f"type      {pkg.model_type}", "models:"]
    if pkg.embedding is not None:
        lines.append(f"  embedding {pkg.embedding.path.name} ({_size(pkg.embedding.path)}) -> "
                     + ", ".join(o.name for o in pkg.embedding.graph_outputs))
    lines.append(f"  decoder   {pkg.decoder.path.name} ({_size(pkg.decoder.path)}) inputs: "
                 + ", ".join(i.name for i in pkg.decoder.graph_inputs if not i.name.startswith("past_")))
    if pkg.skipped_models:
        lines.append(f"  not opened for text benchmarks: {', '.join(pkg.skipped_models)}")
    lines.append(f"logits    {pkg.logits_name} [B, {pkg.logits_positions}, {pkg.logits_width}]  "
                 f"vocab_size {pkg.vocab_size}  context_length {pkg.context_length}")
    lines.append(f"tokens    bos {pkg.bos_token_id}  eos {list(pkg.eos_token_ids)}  pad {pkg.pad_token_id}")
    lines.append(f"KV cache: {len(pkg.kv)} layers")
    lines.extend(_layer_runs(pkg.kv))
    wanted = from_package(pkg.decoder.session_options)
    lines.append(f"providers package: {wanted.name} {wanted.options or ''}".rstrip())
    if wanted.raw_options != wanted.options:  # og-only options (cuda graphs) kept from raw sessions
        lines.append(f"          raw sessions: {wanted.name} {wanted.raw_options or ''}".rstrip())
    lines.append(f"          installed: {', '.join(available_providers())}")
    lines.append(f"fingerprint {pkg.fingerprint()}")
    return "\n".join(lines)
