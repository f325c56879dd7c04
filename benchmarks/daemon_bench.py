"""Recompression daemon: does a decode step slow down or wait when the daemon is saturated, and
how many pages per second does the daemon seal, against what batch-128 decode produces?

Pool-level, without SGLang (runs where only torch is installed): a hot buffer of random K/V pages
on --device, the real `DaemonClient` (worker processes, shared-memory slots, the same codec) and
a simulated scheduler loop. One step = fixed device work calibrated to --step-ms (a GEMM loop on
the scheduler's thread) + the step boundary the server runs: the pool's own `step_boundary()` (one
install, then reads and copies within `daemon_boundary_share` of the step, --share) on a
stand-in pool whose installs go into a real SegmentStore, then the step's new pages submitted.
By default the boundary runs after the device work is done (a host-bound step: every host
millisecond adds to the step, the strict case); with --overlap it runs while
the device work is in flight, as in SGLang's default overlap loop, whose adoption hook (before
`get_next_batch_to_run`) runs before the previous forward is synchronized. Phases:

* idle: the workers exist but get nothing;
* saturated: --pages-per-step new full pages every step (one page per step is batch 128 at
  128-token segments), more than the workers can seal; pages beyond --max-pending are dropped
  from the queue and counted (in the server that is the backpressure seal, whose cost per page
  is measured separately as `inline_seal_ms`).

Pages go into slots by the pool's `SlotCopy` (--copies: the `page_gather` kernel or torch's
stack; --copy-stream: on CUDA off the current stream, as the pool does, or on it, the A/B).
An adopted page is installed as the pool does it (`SegmentStore.adopt` for an arena-ready result
-- one `row_copy` launch with --copies auto on CUDA, else torch slices --, else
`install_pages`: arena writes, headers, page metadata) into a store of --store-pages pages,
the oldest released when it is full; `install_ms` times that part of the boundary. Not
modelled: the pool's own bookkeeping around it (accounting, swap log: dict updates) and its
backpressure (the bench drops pages over --max-pending instead).

Before measuring, --warm-pages pages go through the daemon into the store and the daemon is
drained: a layout the store sees for the first time costs a one-off registration (the first H200
runs, without the warm-up, measured those inside the saturated phase); the layouts first seen
while measuring are reported.

Reported: step time p50/p99/max idle vs saturated, the step-boundary time (where a wait on the
daemon would show; there is no blocking call there by construction), daemon throughput
(pages/s, per worker core), worker page latency, and the production rate of batch-128 decode at
the Llama-3.1-8B shape for a *stated* step time (--production-step-ms, not measured here).

    python benchmarks/daemon_bench.py --shape small --json out.json
    python benchmarks/daemon_bench.py --shape llama8b --workers 8 --device cuda --json out.json
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import statistics
import time
from types import SimpleNamespace

import torch

from mosaickv_sglang.codec.layer import Candidates
from mosaickv_sglang.codec.seal import gather_pages, seal_group, worst_page_bytes
from mosaickv_sglang.codec.strategies import parse_strategy
from mosaickv_sglang.config import MosaicConfig
import mosaickv_sglang.daemon.channel as channel_mod
import mosaickv_sglang.serving.segment_store as store_mod
from mosaickv_sglang.daemon.boundary import step_boundary
from mosaickv_sglang.daemon.client import DaemonClient, SlotCopy
from mosaickv_sglang.serving.segment_store import SegmentStore, use_pack_kernel

# saturated with the workers this busy (or more), they bound the throughput; below it pages wait
# in the step boundary (to be loaded, installed or copied into a slot within its budget)
WORKERS_BOUND_BUSY = 0.9
SHAPES = {"small": (4, 2, 64), "llama8b": (32, 8, 128)}  # layers, KV heads, head_dim


def smt_siblings(core: int) -> set[int]:
    """The logical CPUs sharing `core`'s physical core (itself included; {core} where the
    kernel does not say)."""
    path = f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list"
    try:
        text = open(path).read().strip()
    except OSError:
        return {core}
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    pick = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "max": xs[-1], "mean": statistics.fmean(xs)}


class BoundaryBreakdown:
    """Where a step boundary's time goes: the client's and the stand-in pool's steps timed by
    wrapping them (bench-only instrumentation; the client is unchanged) plus Python GC pauses.
    `take()` returns and resets the current boundary's totals in ms. Inside install: the store's
    adoption (`store`: SegmentStore.adopt_pages, of which `launch` is the copy_rows launch)
    and the release of the page it replaces (`release`)."""
    PARTS = ("alive", "install", "handle", "load", "unpickle", "pump", "gc")
    INSTALL_PARTS = ("store", "launch", "release")

    def __init__(self, client, pool):
        self.now = dict.fromkeys(self.PARTS + self.INSTALL_PARTS, 0.0)
        self.calls = dict.fromkeys(self.now, 0)  # per part: calls in the current boundary
        for part, owner, name in (("alive", client, "_alive"), ("handle", client, "_handle"),
                                  ("pump", client, "pump"), ("install", pool, "_finish"),
                                  ("load", client, "_load"),
                                  ("unpickle", channel_mod._Loader, "load"),
                                  ("store", SegmentStore, "adopt_pages"),
                                  ("launch", store_mod, "copy_rows"),
                                  ("release", SegmentStore, "release")):
            setattr(owner, name, self._timed(part, getattr(owner, name)))
        self._gc_t0 = None
        gc.callbacks.append(self._gc)

    def _timed(self, part, fn):
        def wrapper(*a, **kw):
            self.calls[part] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.now[part] += time.perf_counter() - t
        return wrapper

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.now["gc"] += time.perf_counter() - self._gc_t0

    def take(self) -> dict:
        """The current boundary's ms per part, and its page loads (`loads`)."""
        out = {k: v * 1e3 for k, v in self.now.items()}
        out["loads"] = self.calls["load"]
        self.now = dict.fromkeys(self.now, 0.0)
        self.calls = dict.fromkeys(self.calls, 0)
        return out


def slowest_breakdown(bounds: list[float], parts: list[dict], frac: float = 0.01) -> dict:
    """Mean of each part (ms) over the slowest `frac` of boundaries; `other` is the boundary
    minus alive, install, handle and pump (pipe reads, agreement, loop overhead; load is part of
    handle, unpickle part of load, gc wherever a collection fired)."""
    n = max(1, int(len(bounds) * frac))
    idx = sorted(range(len(bounds)), key=lambda i: -bounds[i])[:n]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = {k: mean([parts[i][k] for i in idx]) for k in BoundaryBreakdown.PARTS}
    out["boundary"] = mean([bounds[i] * 1e3 for i in idx])
    out["other"] = out["boundary"] - sum(out[k] for k in ("alive", "install", "handle", "pump"))
    out["steps"] = n
    return out


class Work:
    """Fixed device work standing in for a forward: `reps` GEMMs, calibrated to step_ms."""

    def __init__(self, device: torch.device, step_ms: float):
        self.device = device
        n = 2048 if device.type == "cuda" else 256
        self.a = torch.randn(n, n, device=device)
        self.reps = 1
        self.time(20)  # warm: library handles, kernel choice, clocks up (the first run of a
        # device call calibrated to a ~17 ms step instead of ~25 without this)
        t = min(self.time(8) / 8 for _ in range(3))
        self.reps = max(1, round(step_ms / 1e3 / t))

    def launch(self):
        for _ in range(self.reps):
            self.a = (self.a @ self.a).clamp_(-1, 1)

    def wait(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self):
        self.launch()
        self.wait()

    def time(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.run()
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=30.0)
    ap.add_argument("--pages-per-step", type=float, default=1.0)
    ap.add_argument("--max-pending", type=int, default=128, help="hot-buffer bound (pages)")
    ap.add_argument("--hot-pages", type=int, default=1024,
                    help="the stand-in pool's hot buffer (pages); free = this - pending pages")
    ap.add_argument("--store-pages", type=int, default=64,
                    help="arena pages adopted pages are installed into (oldest released)")
    ap.add_argument("--fit-every", type=int, default=32, help="one basis fit per this many pages")
    ap.add_argument("--production-step-ms", type=float, nargs="+", default=[20.0, 30.0, 60.0],
                    help="stated batch-128 Llama-8B decode step times for the production rate")
    ap.add_argument("--isolate", action="store_true",
                    help="pin this (scheduler) process to core 0 and the workers to the others")
    ap.add_argument("--spare-smt", action="store_true",
                    help="with --isolate: keep core 0's SMT siblings free of workers too (the "
                         "scheduler thread then has a physical core to itself)")
    ap.add_argument("--spare-cores", default="", metavar="LIST",
                    help="with --isolate: keep these cores (comma-separated) free of workers too, "
                         "e.g. the scheduler core's unreported SMT sibling that "
                         "scripts/core_probe.py finds")
    ap.add_argument("--profile-boundaries", default=None, metavar="PATH",
                    help="cProfile the saturated phase's step boundaries (the functions with the "
                         "most own time, to PATH; slows them: not for the ratios)")
    ap.add_argument("--nice", type=int, default=MosaicConfig.daemon_nice,
                    help="the workers' daemon_nice (A/B its effect on throughput)")
    ap.add_argument("--warm-pages", type=int, default=32,
                    help="pages installed (then the daemon drained) before measuring, so the "
                         "store has seen the codec's layouts; 0: measure from a cold store")
    ap.add_argument("--overlap", action="store_true",
                    help="run the boundary while the step's device work runs (SGLang's default "
                         "overlap loop: the adoption hook runs before the previous forward is "
                         "synchronized); default: after it (a host-bound step, the strict case)")
    ap.add_argument("--share", type=float, default=MosaicConfig.daemon_boundary_share,
                    help="daemon_boundary_share: the share of a step the boundary's reads and "
                         "copies may take (0: one operation per boundary)")
    ap.add_argument("--install-batch", type=int, default=MosaicConfig.daemon_install_batch,
                    help="daemon_install_batch: pages installed together at one boundary (1: one "
                         "job a boundary)")
    ap.add_argument("--copies", choices=["auto", "torch"], default="auto",
                    help="pack_kernel: who moves a page's bytes on the scheduler thread (auto: "
                         "the page_gather / row_copy kernels on CUDA, torch on a CPU)")
    ap.add_argument("--copy-stream", choices=["side", "current"], default="side",
                    help="CUDA: fill slots on side streams (the pool's way) or on the current "
                         "stream, as before the side streams (an A/B of what that costs a step)")
    ap.add_argument("--read-results", choices=["in-place", "device"], default="in-place",
                    help="install results from their slots in place (the pool's way where the "
                         "store can: a CPU, or CUDA with the slots pinned and mapped) or copy each "
                         "when read (the A/B; on a CPU too)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.set_num_threads(1)  # the scheduler thread; workers take the other cores
    device = torch.device(args.device)
    layers, heads, head_dim = SHAPES[args.shape]
    cfg = MosaicConfig(daemon="process", daemon_workers=args.workers,
                       daemon_threads=args.threads, daemon_queue_segments=args.slots,
                       daemon_nice=args.nice, daemon_boundary_share=args.share,
                       daemon_install_batch=args.install_batch)
    tokens = cfg.segment_tokens
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    # a pool-like hot buffer of a few distinct pages (one [rows, H, D] tensor per layer and kind,
    # as MosaicKVPool's), channel energies spread like real K (a few strong channels); pages go
    # into slots by the pool's own copy
    hot_pages = 4
    scale = torch.logspace(0.5, -1, head_dim)
    k_buffer, v_buffer = ([(torch.randn(hot_pages * tokens, heads, head_dim, generator=g) * scale)
                           .to(dtype).to(device) for _ in range(layers)] for _ in range(2))

    slot_copy = SlotCopy(k_buffer, v_buffer, tokens, use_pack_kernel(args.copies, device),
                         lambda page: page % hot_pages, args.copy_stream == "side")
    dense = parse_strategy("dense")

    result_bytes = layers * (worst_page_bytes(cfg, heads, head_dim, dense) + 16384) + \
        layers * 2 * heads * head_dim * head_dim * 2 + 65536
    store = SegmentStore(layers, args.store_pages, heads, head_dim, tokens, cfg.page_tokens,
                         device, cfg.select.meta_channels if cfg.select.enabled else None,
                         args.store_pages * (worst_page_bytes(cfg, heads, head_dim, dense)
                                             + heads * 4096),  # + block alignment
                         pack_kernel=args.copies)
    t0 = time.perf_counter()
    client = DaemonClient(cfg, layers, heads, head_dim, dtype, device, dense.spec, result_bytes,
                          slot_copy, store.reads_host if args.read_results == "in-place" else None)
    while any(float(client.channel.heartbeats[w.index]) <= w.spawned_at for w in client.workers):
        time.sleep(0.05)
    startup_s = time.perf_counter() - t0
    worker_cores = None
    if args.isolate:
        cores = sorted(os.sched_getaffinity(0))
        spare = smt_siblings(cores[0]) if args.spare_smt else {cores[0]}
        spare |= {int(c) for c in args.spare_cores.split(",") if c}
        worker_cores = [c for c in cores if c not in spare] or cores
        os.sched_setaffinity(0, cores[:1])
        for w in client.workers:
            os.sched_setaffinity(w.proc.pid, worker_cores)
        print(f"scheduler on core {cores[0]} (SMT siblings {sorted(smt_siblings(cores[0]))}), "
              f"workers on {len(worker_cores)} cores: {worker_cores}")

    # backpressure cost: one page sealed on this thread (what a backpressure seal costs a step)
    read = lambda idx: gather_pages(k_buffer, v_buffer, torch.tensor([0]), tokens)  # noqa: E731
    cands = Candidates.from_config(cfg)
    t0 = time.perf_counter()
    seal_group(read, [tokens * 5], None, cfg, cands, dense)
    inline_fit_ms = (time.perf_counter() - t0) * 1e3

    def install(jobs, results) -> int:
        """What the pool does with ready jobs' pages (`results`, as step_boundary() took them): into
        the arena in one batch, store pages taken in a ring (the oldest released when it comes
        round again). Returns pages installed."""
        nonlocal bases
        pages, sealed = [], []
        for job, got in zip(jobs, results):
            client.retire(job)
            for sp in got:
                if sp is False:
                    continue
                page = 1 + state["installed"] % args.store_pages
                if state["installed"] >= args.store_pages:
                    store.release(page)
                pages.append(page)
                sealed.append(sp)
                state["installed"] += 1
            state["done"] += len(job.pages)
            if not job.bases_given:
                bases = job.bases  # later pages of the block reuse them
        if pages:
            store.store_pages(pages, sealed)  # as pool._install
        return sum(len(job.pages) for job in jobs)

    class BenchPool:
        """What step_boundary() uses of MosaicKVPool: installs into the store above, every job
        installable (one page each, no request order), no backpressure (pages over
        --max-pending are dropped before submitting), no swap log, and a hot buffer of
        --hot-pages of which the pending pages are taken (large by default: the boundary
        budget stays on; within twice the watermark step_boundary() lifts it, as in the server)."""
        daemon, num_hot_pages = client, args.hot_pages
        swaps = SimpleNamespace(flush=lambda rank: None)
        installable = staticmethod(lambda job, with_pages=(): True)
        _relieve = staticmethod(lambda want_free: 0)

        def __init__(self):
            self.cfg = cfg
            self.position_rule = cfg.read_rule == "position"  # step_boundary()'s relief depends on it

        @property
        def free_hot_pages(self):
            return range(max(0, args.hot_pages - len(client.open)))  # one page a job

        def _finish(self, jobs, results=None):
            if results is None:  # a worker failed on them: the bench seals nothing here
                for job in jobs:
                    client.retire(job)
                return 0
            return install(jobs, results)

    pool = BenchPool()
    work = Work(device, args.step_ms)
    bases = None
    state = {"page": 0, "credit": 0.0, "dropped": 0, "done": 0, "installed": 0}

    def boundary(produce: bool) -> tuple[float, float]:
        """The scheduler's step boundary (the pool's step_boundary()), then the step's new pages
        submitted (in the server, by the forward that filled them). Returns (adopt, submit)
        seconds."""
        t = time.perf_counter()
        step_boundary(pool)
        t_submit = time.perf_counter()
        if produce:
            state["credit"] += args.pages_per_step
            while state["credit"] >= 1:
                state["credit"] -= 1
                page = state["page"]
                state["page"] += 1
                pending = len(client.open)  # pages: the bench's jobs are one page each
                if pending >= args.max_pending:
                    state["dropped"] += 1  # the server would seal the oldest inline here
                    continue
                fit = bases is None or page % args.fit_every == 0
                client.submit([page], [0], [tokens * (1 + page % 30)], page,
                              None if fit else bases)
        return t_submit - t, time.perf_counter() - t_submit

    def phase(produce: bool) -> dict:
        steps, bounds, submits, parts, ops = [], [], [], [], []
        page_loads, page_installs = [], []  # ms per adopted page: read + unpickle, install
        done_pages = 0
        install_parts = {k: [] for k in BoundaryBreakdown.INSTALL_PARTS}  # per page installed
        done0, busy0 = state["done"], client.counters.worker_seconds
        deferred0, unbounded0 = client.budget.deferred, client.budget.unbounded_boundaries
        t_start = time.perf_counter()
        for _ in range(args.steps):
            t = time.perf_counter()
            work.launch()
            if not args.overlap:
                work.wait()
            breakdown.take()
            installed0 = state["installed"]
            if produce and profiler is not None:
                profiler.enable()
            bound, sub = boundary(produce)
            if produce and profiler is not None:
                profiler.disable()
            if args.overlap:
                work.wait()
            part = breakdown.take()
            parts.append(part)
            ops.append(client.budget.ops)
            if part["loads"]:  # at a read, or inside the install (read in place)
                page_loads.append(part["load"] / part["loads"])
            if n_installed := state["installed"] - installed0:  # per page of the batch
                done_pages += n_installed
                page_installs.append(part["install"] / n_installed)
                for k, xs in install_parts.items():
                    xs.append(part[k] / n_installed)
            steps.append(time.perf_counter() - t)
            bounds.append(bound)
            submits.append(sub)
        wall = time.perf_counter() - t_start
        ms = lambda xs: {k: v * 1e3 for k, v in quantiles(xs).items()}  # noqa: E731
        return {"step_ms": ms(steps), "boundary_ms": ms(bounds), "submit_ms": ms(submits),
                "install_ms": quantiles([p["install"] for p in parts]),
                "slowest_1pct_boundary_ms": slowest_breakdown(bounds, parts),
                "ops_per_boundary": {str(n): ops.count(n) for n in sorted(set(ops))},
                "deferred_ops": client.budget.deferred - deferred0,
                "unbounded_boundaries": client.budget.unbounded_boundaries - unbounded0,
                # the scheduler thread's cost of adopting one page: its read out of the slot
                # (copy + unpickle) and its install into the store (arena, headers, metadata)
                "adopt_page_ms": {"load": quantiles(page_loads) if page_loads else None,
                                  "install": quantiles(page_installs) if page_installs else None,
                                  "pages": done_pages, "install_boundaries": len(page_installs),
                                  # inside one install: SegmentStore.adopt (its kernel launch
                                  # apart) and the release of the page it replaces
                                  "install_parts": {k: quantiles(xs) if xs else None
                                                    for k, xs in install_parts.items()}},
                "wall_s": wall, "pages_done": state["done"] - done0,
                "worker_busy_fraction": (client.counters.worker_seconds - busy0)
                / (wall * args.workers)}

    def warm_up() -> dict:
        """Steps until --warm-pages pages were installed (the store then knows the layouts the
        codec picks: registering a layout is a one-time cost per server), then idle steps until
        the daemon has nothing open, so both measured phases start from a drained daemon."""
        t0, installed0, layouts0 = time.perf_counter(), state["installed"], len(store.layouts)
        steps = 0
        while state["installed"] - installed0 < args.warm_pages and steps < 50 * args.warm_pages:
            work.run()
            boundary(True)
            steps += 1
        while client.open_jobs() and steps < 60 * args.warm_pages + 1000:
            work.run()
            boundary(False)
            steps += 1
        breakdown.take()
        return {"steps": steps, "s": time.perf_counter() - t0,
                "pages_installed": state["installed"] - installed0,
                "layouts_registered": len(store.layouts) - layouts0,
                "open_jobs_left": len(client.open_jobs())}

    breakdown = BoundaryBreakdown(client, pool)
    profiler = cProfile.Profile() if args.profile_boundaries else None
    warm = warm_up()
    phase(False)  # warm-up of the step itself
    idle = phase(False)
    layouts0, dropped0 = len(store.layouts), state["dropped"]
    saturated = phase(True)
    saturated["layouts_registered"] = len(store.layouts) - layouts0
    client.close()
    if profiler is not None:
        with open(args.profile_boundaries, "w") as fh:
            pstats.Stats(profiler, stream=fh).sort_stats("tottime").print_stats(40)

    cores = args.workers * args.threads
    thr = saturated["pages_done"] / saturated["wall_s"]
    busy = saturated["worker_busy_fraction"]
    lat = sorted(client.latencies)
    page_bytes = layers * 2 * heads * tokens * head_dim * 2
    out = {
        "machine": platform.node(), "cpu_count": os.cpu_count(), "device": str(device),
        "torch": torch.__version__, "args": vars(args), "worker_cores": worker_cores,
        "results_in_place": client.in_place, "row_table_in_host_memory": store.host_rows,
        "shape": {"layers": layers, "kv_heads": heads, "head_dim": head_dim, "tokens": tokens,
                  "page_bytes_bf16": page_bytes},
        "worker_startup_s": startup_s, "inline_seal_ms_with_fit": inline_fit_ms,
        "idle": idle, "saturated": saturated,
        "step_p50_ratio": saturated["step_ms"]["p50"] / idle["step_ms"]["p50"],
        "step_p99_ratio": saturated["step_ms"]["p99"] / idle["step_ms"]["p99"],
        "waits_on_daemon": 0,  # no blocking call at the boundary: see boundary_ms for its cost
        "daemon_pages_per_s": thr, "daemon_pages_per_s_per_core": thr / cores,
        "daemon_pages_per_busy_core_s": thr / (busy * cores) if busy else None,
        "bound_by": "workers" if busy >= WORKERS_BOUND_BUSY else "step boundary",
        "worker_page_ms": {"p50": lat[len(lat) // 2] * 1e3, "p99": lat[int(0.99 * (len(lat) - 1))]
                           * 1e3} if lat else None,
        "warm_up": warm,
        "dropped_pages_backpressure": state["dropped"] - dropped0,
        "production_pages_per_s_batch128": {str(ms): 128 / tokens / (ms / 1e3)
                                            for ms in args.production_step_ms},
    }
    rows = [("phase", "step p50 ms", "step p99 ms", "step max ms", "boundary p50/p99/max ms",
             "install p50/p99/max ms", "submit p50/p99/max ms", "ops per boundary",
             "deferred ops", "pages sealed", "worker busy")]
    for name in ("idle", "saturated"):
        r = out[name]
        rows.append((name, *(f"{r['step_ms'][q]:.2f}" for q in ("p50", "p99", "max")),
                     *("/".join(f"{r[k][q]:.2f}" for q in ("p50", "p99", "max"))
                       for k in ("boundary_ms", "install_ms", "submit_ms")),
                     " ".join(f"{n}:{c}" for n, c in r["ops_per_boundary"].items()),
                     str(r["deferred_ops"]), str(r["pages_done"]),
                     f"{r['worker_busy_fraction']:.2f}"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    mode = " overlapped with the boundary" if args.overlap else " then the boundary"
    print(f"shape {args.shape} {layers}x{heads}x{head_dim}, {tokens}-token pages "
          f"({page_bytes / 1e6:.1f} MB bf16), device {device}, {args.workers} workers x "
          f"{args.threads} threads, step work {args.step_ms} ms{mode}, "
          f"{args.pages_per_step} pages/step, boundary share {args.share}, install batch "
          f"{args.install_batch}, copies by "
          f"{'kernels' if slot_copy.gather is not None else 'torch'} on the "
          f"{args.copy_stream} stream{'s' if args.copy_stream == 'side' else ''}, results "
          f"{'read in place' if client.in_place else 'copied onto the device when read'}")
    print(f"saturated/idle step time: p50 {out['step_p50_ratio']:.3f}, "
          f"p99 {out['step_p99_ratio']:.3f}; steps that waited on the daemon: 0")
    print(f"daemon: {thr:.2f} pages/s ({thr / cores:.2f} per worker core), worker page latency "
          f"{out['worker_page_ms']}, inline seal (with basis fit) {inline_fit_ms:.0f} ms/page, "
          f"{out['dropped_pages_backpressure']} pages over the pending bound")
    print(f"bound by the {out['bound_by']}: workers busy {busy:.2f} of the saturated phase"
          + (f", {out['daemon_pages_per_busy_core_s']:.2f} pages per busy core-second" if busy
             else ""))
    print(f"warm-up: {warm['pages_installed']} pages installed in {warm['steps']} steps "
          f"({warm['layouts_registered']} layouts registered, {warm['open_jobs_left']} jobs left "
          f"open); layouts first seen while measuring: {saturated['layouts_registered']}")
    print("batch-128 production at stated step times: " + ", ".join(
        f"{ms} ms -> {v:.1f} pages/s" for ms, v in out["production_pages_per_s_batch128"].items()))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    a = saturated["adopt_page_ms"]
    if a["load"] and a["install"]:
        print(f"adopting one page on the scheduler thread ({a['pages']} pages in "
              f"{a['install_boundaries']} installs), ms p50/mean/max: "
              + ", ".join(f"{k} " + "/".join(f"{a[k][q]:.2f}" for q in ("p50", "mean", "max"))
                          for k in ("load", "install"))
              + "; inside an install, p50: " + ", ".join(
                  f"{k} {v['p50']:.2f}" for k, v in a["install_parts"].items() if v))
    for name in ("idle", "saturated"):
        b = out[name]["slowest_1pct_boundary_ms"]
        print(f"{name}: slowest 1% of boundaries ({b['steps']} steps), mean ms: "
              + ", ".join(f"{k} {b[k]:.2f}" for k in ("boundary", *BoundaryBreakdown.PARTS,
                                                        "other")))


if __name__ == "__main__":
    main()
