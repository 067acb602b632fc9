"""The result store's scope, as the report layer sees it.

:class:`Scope` itself lives in :mod:`ortevals.package.scope` (the lowest layer), so the
runtime's derived-graph cache can key by it without importing the report layer; it is
re-exported here for :mod:`ortevals.report.store`.
"""

from __future__ import annotations

from ortevals.package.scope import Scope

__all__ = ["Scope"]
