"""Seeds: one numpy generator per sample, a function of (seed, request key, sample index) only.

So a sample's text never depends on the batch it ran in, the worker that ran it, or a resume
(docs/decoding.md, Seeding). Below every other module of engine/generate/.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np


def stable_ints(key: list) -> list[int]:
    """Seed material from a key, the same in every process (unlike hash())."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]


def row_rng(seed: int, request_key: str, sample_index: int) -> np.random.Generator:
    """The generator of one sample: a function of (seed, request key, sample index) only."""
    return np.random.default_rng([int(seed), *stable_ints([str(request_key), int(sample_index)])])


def sample_rng(seed: int, key: list, candidate: int | None = None) -> np.random.Generator:
    """The generator of one sample (docs/decoding.md, Seeding): ``key`` is the store key, the request's
    args + its sample index (report/resume.request_keys); ``candidate``: an MBR candidate of it."""
    request = json.dumps(key[:-1], sort_keys=True, default=str)
    return row_rng(seed, request if candidate is None else f"{request}/mbr/{candidate}", int(key[-1]))
