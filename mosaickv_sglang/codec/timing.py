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
    averages hide (an ITL p99 far above p50)."""

    def __init__(self, every: int, device, tail: str = "between_steps", keep_slowest: int = 8):
        self.every, self.device, self.tail = every, torch.device(device), tail
        self.keep_slowest = keep_slowest
        self.steps, self.sampled = 0, 0
        self.ms: dict[str, float] = defaultdict(float)
        self.slowest: list[dict] = []  # {"step", "ms", "phases"}, slowest first
        self.on, self._t, self._cur = False, 0.0, {}

    def step(self) -> None:
        if self.on:  # the previous step was sampled: its tail up to this step's start
            self.lap(self.tail)
            self.end()
        self.steps += 1
        self.on = bool(self.every) and self.steps % self.every == 0
        self.sampled += self.on
        if self.on:
            self._cur = {}
            self._t = self._now()

    def lap(self, phase: str) -> None:
        if self.on:
            now = self._now()
            ms = (now - self._t) * 1e3
            self.ms[phase] += ms
            self._cur[phase] = self._cur.get(phase, 0.0) + ms
            self._t = now

    def end(self) -> None:
        """The sampled step is over: rank it among the slowest."""
        if not self.on:
            return
        self.on = False
        total = sum(self._cur.values())
        if len(self.slowest) < self.keep_slowest or total > self.slowest[-1]["ms"]:
            self.slowest.append({"step": self.steps, "ms": round(total, 3),
                                 "phases": {k: round(v, 3) for k, v in self._cur.items()}})
            self.slowest.sort(key=lambda s: -s["ms"])
            del self.slowest[self.keep_slowest:]

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def report(self) -> dict:
        per = {k: round(v / self.sampled, 4) for k, v in self.ms.items()} if self.sampled else {}
        return {"sampled_steps": self.sampled, "every": self.every, "steps": self.steps,
                "ms_per_step": per, "slowest": list(self.slowest)}
