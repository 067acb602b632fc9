"""The scoring progress bar: questions done and the time left.

Owns what the bar shows while a run scores log-likelihood requests: the questions (lm-eval documents)
whose every request is done, out of all, as tqdm shows a count (its percentage and its bar are that
count's: ``12%|█| 6/50 questions``), and an ETA from the work left rather than from the questions
left. Each request carries a share of its model input's work: the input's tokens beyond the longest
prefix it shares with the input before it in sorted order (what the shared-prefix plan runs once,
engine/score/prefix.py) plus :data:`PASS_TOKENS` for the pass itself. The ETA is the average rate so far
(as tqdm's ``smoothing=0``, over work): the work left over the work done, times the time taken, so long
and short questions finishing in any order do not swing it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from tqdm import tqdm

from ortevals.tokens import common_prefix

PASS_TOKENS = 8  # a pass's fixed cost (the LM head at its scored rows, the session call) in tokens of work
BAR = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {noun} [{elapsed}<{eta}]"


class _Bar(tqdm):
    """tqdm over questions (its ``n`` and ``total``) whose ETA (``eta``, a field of its format) is the work left
    at the average rate of the work done so far (``work``, ``work_total``, set by :class:`Progress`)."""

    def __init__(self, *args, noun: str = "", work_total: float = 0.0, **kwargs) -> None:
        self.noun, self.work, self.work_total = noun, 0.0, work_total
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        d = super().format_dict
        if self.work <= 0:
            eta = "?"
        else:
            eta = self.format_interval(d["elapsed"] * max(self.work_total - self.work, 0.0) / self.work)
        return {**d, "noun": self.noun, "eta": eta}


def request_work(inputs: Sequence[Sequence[int]]) -> list[float]:
    """Each request's share of the work: its model input's new tokens (beyond the longest prefix shared with
    the input before it, inputs sorted; identical inputs run once) plus :data:`PASS_TOKENS`, split evenly
    among the requests with that input."""
    objects = {id(x): x for x in inputs}  # requests of one question usually hold one tuple: hashed once
    same = Counter(id(x) for x in inputs)
    members: Counter = Counter()
    for key, x in objects.items():
        members[tuple(x)] += same[key]
    work: dict[tuple[int, ...], float] = {}
    previous: tuple[int, ...] = ()
    for seq in sorted(members):
        work[seq] = (len(seq) - common_prefix(previous, seq) + PASS_TOKENS) / members[seq]
        previous = seq
    by_id = {key: work[tuple(x)] for key, x in objects.items()}
    return [by_id[id(x)] for x in inputs]


class Progress:
    """A tqdm bar that counts ``units`` (one per request: its question; None: each request is its own) as they
    finish, its ETA from the work of ``inputs`` (one per request)."""

    def __init__(self, inputs: Sequence[Sequence[int]], units: Sequence[Hashable] | None = None,
                 disable: bool = False, desc: str = "ortevals", later: int = 0) -> None:
        """``later``: requests after these whose inputs come later (:meth:`more`: the next part of a run that
        scores while it tokenizes the rest); ``units`` names theirs too. Until they come each counts the mean work
        of these."""
        self.work = request_work(inputs)
        self.later = later
        self.estimate = sum(self.work) / max(len(self.work), 1)  # an input still to come
        self.units = list(units) if units is not None else list(range(len(self.work)))
        self.left = Counter(self.units)  # requests not done, per unit
        self.done_units = 0
        self.noun = "questions" if units is not None else "requests"
        # miniters=0: a request done redraws the ETA (at most every mininterval) though no question finished
        self.bar = _Bar(total=len(self.left), desc=desc, disable=disable, dynamic_ncols=True, miniters=0,
                        bar_format=BAR, noun=self.noun, work_total=sum(self.work) + self.estimate * later)

    def more(self, inputs: Sequence[Sequence[int]]) -> int:
        """The inputs of the next ``len(inputs)`` later requests: their work replaces their estimate. Returns the
        index of the first of them."""
        first, work = len(self.work), request_work(inputs)
        self.work += work
        self.later -= len(inputs)
        self.bar.work_total += sum(work) - self.estimate * len(inputs)
        self.bar.refresh()
        return first

    def done(self, index: int) -> None:
        """Request ``index`` finished."""
        unit = self.units[index]
        self.left[unit] -= 1
        self.bar.work += self.work[index]
        finished = self.left[unit] == 0
        self.done_units += finished
        self.bar.update(int(finished))

    def close(self) -> None:
        self.bar.close()
