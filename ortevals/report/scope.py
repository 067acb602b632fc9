"""The result store's scope: what a stored answer depends on.

:class:`Scope` and :class:`Reads` live in :mod:`ortevals.package.scope` (the lowest layer,
so the runtime's derived-graph cache keys by them without importing the report layer).
:func:`results_scope` builds the result store's scope of one run from the records of
every path the run can open and the run's settings; :class:`Scope` is re-exported here
for :mod:`ortevals.report.store`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ortevals.package.scope import Reads, Scope

__all__ = ["Scope", "results_scope"]


def results_scope(root: Path, reads: Sequence[Reads], settings: Mapping[str, Any]) -> Scope:
    """The scope of stored answers: ``reads`` (each path's files, settings and libraries) and ``settings``
    (every option that can change a number and what it resolved to); ``root``: the package folder."""
    return Scope.build("results", root, reads, settings)
