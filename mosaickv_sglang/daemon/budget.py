"""How much scheduler-thread time one step boundary may spend on the daemon.

Adopting a page costs the scheduler thread separate operations (on the H200 host, ~0.2-1 ms
each): copying a new hot page into a slot (`pump`), installing the result into the arena
(`install`, in batches of pages, the unpickle of results read in place included) and, where
results are not read in place, reading one out of its slot (`load`). Done together in one
boundary they add ~2 ms to that step: at a 26 ms host-bound step the p99 step grew 1.07-1.14x
with the daemon saturated (H200, 2026-11-30, benchmarks/RESULTS_ARCHIVE.md). A boundary runs
operations only while they fit in `share` of the step period (the running mean of the time
between boundaries), predicting each operation's cost from its running mean plus twice its
running mean deviation (an operation that runs past the budget lands in the p99 step; the mean
alone let every other one through when two fitted just), so the work of a page is spread over
consecutive steps. The first operation of a boundary always runs: the daemon never starves, and
when the loop spins idle (tiny periods) it does one operation per iteration.

Each boundary's own time is also recorded by part (`spent` for budgeted operations, `note` for
the rest: health checks, the ranks' agreement, backpressure seals), and the `KEEP_SLOWEST`
slowest boundaries are kept with their parts: the rare long boundary a mean hides, named.

While the hot buffer runs low (`lift()`, called by adopt.py) the budget steps aside: a page not
adopted soon enough is sealed inline by backpressure, which costs a step 0.5-1 s, not 1 ms.

The budget only gates work local to this rank (loads and pumps). Installs change what every
tensor-parallel rank reads, so how many happen is decided without the clock (adopt.py:
`install_batch`, all ready ones while the hot buffer is low); their time is counted here so the
local work after them yields.
"""
from __future__ import annotations

import time

EMA = 0.2  # weight of the newest sample in the running means
KEEP_SLOWEST = 8  # boundaries kept with their parts (stats()["slowest"])


class BoundaryBudget:
    def __init__(self, share: float):
        self.share = share
        self.period: float | None = None  # running mean of the time between boundaries (s)
        self.cost: dict[str, float] = {}  # operation -> running mean of its time per page (s)
        self.dev: dict[str, float] = {}  # operation -> running mean |time - mean| per page (s)
        self.started: float | None = None
        self.ops = 0  # operations run in the current boundary
        self.deferred = 0  # operations left to a later boundary because the budget was spent
        self.unbounded = False  # this boundary runs whatever there is (hot buffer low)
        self.unbounded_boundaries = 0
        self.longest: dict[str, float] = {}  # operation -> its longest time per page (s)
        self.parts: dict[str, list] = {}  # this boundary: part -> [seconds, pages]
        self.slowest: list[dict] = []  # the slowest closed boundaries, slowest first

    def open(self) -> None:
        """A boundary starts: its clock, and one more sample of the step period."""
        now = time.perf_counter()
        if self.started is not None:
            self.period = _mean(self.period, now - self.started)
        self.started, self.ops = now, 0
        self.unbounded = False
        self.parts = {}

    def close(self) -> None:
        """The boundary (opened by `open`) is over: rank its time among the slowest, with its
        parts."""
        ms = (time.perf_counter() - self.started) * 1e3
        if len(self.slowest) < KEEP_SLOWEST or ms > self.slowest[-1]["ms"]:
            self.slowest.append({"ms": round(ms, 3), "unbounded": self.unbounded,
                                 "parts_ms": {k: round(v[0] * 1e3, 3) for k, v in self.parts.items()},
                                 "pages": {k: v[1] for k, v in self.parts.items() if v[1]}})
            self.slowest.sort(key=lambda r: -r["ms"])
            del self.slowest[KEEP_SLOWEST:]

    def note(self, part: str, seconds: float, pages: int = 0) -> None:
        """Time this boundary spent on something the budget does not gate (its record only)."""
        entry = self.parts.setdefault(part, [0.0, 0])
        entry[0] += seconds
        entry[1] += pages

    def allows(self, op: str, pages: int = 1) -> bool:
        """May `op` on `pages` pages run now? Always the boundary's first operation; later ones
        only when the time spent so far plus the predicted cost stays within the budget (a
        refusal is counted: the operation waits for a later boundary)."""
        if self.ops == 0 or self.started is None:
            return True
        if self.unbounded:
            return True
        elapsed = time.perf_counter() - self.started
        predicted = (self.cost.get(op, 0.0) + 2 * self.dev.get(op, 0.0)) * pages
        if self.period is not None and elapsed + predicted <= self.share * self.period:
            return True
        self.deferred += 1
        return False

    def lift(self) -> None:
        """This boundary runs whatever there is (the hot buffer is low; counted)."""
        self.unbounded = True
        self.unbounded_boundaries += 1

    def spent(self, op: str, seconds: float, pages: int = 1) -> None:
        sample = seconds / max(pages, 1)
        mean = self.cost.get(op)
        if mean is not None:
            self.dev[op] = _mean(self.dev.get(op, 0.0), abs(sample - mean))
        self.cost[op] = _mean(mean, sample)
        self.longest[op] = max(self.longest.get(op, 0.0), sample)
        self.ops += 1
        self.note(op, seconds, pages)

    def stats(self) -> dict:
        return {"boundary_share": self.share,
                "step_period_ms": None if self.period is None else self.period * 1e3,
                "page_cost_ms": {op: s * 1e3 for op, s in self.cost.items()},
                "page_cost_dev_ms": {op: s * 1e3 for op, s in self.dev.items()},
                "page_cost_max_ms": {op: s * 1e3 for op, s in self.longest.items()},
                "deferred_ops": self.deferred, "unbounded_boundaries": self.unbounded_boundaries,
                "slowest": self.slowest}


def _mean(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EMA) * old + EMA * sample
