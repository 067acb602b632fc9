"""One evaluation run: the object every front door drives (:class:`ortevals.run.run.Run`).

Owns, per run, the package and its tokenizer, the engines (opened lazily by
:class:`~ortevals.engine.backends.Backends`), the result store under its scope, the canary
verdicts kept there, the run's stats and its mode per request kind, and generation's path
and canary plans. lm-eval's ``OrtLM``, the lmms-eval models (through it), the Ray workers and
``--self-eval`` are adapters over it; the options table (:mod:`ortevals.options`) sits in this
layer too. Nothing here imports lm-eval.
"""
