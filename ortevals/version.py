"""ortevals' version, in one place: the root package re-exports it, every stored answer's scope records it."""

__version__ = "0.1.0"
