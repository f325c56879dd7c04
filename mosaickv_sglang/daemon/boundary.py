"""The fixed point where daemon results enter the pool: once per scheduler loop iteration,
before the next batch is chosen (no forward is running in Python then).

Every tensor-parallel rank runs its own daemon, so results arrive at different times on
different ranks. The open jobs are the same list on every rank (sealing decisions are
deterministic), so the ranks agree on a ready bitmap over it (MIN all-reduce on the TP CPU
group) and install exactly the agreed jobs: every rank switches the same pages at the same step.
Which agreed jobs go at a boundary (`install_batch`: a few pages together, one launch) follows
from the agreed set, the pool's state and the boundary count, all equal on every rank (each rank
runs one adoption per scheduler iteration, and its collectives keep the ranks in step).
Before that, one fixed-size all-reduce checks that the open-job lists really are equal (a clear
error instead of a mismatched collective) and spreads a broken daemon: if any rank's daemon is
broken, every rank seals inline from then on, so the ranks keep sealing the same pages at the
same step. Each rank logs its swaps per adoption point (swaplog.py) for an offline comparison.
A switch is atomic for readers: all layers of a page change between two forwards. On the GPU,
results are copied onto the device on the current stream, so the next forward is ordered after
them, and a freed hot page is only rewritten by a later forward on the same stream.
"""
from __future__ import annotations

import itertools
import logging
import math
import time

import torch

from .swaplog import digest

logger = logging.getLogger(__name__)


def _world(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def _rank(group) -> int:
    if _world(group) == 1:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group)


def agree(client, jobs: list, group=None) -> list:
    """The open `jobs` (the same list on every rank) ready on every rank of `group` (a gloo/CPU
    process group), in submit order; with one rank the client's ready jobs, without a look at
    the others."""
    if _world(group) == 1:
        return client.ready_jobs()
    if not jobs:
        return []
    import torch.distributed as dist

    flags = torch.tensor([job.id in client.ready for job in jobs], dtype=torch.uint8)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return [job for job, ok in zip(jobs, flags.tolist()) if ok]


def agree_state(jobs: list, broken: bool, group=None) -> bool:
    """Check that every rank of `group` holds the same open jobs (their (page, generation) lists);
    return whether the daemon is broken on *any* rank. One MIN all-reduce of 5 int64 (max as
    -min(-x)). Raises RuntimeError on every rank alike when the job lists differ."""
    if _world(group) == 1:
        return broken
    import torch.distributed as dist

    # every (page, generation) pair, plus (-1 - index, first page) per job for the job order
    d = digest([(p, g) for job in jobs for p, g in zip(job.pages, job.gens)]
               + [(-1 - i, job.pages[0]) for i, job in enumerate(jobs)])
    x = torch.tensor([len(jobs), -len(jobs), d, -d, -int(broken)], dtype=torch.int64)
    dist.all_reduce(x, op=dist.ReduceOp.MIN, group=group)
    n_min, n_max, d_min, d_max, any_broken = (int(v) * sign for v, sign in zip(
        x.tolist(), (1, -1, 1, -1, -1)))
    if n_min != n_max or d_min != d_max:
        raise RuntimeError(
            f"MosaicKV: tensor-parallel ranks hold different open daemon jobs ({n_min}..{n_max} "
            f"jobs, digests differ: {d_min != d_max}); their sealing decisions diverged, which "
            "would desynchronize the page switches. Please report with the server log.")
    return bool(any_broken)


def step_boundary(pool, group=None) -> int:
    """One step boundary: install a batch of agreed ready jobs (`install_batch`), apply
    backpressure (see MosaicKVPool._relieve) if free hot pages fell under the watermark, then
    let the client read results and fill slots within the boundary's budget (budget.py; without
    it while the hot buffer is low). Returns pages installed.

    How many pages are installed is decided without the clock, so every rank installs the same;
    their time counts against the budget, so the copies after them wait for a later boundary
    when they took the step's share."""
    client = pool.daemon
    budget = client.budget
    budget.open()
    client.boundaries += 1
    t = time.perf_counter()
    client.check()
    budget.note("check", time.perf_counter() - t)
    t = time.perf_counter()
    jobs = client.open_jobs() if _world(group) > 1 else []  # one rank: nothing to agree over
    if agree_state(jobs, client.broken, group) and not client.broken:
        client.broken = True
        logger.error("MosaicKV daemon: another tensor-parallel rank's daemon is broken: pages are "
                     "sealed on the scheduler thread here too (counted as sync_seals_fallback), "
                     "so every rank switches the same pages at the same step")
    installed = 0
    agreed = agree(client, jobs, group)
    for job in agreed:
        if job.agreed_at is None:
            job.agreed_at = client.boundaries
    budget.note("agree", time.perf_counter() - t)
    # Hot buffer within twice the watermark (the same on every rank): install, read and copy all
    # there is, unbudgeted (counted): spreading the work would bring an inline seal (0.5-1 s)
    # closer.
    watermark = math.ceil(pool.cfg.daemon_hot_watermark * pool.num_hot_pages)
    low = len(pool.free_hot_pages) < 2 * watermark
    if low:
        budget.lift()
    batch = install_batch(pool, agreed, client.boundaries, None if low else
                          pool.cfg.daemon_install_batch)
    if batch:
        t = time.perf_counter()
        # in batch order: consecutive jobs with results in one install, a job a worker failed
        # on sealed here
        for has_results, run in itertools.groupby(batch, key=lambda j: j.error is None):
            run = list(run)
            if has_results:
                n = pool._finish(run, [client.take_results(j) for j in run])
                client.counters.adopted_pages += n
                installed += n
                continue
            for job in run:  # (a cold job's pages are re-encoded here instead)
                client.counters.sync_seals_fallback += 0 if job.cold else len(job.pages)
                installed += pool._finish([job])
        budget.spent("install", time.perf_counter() - t, sum(len(j.pages) for j in batch))
    t = time.perf_counter()
    if client.broken:  # restarting did not help: seal what is left here (logged by the client)
        while open_jobs := client.open_jobs():
            job = pool.next_to_seal(open_jobs)
            client.cancel(job)
            client.counters.sync_seals_fallback += 0 if job.cold else len(job.pages)
            installed += pool._finish([job])
    # The position rule: no relief here (pages in their requests' dense window stay hot whoever
    # seals them, docs/determinism.md; the window is sized at start-up, hot_buffer_requests, and
    # only a write that finds no free hot page seals early: pool._relieve, counted). The chunk
    # rule: the oldest pending pages are sealed here while free hot pages are under the mark.
    relieved = 0 if pool.position_rule else pool._relieve(watermark)
    budget.note("relieve", time.perf_counter() - t, relieved)
    client.collect()
    t = time.perf_counter()
    pool.swaps.flush(_rank(group))
    budget.note("swaplog", time.perf_counter() - t)
    budget.close()
    return installed


def install_batch(pool, agreed: list, boundary: int, pages: int | None) -> list:
    """The agreed ready jobs to install at this boundary, in request order (a job whose earlier
    pages are still on their way waits; one whose earlier pages are in an earlier job of the
    batch goes with it): with `pages` None (the hot buffer is low) every installable one;
    otherwise none until they hold `pages` pages (or more than that is ready) or the oldest of
    them was agreed `pages` boundaries ago, then up to `pages` pages (always the first job).
    Installing a few pages in one boundary, one launch, spends the adoption's fixed cost once
    and leaves the other boundaries' first operation to the copies into slots. Deterministic
    in the pool's state and the boundary count: every rank takes the same."""
    chosen, ids, with_pages, total, full = [], set(), set(), 0, False
    while not full:  # passes until none is added: a job may become installable by a later one
        before = len(chosen)
        for job in agreed:
            if job.id in ids or not pool.installable(job, with_pages):
                continue
            if pages is not None and chosen and total + len(job.pages) > pages:
                full = True  # more is ready than one batch takes
                break
            chosen.append(job)
            ids.add(job.id)
            with_pages.update(job.pages)
            total += len(job.pages)
        if len(chosen) == before:
            break
    if pages is None or not chosen:
        return chosen
    due = full or total >= pages or boundary - min(j.agreed_at for j in chosen) >= pages
    return chosen if due else []
