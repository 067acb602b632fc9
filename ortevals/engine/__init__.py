"""Requests to forward passes: grouping, prefixes, batching, scoring math, decoding, invariance checks."""
