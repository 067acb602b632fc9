"""What a run records about the model it scored: lm-eval's ``config.model_args`` and ``get_model_info``.

lm-eval writes ``results["config"]["model"]`` and ``["model_args"]`` from what it was given, which is
``"OrtLM"`` and ``None`` for a model object, then updates the config with the model's
``get_model_info()`` (the ``hf`` backend adds ``model_dtype``, ``model_sha``, …). ortevals answers
with the same keys filled: ``model_args`` as an lm-eval argument string that reproduces the run
(every model argument, the package as an absolute path, the execution provider resolved), and the
package's identity: folder, type, fingerprint, weight precision, provider and its options, threads.
So fp32, int8 and int4 runs of one model can be told apart afterwards (``ortevals compare`` prints it).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ortevals.errors import OrtEvalsError
from ortevals.package.adapters import adapter_specs
from ortevals.package.graph import graph_facts
from ortevals.package.tokenizer import package_tokenizer_root


def model_args_string(args, provider) -> str:
    """``pkg=/abs/path,ep=cpu,batch_size=auto,…``: lm-eval's ``--model_args`` syntax for this run."""
    values = dict(asdict(args))
    values["pkg"] = str(Path(values["pkg"]).resolve())
    values["ep"] = provider.name
    parts = []
    for key, value in values.items():
        if value is None and key == "batch_size":
            value = "auto"
        if value is None or value == ():
            continue
        if isinstance(value, tuple):
            value = ";".join(value)
        elif isinstance(value, bool):
            value = str(value).lower()
        elif isinstance(value, str) and not value.isprintable():  # step_separator "\n\n": escaped, as given
            value = value.encode("unicode_escape").decode("ascii")
        parts.append(f"{key}={value}")
    return ",".join(parts)


def model_info(package, provider, args) -> dict[str, Any]:
    """The entries OrtLM adds to lm-eval's ``results["config"]`` (keys as lm-eval's hf backend where it has one)."""
    return {
        "model": "ortevals",
        "model_args": model_args_string(args, provider),
        "model_path": str(package.root.resolve()),
        "model_type": package.model_type,
        "model_fingerprint": package.fingerprint(),
        "model_dtype": graph_facts(package.decoder.path).precision,
        "execution_provider": provider.ort_name,
        "provider_options": dict(provider.options),  # on CUDA use_tf32 (0 unless the user set it)
        "allow_cpu_fallback": provider.allow_cpu_fallback,  # a device provider's nodes may run on the CPU
        "threads": provider.intra_op_threads,
        **({"adapter": [{"name": s.name, "path": str(s.path.resolve())} for s in adapter_specs(args.adapter)]}
           if getattr(args, "adapter", ()) else {}),  # the LoRA adapter active on every path (runtime/adapters.py)
        **({"model_variant": {"name": package.variant.name, "execution_provider": package.variant.ep_name,
                              "device": package.variant.device, "package": str(package.manifest.root.resolve())}}
           if getattr(package, "variant", None) is not None else {}),
    }


def describe(config: dict[str, Any]) -> str:
    """One line naming a run's model from its results ``config`` (ortevals', or any lm-eval backend's)."""
    if config.get("model") == "ortevals" and config.get("model_path"):
        variant = config.get("model_variant") or {}
        where = f"variant {variant['name']} of {variant['package']}" if variant.get("name") else config["model_path"]
        return (f"ortevals {where} ({config.get('model_type', '?')}, {config.get('model_dtype', '?')}, "
                f"{config.get('execution_provider', '?')}, fingerprint {config.get('model_fingerprint', '?')})"
                + "".join(f", adapter {a['name']} ({a['path']})" for a in config.get("adapter") or ()))
    model, args = config.get("model"), config.get("model_args")
    if not model:
        return ""
    if isinstance(args, dict):
        args = ",".join(f"{k}={v}" for k, v in args.items())
    return f"{model} {args}" if args else str(model)


def tokenizer_file(config: dict[str, Any]) -> str:
    """The ``tokenizer.json`` of the model a run's results ``config`` names, where it is on disk: ortevals' package
    (``model_path``, its ``model.tokenizer_dir``), or a local folder in lm-eval's ``model_args`` (``tokenizer=``,
    else ``pretrained=``); "" where the run names none or it is gone."""
    if config.get("model") == "ortevals" and config.get("model_path"):
        try:
            folders = [package_tokenizer_root(Path(config["model_path"]))]
        except OrtEvalsError:  # the package moved or changed since the run
            return ""
    else:
        args = config.get("model_args")
        if isinstance(args, str):
            args = dict(kv.split("=", 1) for kv in args.split(",") if "=" in kv)
        args = args if isinstance(args, dict) else {}
        folders = [Path(str(args[k])).expanduser() for k in ("tokenizer", "pretrained") if args.get(k)][:1]
    found = [f / "tokenizer.json" for f in folders if (f / "tokenizer.json").is_file()]
    return str(found[0].resolve()) if found else ""
