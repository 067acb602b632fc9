"""The flags of a live decision (``--against RUN --decide MARGIN``, decision.py) for ``ortevals mmlu-pro``.

Glue only: :func:`decide_options` adds the flags, :func:`decide_spec` hands them to decision.py's
``check_decide`` (every bad one a line before any work).
"""

from __future__ import annotations

import functools
from pathlib import Path

import click


def decide_options(fn):
    """--against, --decide, --decide-part, --decide-cap, --decide-order, --alpha."""
    opts = [
        click.option("--against", type=click.Path(path_type=Path), default=None, metavar="RUN|PKG",
                     help="Decide this package against a finished run (ortevals --output or lm-eval --log_samples "
                          "folder): its questions scored in a random order (--seed), a part at a time, until "
                          "decided; or against a GenAI package scored alongside (docs/decide.md)."),
        click.option("--decide", type=float, default=None, metavar="MARGIN",
                     help="With --against: the margin in points; stop when the whole-set difference is known to "
                          "be within ±MARGIN (equivalent), below -MARGIN (worse) or above +MARGIN (better)."),
        click.option("--decide-part", type=int, default=None, metavar="N",
                     help="With --decide: questions scored between two looks (default 50)."),
        click.option("--decide-cap", type=int, default=None, metavar="N",
                     help="With --decide: stop after N questions if not decided (default: all the run's)."),
        click.option("--decide-order", default=None, metavar="ORDER",
                     help="With --decide: uniform (default) or guided: questions the reference answered by a small "
                          "choice margin drawn first, the difference estimated without bias (docs/decide.md)."),
        click.option("--alpha", type=float, default=None,
                     help="With --decide: the confidence sequence's error level (default 0.05)."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(opts), fn)


def decide_spec(kw: dict):
    """The command's decision flags checked: decision.py's ``DecideSpec``, None where no decision is asked."""
    from ortevals.decision import check_decide  # evaluate.py and scipy: not at the command line's start

    return check_decide(kw.get("against"), kw.get("decide"), kw.get("decide_part"), kw.get("decide_cap"),
                        kw.get("alpha"), kw.get("seed"), kw.get("sample"), kw.get("limit"), kw.get("decide_order"))
