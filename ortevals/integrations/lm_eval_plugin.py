"""Registration of ``ortevals`` in lm-eval's model registry (the lm-eval edge).

lm-eval 0.4.13's registry does not scan the ``lm_eval.models`` entry point
that ``pyproject.toml`` declares (an upstream PR adds that), so ortevals also
registers itself here. ``get_model()`` imports the built-in models only while
the registry is empty; registering first would hide ``hf`` and friends, so the
built-ins are imported before ``ortevals`` is added.

``python -m ortevals.integrations.lm_eval_plugin ARGS`` is the stock ``lm_eval`` CLI with
``--model ortevals`` available. lm-eval builds the model inside ``simple_evaluate``, after it has indexed and
loaded the tasks, and lets the model's error through as a traceback; the wrapper parses the command line with
lm-eval's own parser, checks ``--model_args``, the package and its execution provider before lm-eval starts
(:func:`preflight`), and prints any ortevals error, then or later, as one line (``Error: …``, exit 2), as the
``ortevals`` command does.
"""

from __future__ import annotations

NAMES = ("ortevals",)


def register() -> None:
    """Add ``ortevals`` to lm-eval's registry once, keeping the built-in models."""
    import lm_eval.models  # noqa: F401  (fills the registry with the built-ins first)
    from lm_eval.api.registry import get_model, model_registry, register_model

    get_model("hf")  # forces the lazy built-in registry to populate
    missing = [n for n in NAMES if n not in set(model_registry.keys())]
    if missing:
        from ortevals.integrations.lm import OrtLM

        register_model(*missing)(OrtLM)


def preflight(model_args: dict | None, batch_size) -> None:
    """What lm-eval would hand ``OrtLM.create_from_arg_obj``, checked now: the model arguments, the package
    folder (its config and graphs' declarations, no session) and the execution provider the run would open it on
    (``ep=cuda`` on an install without CUDA: one line here, not after lm-eval has loaded the tasks)."""
    from ortevals.integrations.lm import lm_eval_model_args
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.opening import check_available
    from ortevals.runtime.providers import from_package, parse_options

    args = lm_eval_model_args(dict(model_args or {}), {"batch_size": batch_size})
    package = ModelPackage.load(args.pkg, args.ep)
    check_available(from_package(package.decoder.session_options, args.ep, parse_options(args.provider_options),
                                 args.threads, allow_cpu_fallback=args.allow_cpu_fallback))


def main() -> None:
    """The stock lm_eval CLI (lm-eval's own parser and ``execute``, as its ``cli_evaluate``), with ``--model
    ortevals`` registered; ortevals' errors as one line, exit 2."""
    from ortevals.errors import exit_in_one_line

    register()
    from lm_eval._cli import HarnessCLI  # what lm_eval.__main__.cli_evaluate runs (0.4.13)
    from lm_eval.utils import setup_logging

    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    with exit_in_one_line():
        if getattr(args, "model", None) in NAMES:
            preflight(getattr(args, "model_args", None), getattr(args, "batch_size", None))
        parser.execute(args)


if __name__ == "__main__":
    main()
