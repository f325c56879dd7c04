"""Optional per-phase wall time: of sealing (`PhaseTimer`, for benchmarks/seal_bench.py: sealing
functions take `timer=None` and wrap their phases in `timer(name)`; None costs nothing) and of
serving steps (`StepProfiler`: sampled decode and prefill steps, `decode_profile_every`)."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch


class PhaseTimer:
    """Seconds per phase. On CUDA it synchronizes around each phase, so the device work a phase
    launches is charged to it (each phase then costs a sync, which the untimed path does not)."""

    def __init__(self, device):
        self.sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        if self.sync:
            self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                self.sync()
            self.seconds[name] += time.perf_counter() - t0


def phase(timer, name: str):
    """`timer(name)`, or nothing without a timer."""
    return nullcontext() if timer is None else timer(name)


class StepProfiler:
    """Wall time per phase of sampled serving steps, the device synced at each phase boundary;
    off (every == 0), it costs one attribute check per phase. A step starts at `step()` and
    ends at the next `step()` (its tail charged to `tail`) or at `end()`. Besides the averages
    it keeps the `keep_slowest` slowest sampled steps with their phases: the rare stalls the
    averages hide (an ITL p99 far above p50).

    `step(forced=True)` times a step whatever its number (a decode step that does host work:
    the few steps a page boundary makes, which every-Nth sampling can miss when the requests'
    boundaries fall between samples). Forced steps are reported apart (`forced`: the same
    fields), so the averages stay those of every Nth step; a step both sampled and forced
    counts in both."""

    def __init__(self, every: int, device, tail: str = "between_steps", keep_slowest: int = 8):
        self.every, self.device, self.tail = every, torch.device(device), tail
        self.steps = 0
        self.sampled = _Tally(keep_slowest)  # every Nth step
        self.forced = _Tally(keep_slowest)  # steps timed because the caller asked
        self.on, self._t, self._cur = False, 0.0, {}
        self._kinds: tuple = ()

    def step(self, forced: bool = False) -> None:
        if self.on:  # the previous step was timed: its tail up to this step's start
            self.lap(self.tail)
            self.end()
        self.steps += 1
        if not self.every:
            return
        self._kinds = tuple(t for t, on in ((self.sampled, self.steps % self.every == 0),
                                            (self.forced, forced)) if on)
        self.on = bool(self._kinds)
        if self.on:
            for tally in self._kinds:
                tally.count += 1
            self._cur = {}
            self._t = self._now()

    def lap(self, phase: str) -> None:
        if self.on:
            now = self._now()
            ms = (now - self._t) * 1e3
            for tally in self._kinds:
                tally.ms[phase] += ms
            self._cur[phase] = self._cur.get(phase, 0.0) + ms
            self._t = now

    def end(self) -> None:
        """The timed step is over: rank it among the slowest of its tallies."""
        if not self.on:
            return
        self.on = False
        for tally in self._kinds:
            tally.rank(self.steps, self._cur)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def report(self) -> dict:
        out = {"every": self.every, "steps": self.steps, **self.sampled.report()}
        if self.forced.count:
            out["forced"] = {"steps": self.steps, **self.forced.report()}
        return out


class _Tally:
    """Phase sums over some timed steps (added as they are timed), and the slowest of them
    with their phases (ranked when each ends)."""

    def __init__(self, keep_slowest: int):
        self.keep_slowest, self.count = keep_slowest, 0
        self.ms: dict[str, float] = defaultdict(float)
        self.slowest: list[dict] = []  # {"step", "ms", "phases"}, slowest first

    def rank(self, step: int, phases: dict) -> None:
        total = sum(phases.values())
        if len(self.slowest) < self.keep_slowest or total > self.slowest[-1]["ms"]:
            self.slowest.append({"step": step, "ms": round(total, 3),
                                 "phases": {k: round(v, 3) for k, v in phases.items()}})
            self.slowest.sort(key=lambda s: -s["ms"])
            del self.slowest[self.keep_slowest:]

    def report(self) -> dict:
        per = {k: round(v / self.count, 4) for k, v in self.ms.items()} if self.count else {}
        return {"sampled_steps": self.count, "ms_per_step": per, "slowest": list(self.slowest)}
