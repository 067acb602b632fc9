"""Registration of ``ortevals`` in lm-eval's model registry (the lm-eval edge).

lm-eval 0.4.13's registry does not scan the ``lm_eval.models`` entry point
that ``pyproject.toml`` declares (an upstream PR adds that), so ortevals also
registers itself here. ``get_model()`` imports the built-in models only while
the registry is empty; registering first would hide ``hf`` and friends, so the
built-ins are imported before ``ortevals`` is added.

``python -m ortevals.integrations.lm_eval_plugin ARGS`` is the stock ``lm_eval`` CLI with
``--model ortevals`` available.
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


def main() -> None:
    """The stock lm_eval CLI, with ``--model ortevals`` registered."""
    register()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
