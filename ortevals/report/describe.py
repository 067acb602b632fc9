"""Human-readable description of a loaded package (``ortevals info``).

Owns the text layout only: models that would be opened and those that are
skipped, per-layer KV shapes (runs of identical layers folded into one line),
and the providers the package asks for beside those this install has.
"""

from __future__ import annotations

from ortevals.package.adapters import describe_adapter_inputs
from ortevals.package.lint import lint
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
        if runs and (runs[-1][0].dtype, runs[-1][0].kv_heads, runs[-1][0].head_size, runs[-1][0].window) == key \
                and runs[-1][-1].layer + 1 == spec.layer:  # a hybrid's KV layers skip its recurrent ones
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


def _media_lines(pkg: ModelPackage) -> list[str]:
    """The vision and speech models (name, size) and their processor configs (the operations listed),
    never opened; then whether image/audio requests can run, or the one-line reason they cannot."""
    from ortevals.errors import OrtEvalsError
    from ortevals.package.multimodal import DEFAULT_VISION_CONFIG, multimodal_spec

    lines = []
    model = pkg.config["model"]
    for role, default in (("vision", DEFAULT_VISION_CONFIG), ("speech", None)):
        section = model.get(role)
        if not isinstance(section, dict) or not section.get("filename"):
            continue
        path = pkg.root / section["filename"]
        size = _file_size(path) if path.is_file() else "missing"
        conf_name = section.get("config_filename") or default
        lines.append(f"  {role:<9} {section['filename']} ({size}), not opened; inputs: "
                     + ", ".join((section.get("inputs") or {}).values()))
        if conf_name:
            lines.append(f"            config {conf_name}: {_config_ops(pkg.root / conf_name)}")
    try:
        spec = multimodal_spec(pkg)
        kinds = [k for k, ok in (("images", spec.takes_images), ("audio", spec.takes_audio)) if ok]
        markers = [spec.image_marker] + ([spec.audio_marker] if spec.takes_audio else [])
        lines.append(f"  media     {' and '.join(kinds)} via onnxruntime-genai's processor; "
                     f"markers {' '.join(markers)}")
    except OrtEvalsError as e:
        lines.append(f"  media     image/audio requests cannot run: {e}")
    return lines


def _file_size(path) -> str:
    """Size of a model and its usual external-data files, without parsing the model."""
    extra = [path.with_name(path.name + ".data"), path.with_name(path.name + "_data"), path.with_suffix(".onnx.data")]
    total = path.stat().st_size + sum(f.stat().st_size for f in set(extra) if f.is_file())
    return f"{total / 2**20:.1f} MiB"


def _config_ops(path) -> str:
    """``DecodeImage, Gemma4ImageTransform(max_soft_tokens=16, ...)`` from an ort-extensions config."""
    import json

    if not path.is_file():
        return "missing"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return "not valid JSON"
    body = next((v for v in data.values() if isinstance(v, dict)), {}) if isinstance(data, dict) else {}
    steps = body.get("transforms") or body.get("sequence") or []
    ops = []
    for step in steps:
        op = step.get("operation", {}) if isinstance(step, dict) else {}
        attrs = op.get("attrs") or {}
        keys = [k for k in ("max_soft_tokens", "patch_size", "sampling_rate", "feature_size") if k in attrs]
        ops.append(str(op.get("type", "?")) + (f"({', '.join(f'{k}={attrs[k]}' for k in keys)})" if keys else ""))
    return ", ".join(ops) or "no operations"


def describe_package(pkg: ModelPackage) -> str:
    from ortevals.errors import ProviderError
    from ortevals.install import available_providers
    from ortevals.runtime.providers import from_package

    lines = [f"package   {pkg.root}", f"type      {pkg.model_type}"]
    if pkg.variant is not None:  # a model package's variant (package/manifest.py)
        lines.append(f"variant   {pkg.variant.name} ({pkg.variant.ep_name}) of model package {pkg.manifest.root}; "
                     f"its variants: {pkg.manifest.describe()}")
    if pkg.tokenizer_root != pkg.root:
        lines.append(f"tokenizer {pkg.tokenizer_root} (model.tokenizer_dir {pkg.config['model'].get('tokenizer_dir')})")
    lines.append("models:")
    if pkg.embedding is not None:
        lines.append(f"  embedding {pkg.embedding.path.name} ({_size(pkg.embedding.path)}) -> "
                     + ", ".join(o.name for o in pkg.embedding.graph_outputs))
    lines.append(f"  decoder   {pkg.decoder.path.name} ({_size(pkg.decoder.path)}) inputs: "
                 + ", ".join(i.name for i in pkg.decoder.graph_inputs
                             if not i.name.startswith("past_") and i.name not in {s.name for s in pkg.states}))
    if pkg.skipped_models:
        lines.append(f"  not opened for text benchmarks: {', '.join(pkg.skipped_models)}")
        lines.extend(_media_lines(pkg))  # issue 13: vision/speech + processor configs, read as files only
    lines.append(f"logits    {pkg.logits_name} [B, {pkg.logits_positions}, {pkg.logits_width}]  "
                 f"vocab_size {pkg.vocab_size}  context_length {pkg.context_length}")
    lines.append(f"tokens    bos {pkg.bos_token_id}  eos {list(pkg.eos_token_ids)}  pad {pkg.pad_token_id}")
    lines.append(f"KV cache: {len(pkg.kv)} layers")
    lines.extend(_layer_runs(pkg.kv))
    if pkg.shared_kv:  # Gemma 4 E2B/E4B: layers with no cache of their own (package/layers.py)
        lines.append(f"  {len(pkg.shared_kv)} more layers attend to another layer's KV: "
                     + ", ".join(f"{layer}<-{source}" for layer, source in pkg.shared_kv))
    if pkg.states:  # a hybrid: state valid at exactly the position it was made (package/state.py)
        lines.append(f"recurrent state: {len({s.layer for s in pkg.states})} layers")
        lines.extend(f"  layer {s.layer:<8} {s.kind} {s.dtype} [B, {', '.join(map(str, s.shape))}]" for s in pkg.states)
    lines.extend(describe_adapter_inputs(pkg))  # LoRA weights as optional inputs (package/adapters.py)
    try:
        wanted = from_package(pkg.decoder.session_options)
    except ProviderError as e:  # a provider ortevals refuses to run (tensorrt): say so, describe the rest
        lines.append(f"providers package: {e}")
    else:
        lines.append(f"providers package: {wanted.name} {wanted.options or ''}".rstrip())
        if wanted.raw_options != wanted.options:  # og-only options (cuda graphs) kept from raw sessions
            lines.append(f"          raw sessions: {wanted.name} {wanted.raw_options or ''}".rstrip())
    lines.append(f"          installed: {', '.join(available_providers())}")
    lines.append(f"fingerprint {pkg.fingerprint()}")
    lines.extend(f"warning: {line}" for line in lint(pkg))  # config and graph disagree (package/lint.py)
    return "\n".join(lines)


def describe_path(path: str, ep: str | None = None) -> str:
    """``ortevals info``: the package at ``path`` (a model package: its variant for ``ep``) described."""
    return describe_package(ModelPackage.load(path, ep))
