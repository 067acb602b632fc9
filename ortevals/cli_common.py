"""What the command modules share: the logging set-up of ``-v`` and the gates' verdicts printed.

cli.py (the ``ortevals`` group and most commands) and cli_compare.py (``compare`` and ``fidelity``) both
call :func:`setup_logging`; :func:`fail_gates` prints a comparison's gate verdicts and exits 1 on a failed one.
"""

from __future__ import annotations

import logging
import sys

import click

# notices a user should see at the default verbosity, printed as plain lines (not "WARNING …")
NOTICES = ("ortevals.report.resume", "ortevals.package.manifest")


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if record.levelno in (logging.INFO, logging.WARNING) and record.name in NOTICES:
            return record.getMessage()
        return super().format(record)


def setup_logging(verbose: int) -> None:
    import os

    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(_Format("%(levelname)s %(name)s: %(message)s"))
    for name in NOTICES:
        logging.getLogger(name).setLevel(min(level, logging.INFO))
    for name in ("lm_eval", "lm-eval", "datasets", "httpx", "urllib3"):
        logging.getLogger(name).setLevel(max(level, logging.WARNING if verbose < 2 else logging.DEBUG))
    if verbose == 0:  # datasets draws a bar per filter pass (28 "Filter:" bars for --cot): -v shows them
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        if "datasets" in sys.modules:
            sys.modules["datasets"].disable_progress_bars()
    # huggingface_hub is left alone: it resets its own level when lm-eval imports it, after this call. The
    # bundled data's "Repo card metadata block" warning is fixed at its source (its README has a card block).


def fail_gates(verdicts) -> None:
    """Each gate's verdict (a failed one on stderr); exit 1 when one failed."""
    for v in verdicts:
        click.echo(v.line, err=not v.passed)
    if any(not v.passed for v in verdicts):
        sys.exit(1)
