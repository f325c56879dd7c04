"""Scheduler side of the recompression daemon: jobs, slots, workers, liveness.

A job is a group of full pages of one basis block, with the block's bases or none (the worker
fits them). At each step boundary (`collect()`) the client copies waiting jobs' pages from the
hot buffer into free shared-memory slots, sends them to the least loaded worker, and reads
finished pages without ever blocking: results are in shared memory and the pipe is polled with
a zero timeout. Both the reads and the copies run only while the boundary's time budget allows
(budget.py), so their cost is spread over steps. The pool decides what to do with ready jobs
(adopt.py); the client only moves data and keeps workers alive.

Results are read in place where the store can (`in_place`: on a CPU, and on CUDA when the
adoption kernel reads the pinned, mapped slots by address, checked once at start): a read only
notes where the page lies, the install unpickles it as views of its slot (`take_results`, no
device copy) and copies the bytes from the slot straight into the arena, so a page costs the
boundary two operations (copy into a slot, install), not three; the job holds its slots until
it is installed or dropped, and they are freed after an event recorded at the next boundary
(after its installs). Otherwise a read unpickles the result and copies it onto the device (a
third operation, budgeted) and frees the slots at once. Either way:

* a worker that exited, broke its pipe, or has work and no heartbeat for ``daemon_timeout_s``
  is killed and restarted (``check()``, first in a boundary); its unfinished jobs are sent
  again from the same slots (their pages are still in the hot buffer, and in the slots);
  counted in ``restarts`` / ``resubmitted_pages``;
* more than MAX_RESTARTS restarts within RESTART_WINDOW_S mark the daemon broken: the pool then
  seals synchronously, logged and counted, never silently.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Callable

import torch

from mosaickv_kernels.page_gather import PageGather

from ..codec.arena import ArenaPage
from ..codec.seal import BasisPair, SealedPage, page_kv
from ..config import MosaicConfig
from .budget import BoundaryBudget
from .channel import Channel, ChannelSpec, dump, load

logger = logging.getLogger(__name__)

STARTUP_S = 300.0  # a new worker may take this long to import torch before it first beats
MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0
# Each worker is looked at (a waitpid and a heartbeat read: ~15 us on the H200 host) about this
# often, one worker per check (all 12 at once took ~0.2 ms of one boundary); a broken result pipe
# (a worker that exited) is seen by the next collect and acted on at the next check.
CHECK_EVERY_S = 0.05
LATENCY_SAMPLES = 4096


@dataclass
class Job:
    id: int
    pages: list[int]  # logical pages, in position order
    gens: list[int]  # each page's generation when submitted (a reused page has a newer one)
    positions: list[int]
    first: int  # the basis block's first page: deferred pages of the block wait on this job
    bases: BasisPair | None  # None: the worker fits them on these pages
    bases_given: bool = False  # the bases came from the pool (not fitted by a worker)
    needs: list[int] = field(default_factory=list)  # pages to be sealed first (pool.installable)
    slots: list[int] = field(default_factory=list)
    worker: int = -1
    # CUDA events: after the K/V writes that filled the pages (recorded at submit, on the
    # forward's stream; the boundary's copy out of the hot buffer may run on another stream that
    # is not ordered after that forward, e.g. SGLang's scheduler stream behind a decode graph's
    # early read-done event), and after the copies into the slots
    written: object = None
    event: object = None
    # per page: None (not in yet), False (dropped), (offset, length) in its slot (read in place,
    # unpickled by take_results), or the page itself
    results: list = field(default_factory=list)
    error: str | None = None
    cancelled: bool = False
    holds_slots: bool = False  # ready with results read in place: slots freed once installed
    agreed_at: int | None = None  # the boundary (DaemonClient.boundaries) it was first agreed ready
    # a cold job (`submit_cold`): sealed pages to re-encode with the cold candidates, each as
    # what goes into its slot (an ArenaPage, or a SealedPage) until pumped; then where it lies
    cold: bool = False
    payloads: list | None = None
    inputs: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.error is not None or (bool(self.results) and None not in self.results)


@dataclass
class DaemonCounters:
    submitted_pages: int = 0
    adopted_pages: int = 0  # installed from a worker's result
    discarded_pages: int = 0  # result dropped: page freed/reused, or sealed by backpressure first
    sync_seals_backpressure: int = 0  # pages sealed on the scheduler thread (hot buffer low)
    sync_seals_needed: int = 0  # pages sealed on the scheduler thread: a forward read them now
    sync_seals_graph: int = 0  # pages sealed on the scheduler thread: over the decode graph's hot table
    sync_seals_fallback: int = 0  # pages sealed on the scheduler thread (worker error / broken)
    out_of_order_seals: int = 0  # pages of those sealed while no job was installable (stays 0)
    worker_errors: int = 0
    restarts: int = 0
    resubmitted_pages: int = 0
    worker_pages: int = 0
    worker_seconds: float = 0.0
    # results read arena-ready (adopted with a few bulk copies) / as per-tensor SealedPages (a
    # segment the arena cannot hold, e.g. a dense fallback: unpickled and installed per tensor)
    arena_ready_pages: int = 0
    per_tensor_pages: int = 0
    cold_submitted_pages: int = 0  # sealed pages sent to be re-encoded with the cold candidates
    cold_kept_pages: int = 0  # of those, pages no cold candidate made smaller (the worker said)


class _Kept:
    """A cold job's result for a page no cold candidate made smaller."""

    def __repr__(self) -> str:
        return "KEPT"


KEPT = _Kept()


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen
    jobs_conn: Connection
    results_conn: Connection
    spawned_at: float
    inflight: list[int] = field(default_factory=list)  # job ids, in send order


class DaemonClient:
    def __init__(self, cfg: MosaicConfig, layers: int, heads: int, head_dim: int,
                 dtype: torch.dtype, device, dense_spec: str, result_bytes: int,
                 slot_copy: SlotCopy, reads_host: Callable[[torch.Tensor], bool] | None = None):
        """slot_copy: what fills a slot with a logical page (and bases) from the device;
        reads_host: whether the store's install reads (on CUDA: pinned) host memory in place,
        given a scratch of it (`SegmentStore.reads_host`); None: results are copied when read,
        on a CPU too (daemon_bench's A/B, the copy path's tests)."""
        self.cfg = cfg
        self.device = _indexed(torch.device(device))
        self.slot_copy = slot_copy
        self.dense_spec = dense_spec
        spec = ChannelSpec(layers, heads, head_dim, cfg.segment_tokens, str(dtype).split(".")[-1],
                           cfg.daemon_queue_segments, cfg.daemon_workers, result_bytes)
        self.channel = Channel.create(spec)
        if self.device.type == "cuda":
            self.channel.pin()
        if reads_host is None:
            self.in_place, why = False, "not asked for"
        elif self.device.type == "cuda" and not self.channel.pinned:
            self.in_place, why = False, "slots not pinned"
        else:  # slot 0's result region is free now: a scratch for the check
            self.in_place, why = reads_host(self.channel.result(0)), "the check read failed"
        self.free_slots = deque(range(spec.slots))
        self.open: dict[int, Job] = {}  # submitted, not yet adopted/sealed/cancelled (id order)
        # the open jobs with every result in (or an error), kept as they complete so a boundary
        # looks at those only, not at every open job (~130 of them when saturated)
        self.ready: dict[int, Job] = {}
        self.waiting: deque[Job] = deque()  # no slots yet
        self.copying: deque[Job] = deque()  # in slots, device copy not finished
        self.inflight: dict[int, Job] = {}  # sent to a worker (cancelled ones too)
        self.releasing: deque[tuple[object, list[int]]] = deque()  # (event, slots)
        self._retiring: list[int] = []  # slots of installed/dropped in-place jobs (next pump)
        self.counters = DaemonCounters()
        self.latencies: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self.budget = BoundaryBudget(cfg.daemon_boundary_share)
        self._next_id = 0
        self.boundaries = 0  # step boundaries so far (adopt.py): the same count on every rank
        self._first_worker = -1  # collect() starts one worker further each boundary
        self._dead: dict[int, str] = {}  # worker index -> why, restarted by the next check()
        self._checked = float("-inf")  # when check() last looked at a worker
        self._next_check = 0  # the worker it looks at next
        self._restart_times: deque[float] = deque()
        self.broken = False
        self.workers = [self._spawn(i) for i in range(cfg.daemon_workers)]
        self._finalizer = weakref.finalize(self, _shutdown, self.workers, self.channel)
        # Results are unpickled on the scheduler thread at step boundaries; the objects that
        # makes let Python's full collections fire there, and a full collection walks the whole
        # start-up heap (31 of the 49 ms slowest boundaries on the H200 host,
        # benchmarks/RESULTS_ARCHIVE.md). What
        # exists now (SGLang, the model, the pool) lives as long as the server: freeze it (as
        # SGLang's freeze_gc does) so collections scan only what came after.
        gc.freeze()
        logger.info("MosaicKV daemon: froze %d start-up objects out of the garbage collector",
                    gc.get_freeze_count())
        logger.info("MosaicKV daemon: %d worker processes x %d threads, %d slots (%.1f MB shared "
                    "memory%s), results %s", cfg.daemon_workers, cfg.daemon_threads, spec.slots,
                    spec.total_bytes() / 1e6, ", pinned" if self.channel.pinned else "",
                    "read in place" if self.in_place else "copied onto the device when read")
        if not self.in_place:
            logger.warning("MosaicKV daemon: results are not read in place (%s): each one is "
                           "copied when read (on CUDA one more CUDA call a page on the "
                           "scheduler thread)", why)

    # ---- workers --------------------------------------------------------------------------
    def _spawn(self, index: int) -> _Worker:
        jobs_r, jobs_w = os.pipe()
        res_r, res_w = os.pipe()
        args = {"worker": index, "parent": os.getpid(), "channel": json.loads(
            self.channel.spec.to_json()), "config": self.cfg.to_dict(), "dense": self.dense_spec,
            "threads": self.cfg.daemon_threads, "fd_in": jobs_r, "fd_out": res_w}
        env = dict(os.environ, OMP_NUM_THREADS=str(self.cfg.daemon_threads))
        self.channel.heartbeats[index] = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "mosaickv_sglang.daemon.worker",
                                 json.dumps(args)], pass_fds=(jobs_r, res_w), env=env)
        os.close(jobs_r)
        os.close(res_w)
        return _Worker(index, proc, Connection(jobs_w, readable=False),
                       Connection(res_r, writable=False), time.monotonic())

    def _alive(self, w: _Worker) -> str | None:
        """None if healthy, else why it is not."""
        if w.proc.poll() is not None:
            return f"exited with {w.proc.returncode}"
        beat = float(self.channel.heartbeats[w.index])
        started = beat > w.spawned_at
        silent = time.monotonic() - beat
        limit = self.cfg.daemon_timeout_s if started else max(self.cfg.daemon_timeout_s, STARTUP_S)
        if w.inflight and silent > limit:
            return f"no heartbeat for {silent:.1f} s with {len(w.inflight)} jobs"
        return None

    def _restart(self, w: _Worker, why: str) -> None:
        """Kill, respawn, and send its unfinished jobs again (data still in their slots)."""
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGKILL)
        w.proc.wait()
        w.jobs_conn.close()
        w.results_conn.close()
        self.counters.restarts += 1
        now = time.monotonic()
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        jobs = [self.inflight.pop(j) for j in w.inflight if j in self.inflight]
        new = self._spawn(w.index)
        self.workers[w.index] = new
        if len(self._restart_times) > MAX_RESTARTS:
            self.broken = True
            logger.error("MosaicKV daemon: worker %d %s; %d restarts in %.0f s: daemon marked "
                         "broken, pages are sealed on the scheduler thread from now on "
                         "(counted as sync_seals_fallback)", w.index, why,
                         len(self._restart_times), RESTART_WINDOW_S)
        else:
            logger.warning("MosaicKV daemon: worker %d %s; restarted (pid %d), resubmitting %d "
                           "jobs", w.index, why, new.proc.pid, len(jobs))
        for job in jobs:
            if job.cancelled:
                self._release(job.slots)
                continue
            job.results = [None] * len(job.pages)
            if job.bases is not None and not job.bases_given:
                job.bases = None  # fitted by the dead worker: fit again
            self.counters.resubmitted_pages += len(job.pages)
            self._send(job)

    # ---- jobs -----------------------------------------------------------------------------
    def submit(self, pages: list[int], gens: list[int], positions: list[int], first: int,
               bases: BasisPair | None, needs: list[int] = ()) -> Job:
        job = Job(self._next_id, pages, gens, positions, first, bases, bases is not None,
                  list(needs), written=_record(self.device))
        self._next_id += 1
        self.open[job.id] = job
        self.waiting.append(job)  # copied into slots at a step boundary (pump)
        self.counters.submitted_pages += len(pages)
        return job

    def submit_cold(self, pages: list[int], gens: list[int], positions: list[int],
                    payloads: list) -> Job:
        """Sealed pages to re-encode with the cold candidates (`codec/cold.py`) off the
        scheduler thread: `payloads` are the pages as they are stored (ArenaPages without
        bases: re-encoding stays in their SVD basis), written into slots at a boundary (pump);
        the results come back arena-ready, or KEPT for a page nothing made smaller."""
        job = Job(self._next_id, pages, gens, positions, -1, None, True, cold=True,
                  payloads=payloads)
        self._next_id += 1
        self.open[job.id] = job
        self.waiting.append(job)
        self.counters.cold_submitted_pages += len(pages)
        return job

    def pump(self) -> None:
        """Copy waiting jobs into free slots (FIFO) while the boundary's budget allows, then send
        those whose copies are done."""
        if self._retiring:  # after this boundary's installs, which read them (one event)
            self.releasing.append((_record(self.device), self._retiring))
            self._retiring = []
        while self.releasing and _done(self.releasing[0][0]):
            self.free_slots.extend(self.releasing.popleft()[1])
        while (self.waiting and len(self.free_slots) >= len(self.waiting[0].pages)
               and self.budget.allows("pump", len(self.waiting[0].pages))):
            t = time.perf_counter()
            job = self.waiting.popleft()
            job.slots = [self.free_slots.popleft() for _ in job.pages]
            if job.cold:  # the stored pages' bytes, pickled into the slots' K/V regions
                job.inputs = [dump(p, self.channel.kv(slot).view(-1).view(torch.uint8))
                              for p, slot in zip(job.payloads, job.slots)]
                job.payloads = None  # in the slots now (a restart resends them from there)
                job.event = None
            else:
                fill_slots(self.channel, self.slot_copy, job.pages, job.slots, job.bases,
                           job.written)
                job.event = self.slot_copy.done()
            self.copying.append(job)
            self.budget.spent("pump", time.perf_counter() - t, len(job.pages))
        while self.copying and _done(self.copying[0].event):
            job = self.copying.popleft()
            if job.cancelled:
                self._release(job.slots)
            else:
                self._send(job)

    def _send(self, job: Job) -> None:
        job.results = [None] * len(job.pages)
        w = min(self.workers, key=lambda w: sum(len(self.inflight[j].pages)
                                                for j in w.inflight if j in self.inflight))
        msg = {"id": job.id, "slots": job.slots, "positions": job.positions,
               "fit": job.bases is None and not job.cold}
        if job.cold:
            msg["cold"] = job.inputs
        job.worker = w.index
        self.inflight[job.id] = job
        w.inflight.append(job.id)
        try:
            w.jobs_conn.send(msg)
        except OSError:  # broken pipe: the worker died; check() restarts and resends
            pass

    def cancel(self, job: Job) -> None:
        """The pool no longer wants this job (its pages were freed or sealed another way)."""
        self.open.pop(job.id, None)
        self.ready.pop(job.id, None)
        job.cancelled = True
        if job in self.waiting:
            self.waiting.remove(job)
        self._let_go(job)

    def retire(self, job: Job) -> None:
        """The pool is installing (or discarding) this ready job now: its slots are freed after
        the next boundary's event, which follows the install's reads of them."""
        self.open.pop(job.id, None)
        self.ready.pop(job.id, None)
        self._let_go(job)

    def _let_go(self, job: Job) -> None:
        if job.holds_slots:
            job.holds_slots = False
            self._retiring.extend(job.slots)

    def open_jobs(self) -> list[Job]:
        return list(self.open.values())

    def ready_jobs(self) -> list[Job]:
        """The open jobs that are ready, in submit order."""
        return [self.ready[i] for i in sorted(self.ready)]

    # ---- results --------------------------------------------------------------------------
    def check(self) -> None:
        """Restart dead/hung workers: those whose pipe broke in the last collect at once, and one
        more worker in turn whenever CHECK_EVERY_S / workers passed. Runs first in a boundary,
        before the ranks agree, so a daemon marked broken here is known to every rank
        (agree_state) before any seals another page."""
        for index, why in list(self._dead.items()):
            del self._dead[index]
            self._restart(self.workers[index], why)
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY_S / max(len(self.workers), 1):
            return
        self._checked = now
        w = self.workers[self._next_check % len(self.workers)]
        self._next_check += 1
        why = self._alive(w)
        if why is not None:
            self._restart(w, why)

    def collect(self) -> None:
        """Non-blocking: read finished pages while the boundary's budget allows (workers taken in
        turn, starting one further each boundary: none is starved), then pump. The workers
        with a result (or a closed pipe) are found by one `wait` over every result pipe, not a
        poll each (~15 us apiece on the H200 host: 0.2 ms a boundary with 12 workers)."""
        n = len(self.workers)
        self._first_worker = (self._first_worker + 1) % max(n, 1)
        turn = [self.workers[(self._first_worker + i) % n] for i in range(n)]
        turn = [w for w in turn if w.index not in self._dead]
        readable = set(wait([w.results_conn for w in turn], timeout=0)) if turn else ()
        for w in turn:
            if w.results_conn in readable:
                why = self._drain(w)
                if why is not None:
                    self._dead[w.index] = why
        self.pump()

    def _drain(self, w: _Worker) -> str | None:
        """Read a worker's results (one is waiting) while the budget allows (unbudgeted when
        read in place: a note of where each page lies) -> why it is broken, or None."""
        try:
            waiting = True
            while waiting and (self.in_place or self.budget.allows("load")):
                t = time.perf_counter()
                self._handle(w, w.results_conn.recv())
                if self.in_place:
                    self.budget.note("read", time.perf_counter() - t)
                else:
                    self.budget.spent("load", time.perf_counter() - t)
                waiting = w.results_conn.poll(0)
        except (EOFError, OSError) as exc:
            return f"result pipe closed ({type(exc).__name__})"
        return None

    def _handle(self, w: _Worker, msg: dict) -> None:
        job = self.inflight.get(msg["id"])
        if job is None:
            return
        if "error" in msg:
            self.counters.worker_errors += 1
            logger.error("MosaicKV daemon: worker %d failed on job %d (its pages are sealed on "
                         "the scheduler thread):\n%s", w.index, job.id, msg["error"])
            job.error = msg["error"]
        elif job.cancelled:  # nobody wants it: do not copy it out
            job.results[msg["index"]] = False
        elif msg.get("kept"):
            job.results[msg["index"]] = KEPT
            self.counters.cold_kept_pages += 1
            self.counters.worker_pages += 1
            self.counters.worker_seconds += msg["seconds"]
        else:
            i = msg["index"]
            where = (msg["offset"], msg["length"])
            job.results[i] = where if self.in_place else self._load(job, i, *where)
            self.latencies.append(msg["seconds"])
            self.counters.worker_pages += 1
            self.counters.worker_seconds += msg["seconds"]
        if job.ready:
            self.inflight.pop(job.id)
            w.inflight.remove(job.id)
            keep = self.in_place and not job.cancelled and job.id in self.open
            if keep:
                job.holds_slots = True
            else:  # after the copies out of them queued above
                self._release(job.slots, _record(self.device))
            if job.cancelled:
                self.counters.discarded_pages += len(job.pages)
            elif job.id in self.open:
                self.ready[job.id] = job

    def take_results(self, job: Job) -> list:
        """A ready job's pages for the install, unpickled now where they were read in place (in
        page order: the first page of a fit job brings the bases the others refer to)."""
        return [self._load(job, i, *r) if isinstance(r, tuple) else r
                for i, r in enumerate(job.results)]

    def _load(self, job: Job, i: int, offset: int, length: int):
        """Page `i` of `job` out of its slot: views of it (in place) or a device copy."""
        refs = {"bases": job.bases} if job.bases is not None else {}
        region = self.channel.result(job.slots[i])
        page = load(region, offset, length, refs, None if self.in_place else self.device)
        if self.in_place and not isinstance(page, ArenaPage):
            # stored per tensor as it is (rare: a dense fallback): onto the device now
            page = load(region, offset, length, refs, self.device)
        elif job.cold:  # no bases travel: the pool keeps the page's own
            pass
        elif self.in_place and job.bases is None:
            page.bases = page.bases.copy_to(self.device)  # kept by the pool: off the slot
        if job.bases is None and not job.cold:
            job.bases = page.bases  # fitted by the worker, sent with the first page
        if isinstance(page, ArenaPage):
            self.counters.arena_ready_pages += 1
        else:
            if not self.counters.per_tensor_pages:
                logger.warning("MosaicKV daemon: a result holds segments the arena cannot "
                               "(e.g. a dense fallback) and is read per tensor, slower on "
                               "the scheduler thread; counted in stats (per_tensor_pages)")
            self.counters.per_tensor_pages += 1
        return page

    def _release(self, slots: list[int], event=None) -> None:
        if event is None:
            self.free_slots.extend(slots)
        else:
            self.releasing.append((event, slots))

    # ---- lifecycle / stats ----------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers and free the shared memory (also run at exit / garbage collection)."""
        self._finalizer()

    def summary(self) -> str:
        """The daemon's part of the pool's log line."""
        c, st = self.counters, self.stats()
        p99 = st["page_seconds_p99"]
        return (f", daemon: {st['queued_pages']} queued / {st['inflight_pages']} in flight, "
                f"adopted {c.adopted_pages} (read arena-ready {c.arena_ready_pages}, per tensor "
                f"{c.per_tensor_pages}), discarded {c.discarded_pages}, backpressure seals "
                f"{c.sync_seals_backpressure}, fallback seals {c.sync_seals_fallback}, restarts "
                f"{c.restarts}, page p99 {'-' if p99 is None else f'{p99 * 1e3:.0f} ms'}, "
                f"boundary operations deferred {self.budget.deferred}")

    def stats(self) -> dict:
        lat = sorted(self.latencies)

        def q(p):
            return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None

        return {
            "workers": len(self.workers), "broken": self.broken,
            "worker_pids": [w.proc.pid for w in self.workers],  # this pool's own (soak_bench)
            "queued_pages": sum(len(j.pages) for j in self.waiting),
            "inflight_pages": sum(len(j.pages) for j in list(self.copying) +
                                  list(self.inflight.values())),
            "ready_pages": sum(len(j.pages) for j in self.ready.values()),
            "free_slots": len(self.free_slots), "slots": self.channel.spec.slots,
            "results_in_place": self.in_place,
            "held_slots": sum(len(j.slots) for j in self.ready.values() if j.holds_slots),
            "page_seconds_p50": q(0.5), "page_seconds_p99": q(0.99),
            "boundary": self.budget.stats(),
            **self.counters.__dict__,
        }


class SlotCopy:
    """Fills daemon slots from the device: a logical page's K/V, every layer ([L, 2, H, S, D],
    from its hot page; a page freed since submit goes as zeros: its result is discarded by
    generation, and zeros add nothing to a basis fit over the job's other pages), and a job's
    bases. The page is read by one `page_gather` launch with `kernel`, else by `page_kv`'s torch
    stack of every layer's slice (~0.5 ms of H200 host time a page).

    On CUDA the copies leave the forward's stream: on a side stream that waits for the event
    recorded where the pages were written (`after`), the page is read, an event lets the
    current stream go on once it was read (a freed hot page is rewritten only after that: tens
    of microseconds), and the page and the bases go on to the pinned slot (~25 MB a Llama-8B
    page with its bases, ~0.5 ms of PCIe) on the same stream, which only the job's event
    (`done`) waits for. On the current stream those copies delayed the next step when a
    boundary filled several slots (H200, 2026-12-01: step p99 1.09-1.14x of idle). Each CUDA
    call costs the scheduler thread up to ~0.1 ms behind a busy stream (H200 host probe), so a
    page takes six or seven: the wait, the launch, the read event and the current stream's wait on
    it, one or two copies, the done event."""

    def __init__(self, k_buffer: list[torch.Tensor], v_buffer: list[torch.Tensor],
                 page_size: int, kernel: bool, hot_page_of: Callable[[int], int],
                 side_streams: bool = True):
        """side_streams=False: every copy on the current stream (daemon_bench's A/B only)."""
        self.k_buffer, self.v_buffer, self.page_size = k_buffer, v_buffer, page_size
        self.hot_page_of = hot_page_of
        self.gather = PageGather(k_buffer, v_buffer, page_size) if kernel else None
        self.device = device = k_buffer[0].device  # a tensor's: with its index
        self.stream = (torch.cuda.Stream(device)
                       if device.type == "cuda" and side_streams else None)

    def warm(self) -> None:
        """Compile the page gather before serving (one gather of hot page 0, dropped): at the
        first pump it cost that boundary ~0.4 s (a GPU server, benchmarks/RESULTS_ARCHIVE.md)."""
        if self.gather is not None:
            self.gather(0)

    def start(self, after=None) -> None:
        """Order the copies that follow after `after` (a CUDA event recorded where the pages
        and bases were made), or after the current stream's work so far."""
        if self.stream is None:  # every copy on the current stream
            if after is not None:
                torch.cuda.current_stream(self.device).wait_event(after)
        elif after is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.stream.wait_event(after)

    def page(self, page: int, dst: torch.Tensor) -> None:
        hot = self.hot_page_of(page)
        if hot < 0:
            dst.zero_()  # host memory, and no copy into this free slot is pending
            return
        if self.stream is None:
            dst.copy_(self._read(hot), non_blocking=True)
            return
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            kv = self._read(hot)  # made on this stream: used only here, no record_stream
            # the current stream goes on once the hot page was read, not after the PCIe copy
            current.wait_event(self.stream.record_event())
            dst.copy_(kv, non_blocking=True)

    def tensor(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A device tensor made before `start`'s event into slot memory."""
        if self.stream is None:
            dst.copy_(src, non_blocking=True)
            return
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)  # its memory is reused only after this copy

    def done(self):
        """A CUDA event after every copy queued so far (None on a CPU: copies are done)."""
        return _record(self.device, self.stream)

    def _read(self, hot: int) -> torch.Tensor:
        if self.gather is not None:
            return self.gather(hot)
        return page_kv(self.k_buffer, self.v_buffer, hot, self.page_size)

    def staging_bytes(self) -> int:
        """Device bytes one page takes on its way to a slot (freed once copied)."""
        b = self.k_buffer[0]
        return len(self.k_buffer) * 2 * self.page_size * b[0].numel() * b.element_size()


def fill_slots(channel: Channel, slot_copy: SlotCopy, pages: list[int], slots: list[int],
               bases: BasisPair | None, after=None) -> None:
    """A job's pages, and its bases when it has them, into its slots (asynchronous on CUDA: the
    slots are pinned), after `after` (the event recorded when the job's pages were written;
    its bases were made before): the copy a step boundary pays per job."""
    slot_copy.start(after)
    for page, slot in zip(pages, slots):
        slot_copy.page(page, channel.kv(slot))
    if bases is not None:  # all layers' K and V bases in one copy
        slot_copy.tensor(bases.stacked(), channel.bases(slots[0]).view(-1, *bases.k[0].shape))


def _shutdown(workers: list[_Worker], channel: Channel) -> None:
    for w in workers:
        try:
            w.jobs_conn.send(None)
        except OSError:
            pass
    for w in workers:
        try:
            w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        w.jobs_conn.close()
        w.results_conn.close()
    channel.close(unlink=True)


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index ("cuda" -> "cuda:N"): torch looks up the current device on
    every stream or event call given a device without one (~30 us of host time each)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _record(device: torch.device, stream=None):
    """A CUDA event on `stream` (None: `device`'s current stream); None on a CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(stream if stream is not None else torch.cuda.current_stream(device))
    return event


def _done(event) -> bool:
    return event is None or event.query()
