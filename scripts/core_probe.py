"""Which host cores slow the scheduler's core down when busy?

The daemon's workers run on the cores the scheduler thread does not use, yet on the H200 host an
install costs the scheduler ~2-3x its isolated time while 12 workers are busy (RESULTS, session
13), with no SMT siblings reported by the VM. This probe separates the likely causes: a fixed
scheduler-like workload (small numpy writes, dict and list churn: what a step boundary does) is
timed on the first allowed core while antagonist processes keep other cores busy:

* one core at a time spinning a pure-Python loop (no memory traffic): a core that slows the
  probe alone shares its physical core (an SMT sibling the hypervisor does not report);
* every other core spinning (frequency: all-core turbo is lower), streaming large array copies
  (memory bandwidth and last-level cache), or running batched SVDs on one thread each (what a
  worker does).

Prints the slowdown (probe time / time with the other cores idle, median of --reps) per case and
writes JSON.

    python scripts/core_probe.py --json probe.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np


def boundary_like(iters: int) -> None:
    """Scheduler-thread work shaped like a step boundary: a few 32-row numpy column writes, dict
    inserts and pops, list building (Python bytecode and small-array numpy, no large memory)."""
    rows = np.zeros((4, 32, 4), dtype=np.int64)
    base = np.arange(32, dtype=np.int64)
    blocks: dict = {}
    for i in range(iters):
        rows[0, :, 0] = base * 16 + i
        rows[0, :, 1] = np.cumsum(base) - base
        rows[1, :, 2] = base // 2
        for layer in range(32):
            blocks[(layer, i)] = (layer * 4096, 4096)
        for layer in range(32):
            blocks.pop((layer, i - 1), None)
        _ = [b for b in blocks.values() if b[0] > 0]


def _antagonist(kind: str, core: int, stop) -> None:
    os.sched_setaffinity(0, [core])
    if kind == "spin":
        x = 0
        while not stop.is_set():
            for _ in range(10000):
                x += 1
    elif kind == "stream":
        a = np.ones(16 << 20, dtype=np.float32)  # 64 MB: far beyond any cache
        b = np.empty_like(a)
        while not stop.is_set():
            np.copyto(b, a)
    elif kind == "svd":
        import torch

        torch.set_num_threads(1)
        m = torch.randn(8, 512, 128)
        while not stop.is_set():
            torch.linalg.svd(m, full_matrices=False)
    else:
        raise ValueError(kind)


def measure(probe_core: int, kind: str | None, cores: list[int], iters: int, reps: int) -> float:
    """Median seconds of `boundary_like(iters)` on `probe_core` while `kind` runs on `cores`."""
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    procs = [ctx.Process(target=_antagonist, args=(kind, c, stop), daemon=True)
             for c in (cores if kind else [])]
    for p in procs:
        p.start()
    try:
        time.sleep(0.5 if procs else 0)  # antagonists up and busy (svd: torch imported)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            boundary_like(iters)
            times.append(time.perf_counter() - t)
        if any(not p.is_alive() for p in procs):  # a dead antagonist would read as no slowdown
            raise RuntimeError(f"core_probe: a {kind} antagonist exited (exit codes "
                               f"{[p.exitcode for p in procs]})")
        return statistics.median(times)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200, help="boundary-like iterations per rep")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    probe_core, others = allowed[0], allowed[1:]
    if not others:
        raise SystemExit("core_probe: needs at least two allowed cores")
    os.sched_setaffinity(0, [probe_core])
    boundary_like(args.iters)  # warm
    idles = []

    def slowdown(kind: str, cores: list[int]) -> float:
        """Against an idle measurement taken just before (the host drifts between cases)."""
        idles.append(measure(probe_core, None, [], args.iters, args.reps))
        return measure(probe_core, kind, cores, args.iters, args.reps) / idles[-1]

    per_core = {c: slowdown("spin", [c]) for c in others}
    every = {kind: slowdown(kind, others) for kind in ("spin", "stream", "svd")}
    idle = statistics.median(idles)
    siblings = [c for c, r in per_core.items() if r > 1.25]
    print(f"probe on core {probe_core}: {idle * 1e3:.2f} ms idle ({args.iters} boundary-like "
          f"iterations, median of {args.reps})")
    print("| antagonist | cores | slowdown |\n|---|---|---|")
    for c, r in per_core.items():
        print(f"| spin | {c} | {r:.3f} |")
    for kind, r in every.items():
        print(f"| {kind} | all {len(others)} others | {r:.3f} |")
    print(f"cores that slow the probe alone (> 1.25x: a hidden SMT sibling): {siblings or 'none'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"probe_core": probe_core, "idle_s": idle, "iters": args.iters,
                       "reps": args.reps, "per_core_spin": per_core, "all_others": every,
                       "hidden_siblings": siblings, "cpus": os.cpu_count()}, fh, indent=1)


if __name__ == "__main__":
    main()
