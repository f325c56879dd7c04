"""Optional per-phase wall time of sealing, for benchmarks/seal_bench.py: sealing functions take
`timer=None` and wrap their phases in `timer(name)`; None costs nothing."""
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
