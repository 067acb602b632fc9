"""User-facing error types.

Every problem caused by the user's input (a package, a data file, an option)
is raised as an :class:`OrtEvalsError` whose message is one line naming the
file or field at fault and what was expected. The CLI prints that line and
exits with code 2; library callers can catch the class.

They subclass ``ValueError`` on purpose: Olive re-raises ValueError instead of
logging it as "Failed to run Olive" and carrying on.
"""

from __future__ import annotations

import contextlib
import sys


class OrtEvalsError(ValueError):
    """A user error: bad package, bad data, bad option, missing runtime."""


class PackageError(OrtEvalsError):
    """The model package (genai_config.json or its model files) is invalid."""


class RuntimeMissingError(OrtEvalsError):
    """onnxruntime / onnxruntime-genai is missing or installed inconsistently."""


class ProviderError(OrtEvalsError):
    """An execution provider is unknown or not available in this install."""


class StoreError(OrtEvalsError):
    """The result store file cannot be opened, read or written (corrupt, a folder, not SQLite)."""


class OutputError(OrtEvalsError):
    """A file ortevals writes could not be written (a full disk, a folder gone read-only): ``path`` and the
    system's ``reason``."""

    def __init__(self, message: str, path=None, reason: str = "") -> None:
        super().__init__(message)
        self.path, self.reason = path, reason


class DataError(OrtEvalsError):
    """A benchmark data set is missing, unreachable or malformed."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type name: third-party errors span many lines."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


CLOSE = 0.8  # difflib's ratio of a typo to the name meant: one letter off a short name ('hff'/'hf') is 0.8


def did_you_mean(name: str, known) -> str:
    """`` (did you mean 'x'?)`` for the nearest of ``known`` (difflib) where it is close (:data:`CLOSE`), else an
    empty string: difflib's default cutoff, 0.6, offered 'injongointent_tasks' for 'nonexistent_task' (0.74)."""
    import difflib

    match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=CLOSE)
    return f" (did you mean {match[0]!r}?)" if match else ""


@contextlib.contextmanager
def exit_in_one_line():
    """For a wrapper that owns its process (lm-eval's and Olive's command lines run by ortevals): an ortevals error
    raised inside is one line on stderr (``Error: …``) and exit code 2, Ctrl-C ``Interrupted.`` and 130, as the
    ``ortevals`` command does."""
    try:
        yield
    except OrtEvalsError as e:
        sys.stderr.write(f"Error: {e}\n")
        sys.exit(2)
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted.\n")
        sys.exit(130)
