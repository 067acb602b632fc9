"""Token-id sequences, for every layer: the runtime's rewinding cursor and the engine's prefix plans."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    if type(a) is not type(b) or not isinstance(a, (list, tuple)):  # slices compared as one type (a list never
        a, b = tuple(a), tuple(b)  # equals a tuple; numpy compares elementwise)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    # from here a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 16:  # halved by slice comparisons (C loops), the last few one by one
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo
