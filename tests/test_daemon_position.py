"""The recompression daemon under read_rule "position" (docs/determinism.md; test_daemon.py
covers the default chunk rule, and the parts the rule does not touch: the shared-memory channel,
restarts, health checks, TP agreement) without a server: worker seals identical to the
synchronous path, the swap (read hot until the read rule reads a page compressed, adopted or not,
then exactly the final segments), pages needed before their result, backpressure, prefix repair,
install order, and random steps keeping requests' sealed pages prefixes."""
import contextlib
import os
import random
import signal
import time

import pytest
import torch

from conftest import repro
from mosaickv_sglang.codec.arena import HDR
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.daemon import boundary as boundary_mod
from mosaickv_sglang.serving.pool import MosaicKVPool
from mosaickv_sglang.serving.segment_store import SegmentStore
from test_daemon import attend, one_thread, same_pages, settle, write  # noqa: F401 (fixture)

PS, H, D, LAYERS = 128, 2, 64, 2
BLOCK = 4 * PS  # 4 pages per basis block: a request of 6 pages spans two blocks
# A daemon window (daemon_lag_tokens) past every seal point of the short requests below: their
# full pages go to the workers instead of being needed at once (the default, 128 = one page,
# leaves a request's last full page to the daemon and seals the rest inline)
LAG = 8 * PS


def make_pool(daemon="process", pages=24, **cfg) -> MosaicKVPool:
    config = MosaicConfig(basis_block_tokens=BLOCK, daemon=daemon, daemon_queue_segments=8,
                          **{"hot_tokens": 0, "hot_buffer_fraction": 1.0, "daemon_workers": 1,
                             "read_rule": "position", "basis_fit": "first_page", **cfg})
    pool = MosaicKVPool(pages * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=config)
    return pool


@pytest.fixture
def pools():
    made = []

    def factory(*args, **kwargs):
        made.append(make_pool(*args, **kwargs))
        return made[-1]

    yield factory
    for p in made:
        if p.daemon is not None:
            p.daemon.close()


# --------------------------------------------------------------------------- channel


# --------------------------------------------------------------------------- swap

@pytest.mark.parametrize("in_place", [True, False])
def test_daemon_seals_equal_sync_seals_and_reads_switch_atomically(pools, monkeypatch, in_place):
    """The daemon seals a request's full pages inside its dense window (the read rule's LAG):
    its pages are the bytes the inline pool (daemon off, the same window as hot_tokens) seals
    when the rule first reads them compressed, deferred pages reusing the daemon-fitted bases.
    Adopting them changes no read: until the rule reads a page compressed every read is the hot
    data, bit for bit; from the seal point where it does, all layers of that page read exactly
    the inline pool's segments. in_place False: the store cannot read the slots (a CUDA host
    where the check fails): results are copied when read and their slots freed at once; the
    same pages either way."""
    if not in_place:
        monkeypatch.setattr(SegmentStore, "reads_host", lambda self, scratch: False)
    a, b = pools("process", daemon_lag_tokens=LAG), pools("off", hot_tokens=LAG)
    assert a.daemon.in_place is in_place and a.dense_window == b.dense_window == LAG
    slots = torch.arange(PS, 8 * PS + 40)  # pages 1..7 full: two basis blocks; a partial page 8
    for p in (a, b):
        write(p, slots, seed=0)
    hot_out = attend(a, slots, seed=1)
    assert a.seal_request(slots[:3 * PS], 3 * PS) == 3  # block 0's first group: bases fitted
    assert a.seal_request(slots, len(slots)) == 4  # rest of block 0 waits for those bases
    assert a.deferred and not a.sealed
    # the same two seal points inline: nothing is read compressed yet, nothing sealed
    assert b.seal_request(slots[:3 * PS], 3 * PS) == 0 and b.seal_request(slots, len(slots)) == 0
    # until adoption every read is the hot (dense) data, bit for bit
    assert all(torch.equal(x, y) for x, y in zip(hot_out, attend(a, slots, seed=1)))
    settle(a)
    st = a.stats()["daemon"]
    assert st["adopted_pages"] == 7 and st["submitted_pages"] == 7 and st["free_slots"] == 8
    assert st["sync_seals_backpressure"] == st["discarded_pages"] == st["restarts"] == 0
    assert st["swaps"]["pages"] == 7 and not a.swaps.pending  # every swap logged at a step
    # adopted, hot copies kept: the read rule, not the daemon, decides what is read
    assert sorted(a.sealed) == sorted(a.kept_hot) == list(range(1, 8))
    assert a.request_view(0, slots)[0] == []
    assert all(torch.equal(x, y) for x, y in zip(hot_out, attend(a, slots, seed=1)))
    # the request grows to position n, whose token reads pages 1..7 compressed
    n = 7 * PS + LAG
    full = torch.arange(PS, PS + n + 1)
    for p in (a, b):
        write(p, full[len(slots):], seed=2)
    for t, k in ((n - 1, 6), (n, 7)):  # the seal points before tokens n - 1 and n
        a.seal_request(full[:t], t)
        before = len(b.sealed)
        assert b.seal_request(full[:t], t) == k - before  # inline: the pages now needed
        assert sorted(a.kept_hot) == list(range(k + 1, 8))  # freed once read compressed
        assert a.request_view(0, full[:t + 1])[0] == b.request_view(0, full[:t + 1])[0] \
            == list(range(1, k + 1))
        assert all(torch.equal(x, y) for x, y in zip(attend(a, full[:t + 1], 1),
                                                     attend(b, full[:t + 1], 1))), t
    same_pages(a, b)  # deferred pages reused the daemon-fitted bases, like the inline path
    assert a.daemon.counters.sync_seals_needed == 0  # every page was adopted before needed
    assert a.counters.early_sealed_reads == b.counters.early_sealed_reads == 0


@pytest.mark.parametrize("copies", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="the kernels on a CPU pool need Triton's interpreter "
    "(CPU-only machines; on a GPU adopt_bench and the kernel tests cover them)"))])
def test_arena_ready_results_are_the_inline_seal_bytes_in_the_store(pools, seed, caplog, copies):
    """A page the worker sends arena-ready and the store adopts with one copy holds exactly the
    bytes the inline seal installs: arena block (padding included: both arenas start poisoned),
    header row (but its base), page metadata; its Segments and decode outputs are the same. The
    sink page here stays dense (no sink candidate): it takes the per-tensor path, counted and
    logged once. `copies` triton: the daemon pool's slot copies (`page_gather`) and adoptions
    (`row_copy`) run on the kernels (the interpreter here, as on CUDA by default). The inline
    pool has the daemon's window (hot_tokens = LAG): it seals the pages where the read rule
    first reads them compressed, which is where the daemon pool's kept hot copies go."""
    cfg = dict(k_error_budget=1.0, v_error_budget=1.0, sink_candidates=[])
    a = pools("process", pack_kernel=copies, daemon_lag_tokens=LAG, **cfg)
    b = pools("off", hot_tokens=LAG, **cfg)
    assert a.stats()["daemon"]["slot_copies"] == ("kernel" if copies == "triton" else "torch")
    assert a.store.pack_kernel == (copies == "triton")
    slots = torch.arange(PS, 8 * PS + 40)  # pages 1..7 full (page 1 the sink), partial page 8
    for p in (a, b):
        for data in p.store.data:
            data.fill_(0x5A)
        write(p, slots, seed)
        p.seal_request(slots, len(slots))
    with caplog.at_level("WARNING", logger="mosaickv_sglang.daemon.client"):
        settle(a)
    st = a.stats()["daemon"]
    assert (st["arena_ready_pages"], st["per_tensor_pages"]) == (6, 1), repro(seed)
    assert sum("read per tensor" in r.message for r in caplog.records) == 1
    assert not b.sealed and sorted(a.kept_hot) == list(range(1, 8))  # both still read dense
    assert all(torch.equal(x, y) for x, y in zip(attend(a, slots, seed), attend(b, slots, seed)))
    # the request grows to position n, whose token reads pages 1..7 compressed: the inline pool
    # seals them there, the daemon pool frees their hot copies (no page sealed here)
    n = 7 * PS + LAG
    slots = torch.arange(PS, PS + n + 1)
    for p in (a, b):
        write(p, slots[7 * PS + 40:], seed + 1)
        p.seal_request(slots[:n], n)
    assert not a.kept_hot and len(b.sealed) == 7 and a.daemon.counters.sync_seals_needed == 0
    same_pages(a, b)
    assert a.store.blocks.keys() == b.store.blocks.keys() and len(a.store.blocks) == 6 * LAYERS
    base16 = HDR["base16"]
    for (layer, page), (base, size) in b.store.blocks.items():
        other, other_size = a.store.blocks[(layer, page)]
        assert size == other_size
        assert torch.equal(a.store.data[layer][other:other + size],
                           b.store.data[layer][base:base + size]), (layer, page, repro(seed))
        ha, hb = a.store.headers[layer][page].clone(), b.store.headers[layer][page].clone()
        assert ha[base16] * 16 == other and hb[base16] * 16 == base
        ha[base16] = hb[base16] = 0
        assert torch.equal(ha, hb), (layer, page)
        for f in ("channels", "lo", "hi", "rest_norm"):
            assert torch.equal(getattr(a.store.meta[layer], f)[page],
                               getattr(b.store.meta[layer], f)[page]), (f, layer, page)
    assert torch.equal(a.store.packed, b.store.packed)
    assert all(torch.equal(x, y) for x, y in zip(attend(a, slots, seed), attend(b, slots, seed)))


def test_a_step_boundary_spreads_daemon_work_over_steps(pools):
    """With no share of the step to spend (daemon_boundary_share 0) every boundary runs one
    budgeted operation: a job's copy into slots or a job's install, never two; reading where
    finished pages lie (results read in place, as on a CPU) is not one, so the finished pages
    of both workers are read in one boundary; everything still arrives."""
    a = pools("process", daemon_workers=2, daemon_boundary_share=0.0, daemon_lag_tokens=LAG)
    client = a.daemon
    for r in range(2):  # two requests, one 3-page job each (their own basis blocks)
        slots = torch.arange((1 + 4 * r) * PS, (4 + 4 * r) * PS)
        write(a, slots, seed=r)
        assert a.seal_request(slots, len(slots)) == 3
    assert not client.inflight  # submitting copies nothing: the boundaries do
    a.step_boundary()
    assert len(client.inflight) == 1 and client.budget.ops == 1  # one job copied, one waits
    a.step_boundary()
    assert len(client.inflight) == 2
    deadline = time.time() + 120
    while sum(w.results_conn.poll(0) for w in client.workers) < 2:  # both workers sent a page
        assert time.time() < deadline
        time.sleep(0.05)
    ops = []
    while client.open_jobs() and time.time() < deadline:
        read, installed = client.counters.worker_pages, client.counters.adopted_pages
        a.step_boundary()
        ops.append((client.counters.worker_pages - read, client.counters.adopted_pages - installed))
        assert client.budget.ops <= 1, ops
    assert ops[0][0] >= 2 and ops[0][1] == 0, ops  # two finished pages waiting: both read
    assert client.counters.worker_pages == 6 and client.counters.adopted_pages == 6
    assert client.stats()["boundary"]["deferred_ops"] > 0
    assert a.kept_hot == set(a.sealed) and len(a.sealed) == 6  # read dense until the rule says


def test_a_low_hot_buffer_lifts_the_boundary_budget(pools):
    """Within twice the watermark of free hot pages a boundary copies, reads and installs all it
    can even with no share to spend: spreading the work would bring an inline seal closer. The
    boundary itself seals nothing inline (no relief at the watermark: only a write that finds no
    free hot page does, `_take_hot_page`), and the installs keep their hot copies."""
    a = pools("process", daemon_workers=2, daemon_boundary_share=0.0, daemon_hot_watermark=0.45,
              daemon_lag_tokens=LAG)
    for r in range(2):  # 6 of 25 hot pages taken: 19 free, watermark 12, so below 2 x 12
        slots = torch.arange((1 + 4 * r) * PS, (4 + 4 * r) * PS)
        write(a, slots, seed=r)
        a.seal_request(slots, len(slots))
    assert a.step_boundary() == 0 and not a.sealed  # nothing sealed inline
    assert len(a.daemon.inflight) == 2 and a.daemon.budget.ops == 2  # both jobs in one boundary
    assert a.daemon.stats()["boundary"]["unbounded_boundaries"] == 1
    deadline = time.time() + 120
    while a.daemon.counters.worker_pages < 6:  # read (still unbudgeted), nothing installed yet
        a.daemon.collect()
        assert time.time() < deadline
        time.sleep(0.02)
    assert a.step_boundary() == 6  # both ready jobs in one boundary, not one per boundary
    assert len(a.sealed) == 6 and a.daemon.counters.sync_seals_backpressure == 0
    assert a.kept_hot == set(a.sealed) and len(a.free_hot_pages) == 19  # still low: read dense


def test_results_read_in_place_hold_their_slots_until_installed_or_dropped(pools):
    """A result read in place stays in its slot until the install copied it out: the slots are
    held while the job is ready, and free again after the boundary that installed it; a ready
    job dropped instead (its page freed) lets its slots go too."""
    # a job's 3 pages go at the next boundary
    a = pools("process", daemon_install_batch=3, daemon_lag_tokens=LAG)
    assert a.daemon.in_place  # on a CPU results are always read in place
    for r, drop in ((0, False), (1, True)):
        slots = torch.arange((1 + 3 * r) * PS, (4 + 3 * r) * PS)  # 3 pages: one fit job
        write(a, slots, seed=r)
        a.seal_request(slots, len(slots))
        deadline = time.time() + 120
        while not a.daemon.ready:  # boundaries that read only (nothing installed)
            a.daemon.budget.open()
            a.daemon.collect()
            assert time.time() < deadline, (r, a.daemon.stats())
            time.sleep(0.02)
        job = next(iter(a.daemon.ready.values()))
        st = a.daemon.stats()
        assert st["held_slots"] == 3 and st["free_slots"] == 8 - 3
        if drop:
            a.release_pages(job.pages)  # the request ended before the install
        installed = a.step_boundary()
        assert installed == (0 if drop else 3)
        st = a.daemon.stats()
        assert st["held_slots"] == 0 and st["free_slots"] == 8, (r, st)
    assert len(a.sealed) == 3


def test_a_job_a_worker_failed_on_is_sealed_here_beside_a_batch_of_results(pools):
    """Two ready jobs installed at one boundary (one basis block each; the second's earlier
    pages are the first's), the first one's worker reported an error: it is sealed on this
    thread (counted as a fallback) and, after it, the second goes in from its result; the pages
    are what synchronous sealing stores."""
    a, b = pools("process", daemon_install_batch=8, daemon_lag_tokens=LAG), pools("off")
    slots = torch.arange(PS, 9 * PS)  # pages 1..8: two basis blocks of four
    for p in (a, b):
        write(p, slots, seed=4)
        p.seal_request(slots[:4 * PS], 4 * PS)
        p.seal_request(slots, len(slots))
    deadline = time.time() + 120
    while len(a.daemon.ready) < 2:  # boundaries that read only (nothing installed)
        a.daemon.budget.open()
        a.daemon.collect()
        assert time.time() < deadline, a.daemon.stats()
        time.sleep(0.02)
    a.daemon.ready_jobs()[0].error = "injected"
    assert a.step_boundary() == 8
    st = a.stats()["daemon"]
    assert st["sync_seals_fallback"] == 4 and st["adopted_pages"] == 4, st
    assert {5, 6, 7, 8} <= a.kept_hot  # the results keep their hot copies
    same_pages(a, b)


def test_backpressure_seals_oldest_pages_inline_when_hot_buffer_runs_low(pools):
    """The only relief left: a forward's first-layer write that finds no free hot page seals the
    oldest open job on this thread (before any attention of that forward) instead of failing the
    batch, counted; a step boundary seals nothing, however low the hot buffer runs."""
    # 8 hot pages, a watermark of half of them, and the only worker stopped (daemon saturated)
    a = pools("process", pages=32, hot_buffer_fraction=0.25, daemon_hot_watermark=0.5,
              daemon_lag_tokens=LAG)
    pid = a.daemon.workers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        slots = torch.arange(PS, 7 * PS)  # 6 pages (jobs of 4 + 2): 2 hot pages left
        write(a, slots, seed=6)
        a.seal_request(slots, len(slots))
        assert a.step_boundary() == 0 and not a.sealed  # under the watermark, and nothing sealed here
        assert a.daemon.counters.sync_seals_backpressure == 0 and len(a.free_hot_pages) == 2
        assert len(a.daemon.inflight) == 2  # the budget lifted: both jobs sent at that boundary
        # 7 new pages, 2 free: the third finds none and the oldest job (4 pages) is sealed; the
        # seventh finds none again and the next job (2 pages) is
        more = torch.arange(7 * PS, 14 * PS)
        write(a, more, seed=7)
        assert len(a.sealed) == a.daemon.counters.sync_seals_backpressure == 6
        assert len(a.free_hot_pages) == 1 and not a.daemon.open_jobs()
        a.release_pages(list(range(7, 14)))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    deadline = time.time() + 120
    while a.daemon.inflight:  # the stopped worker's late results come back and are dropped
        a.step_boundary()
        assert time.time() < deadline
        time.sleep(0.02)
    # both jobs went to the stopped worker before they were sealed here: both results dropped
    assert a.daemon.counters.discarded_pages == 6 and a.daemon.counters.adopted_pages == 0
    kept = sum(n for k, n in a.stats()["bytes"].items() if k != "hot_buffer_capacity")
    assert kept == a.arena_bytes and len(a.free_hot_pages) == 8


def test_a_page_needed_before_its_result_arrives_is_sealed_here_and_the_result_dropped(pools):
    """The read rule does not wait for the daemon: when a request's next token reads compressed
    pages whose job is still with the workers (here: the only worker stopped), seal_request takes
    the job back and seals it on this thread (counted: sync_seals_needed), the bytes the inline
    pool (the same window) seals there, read alike; the late result is dropped, never installed."""
    a, b = pools("process", daemon_lag_tokens=LAG), pools("off", hot_tokens=LAG)
    pid = a.daemon.workers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        slots = torch.arange(PS, 5 * PS)  # pages 1..4: one basis block, one job
        for p in (a, b):
            write(p, slots, seed=3)
            p.seal_request(slots, len(slots))
        assert sorted(a.pending) == [1, 2, 3, 4] and not a.sealed and not b.sealed
        a.step_boundary()
        assert len(a.daemon.inflight) == 1  # sent to the stopped worker
        n = 4 * PS + LAG  # the request grows: its token at n reads pages 1..4 compressed
        full = torch.arange(PS, PS + n + 1)
        for p in (a, b):
            write(p, full[len(slots):], seed=4)
            p.seal_request(full[:n], n)
        assert a.daemon.counters.sync_seals_needed == 4 and a.daemon.counters.adopted_pages == 0
        assert not any(p in a.pending for p in range(1, 5)) and not a.kept_hot
        assert a.request_view(0, full)[0] == b.request_view(0, full)[0] == [1, 2, 3, 4]
        assert all(torch.equal(x, y) for x, y in zip(attend(a, full, 5), attend(b, full, 5)))
        same_pages(a, b)
        sealed = dict(a.sealed)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    deadline = time.time() + 120
    while a.daemon.counters.discarded_pages < 4:  # the late result comes back and is dropped
        a.step_boundary()
        assert time.time() < deadline, a.daemon.stats()
        time.sleep(0.02)
    assert a.daemon.counters.discarded_pages == 4
    assert all(a.sealed[p] is sealed[p] for p in range(1, 5))


def test_sealing_out_of_request_order_is_logged_and_counted(pools, caplog):
    """Backpressure seals the first installable open job; were none installable (a bookkeeping
    fault: here a job made to wait on a page no job will seal), the oldest is sealed anyway,
    logged and counted, not silently."""
    a = pools("process", pages=32, hot_buffer_fraction=0.25, daemon_hot_watermark=0.5,
              daemon_lag_tokens=LAG)
    pid = a.daemon.workers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)  # jobs stay open
    try:
        slots = torch.arange(PS, 5 * PS)  # 4 pages: one job
        write(a, slots, seed=11)
        a.seal_request(slots, len(slots))
        job, = a.daemon.open_jobs()
        assert a.next_to_seal([job]) is job and a.daemon.counters.out_of_order_seals == 0
        a.pending[31] = job  # page 31: pending, never sealed by anyone
        job.needs.append(31)
        with caplog.at_level("ERROR"):
            assert a._relieve(a.num_hot_pages) == 4
        assert a.daemon.counters.out_of_order_seals == 4 and "sealing it anyway" in caplog.text
        assert a.stats()["daemon"]["out_of_order_seals"] == 4
        del a.pending[31]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("daemon", ["off", "process"])
def test_a_request_whose_prefix_pages_were_swapped_reads_a_sealed_prefix_again(pools, daemon):
    """SGLang's cache_unfinished_req swaps a running request's own prefix pages for the radix
    tree's copies of the same tokens and frees its own: pages behind them may be sealed (or, with
    the daemon, submitted waiting on a page now freed) while the tree's copies are hot or
    pending. The next read seals the pages before them on the scheduler thread (counted) instead
    of failing the batch (seen in the CPU server stress test). With the daemon its window (LAG)
    sends every page to the workers."""
    a = pools(daemon, pages=32, daemon_lag_tokens=LAG)
    stopped = None
    if daemon == "process":
        stopped = a.daemon.workers[0].proc.pid
        os.kill(stopped, signal.SIGSTOP)  # every job stays open until sealed here
    try:
        own = torch.arange(PS, 9 * PS)  # the request's own pages 1-8: two basis blocks
        write(a, own, seed=12)
        a.seal_request(own, len(own))
        tree = torch.arange(20 * PS, 24 * PS)  # the tree's copies of pages 1-4: pages 20-23
        write(a, tree, seed=13)
        if daemon == "process":
            a.seal_request(tree, len(tree))  # another request's: pending in the daemon
        a.release_pages([1, 2, 3, 4])  # the duplicates freed; the request now reads 20-23
        if daemon == "process":  # pages 5-8 waited on page 4, now freed: they may go in
            job = a.pending[5]
            assert a.installable(job)
            a.daemon.cancel(job)
            a._finish([job])
        assert all(p in a.sealed for p in range(5, 9))
        assert not any(p in a.sealed for p in range(20, 24))
        swapped = torch.cat([tree, own[4 * PS:]])
        pages, _, _, hot_start = a.request_view(0, swapped)
        # the repair seals 20-23 here; pages sealed before the read rule reads them compressed
        # keep their hot copy (the window, LAG, covers all 8): read dense, whoever sealed them
        assert all(p in a.sealed for p in range(20, 24))
        want = [20, 21, 22, 23, 5, 6, 7, 8] if daemon == "off" else []
        assert pages == want and hot_start == PS * len(want)
        assert (a.counters.prefix_repairs, a.counters.prefix_repair_pages) == (1, 4)
        assert a.request_view(1, swapped)[0] == pages and a.counters.prefix_repairs == 1
        a.release_pages(list(range(5, 9)) + list(range(20, 24)))
        assert a.arena_bytes == 0
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)


def test_a_later_basis_block_is_not_adopted_before_an_earlier_one(pools):
    """Block 1's job finishes first; it waits (readers need a request's sealed pages to be a
    prefix) and goes in at the first adoption point after block 0's. The adopted pages keep
    their hot copies until the read rule reads them compressed."""
    a = pools("process", daemon_workers=2, daemon_lag_tokens=LAG)
    for w in a.daemon.workers:  # both workers up, so the first job goes to worker 0
        deadline = time.time() + 120
        while float(a.daemon.channel.heartbeats[w.index]) <= w.spawned_at:
            assert time.time() < deadline
            time.sleep(0.1)
    pid = a.daemon.workers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)  # block 0's job stays unfinished, block 1's comes back
    try:
        slots = torch.arange(PS, 7 * PS)  # 6 pages: block 0 = 4 pages, block 1 = 2 pages
        pages = (slots[::PS] // PS).tolist()
        write(a, slots, seed=10)
        assert a.seal_request(slots, len(slots)) == 6 and not a.sealed
        deadline = time.time() + 60
        while not any(j.ready for j in a.daemon.open_jobs()):
            a.daemon.collect()
            assert time.time() < deadline
            time.sleep(0.02)
        a.step_boundary()
        assert not a.sealed  # block 1 waits for block 0: nothing installed yet
        assert len(a.daemon.open_jobs()) == 2
        os.kill(pid, signal.SIGCONT)
        deadline = time.time() + 120
        while a.daemon.open_jobs():
            a.step_boundary()
            k = a.sealed_prefix(pages)
            assert not any(p in a.sealed for p in pages[k:]), k  # a prefix at every step
            assert time.time() < deadline
            time.sleep(0.02)
        assert a.sealed_prefix(pages) == 6 and a.kept_hot == set(pages)
        assert a.daemon.counters.adopted_pages == 6 and a.counters.prefix_repairs == 0
        assert a.request_view(0, slots)[0] == []  # read dense: the rule's window
        n = 6 * PS + LAG  # the request grows: its token at n reads all 6 pages compressed
        full = torch.arange(PS, PS + n + 1)
        write(a, full[len(slots):], seed=11)
        a.seal_request(full[:n], n)
        assert a.request_view(0, full)[0] == pages and not a.kept_hot
        assert a.daemon.counters.sync_seals_needed == 0 and a.counters.early_sealed_reads == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("batch", [1, 3])
def test_random_steps_keep_every_requests_sealed_pages_a_prefix(pools, seed, batch):
    """Decode-like steps over requests that grow, share prefixes (as the radix tree shares
    pages), end or are aborted, with a small hot buffer and one worker, so deferred pages,
    batched installs (`batch` pages a boundary; 1: one job), backpressure seals and reused
    pages interleave: after every step each live request reads a prefix of sealed pages
    (request_view raises otherwise), and once everything is freed no byte or hot page is
    left."""
    rng = random.Random(seed)
    a = pools("process", pages=48, hot_buffer_fraction=0.6, daemon_hot_watermark=0.15,
              daemon_boundary_share=0.0, daemon_install_batch=batch)
    deadline = time.time() + 120
    while float(a.daemon.channel.heartbeats[0]) <= a.daemon.workers[0].spawned_at:
        assert time.time() < deadline  # the worker is up: results can come back between steps
        time.sleep(0.1)
    free = list(range(47, 0, -1))  # logical pages; page 0 is never handed out
    refs: dict[int, int] = {}
    live: list[dict] = []  # {"pages": [...], "tokens": n}

    def take() -> int:
        page = free.pop()
        refs[page] = 1
        return page

    def drop(req):
        gone = []
        for page in req["pages"]:
            refs[page] -= 1
            if not refs[page]:
                gone.append(page)
                del refs[page]
        a.release_pages(gone)
        free.extend(gone)
        live.remove(req)

    def slots_of(req):
        return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in req["pages"]])[:req["tokens"]]

    for step in range(60):
        if len(live) < 3 and len(free) > 10:
            req = {"pages": [], "tokens": 0}
            donor = rng.choice(live) if live and rng.random() < 0.5 else None
            if donor is not None and donor["tokens"] >= 2 * PS:  # share its first full pages
                shared = rng.randrange(1, donor["tokens"] // PS)
                req["pages"], req["tokens"] = donor["pages"][:shared], shared * PS
                for page in req["pages"]:
                    refs[page] += 1
            live.append(req)
        for req in list(live):
            grow = rng.choice([1, 7, PS // 2, PS, 3 * PS])
            if len(free) < 6 + grow // PS:
                drop(req)  # out of pages: this request ends
                continue
            start = req["tokens"]
            req["tokens"] += grow
            while len(req["pages"]) * PS < req["tokens"]:
                req["pages"].append(take())
            write(a, slots_of(req)[start:], seed=seed * 1000 + step)
            a.seal_request(slots_of(req), req["tokens"])
        if live and rng.random() < 0.15:
            drop(rng.choice(live))  # aborted mid-run
        a.step_boundary()
        # the client's ready set is exactly its open jobs that are ready (adopt reads only it)
        assert set(a.daemon.ready) == {j.id for j in a.daemon.open_jobs() if j.ready}, repro(seed)
        for req in live:
            a.request_view(0, slots_of(req))
        time.sleep(0.03)  # a step's time: some results come back, others are still sealing
    for req in list(live):
        drop(req)
    settle(a)
    assert a.arena_bytes == 0 and len(a.free_hot_pages) == a.num_hot_pages, repro(seed)
    assert not a.sealed and not a.pending, repro(seed)


# --------------------------------------------------------------------------- TP agreement


def test_a_broken_daemon_on_another_rank_makes_this_rank_seal_inline(pools, monkeypatch):
    """What step_boundary() does when agree_state reports a broken daemon elsewhere (tested above)."""
    a = pools("process", daemon_lag_tokens=LAG)
    slots = torch.arange(PS, 5 * PS)
    write(a, slots, seed=8)
    assert a.seal_request(slots, len(slots)) == 4 and not a.sealed
    monkeypatch.setattr(boundary_mod, "agree_state", lambda jobs, broken, group: True)
    a.step_boundary()
    assert a.daemon.broken and len(a.sealed) == 4 and not a.daemon.open_jobs()
    more = torch.arange(5 * PS, 7 * PS)
    write(a, more, seed=9)
    a.seal_request(torch.cat([slots, more]), 7 * PS)  # sealed here, nothing submitted
    assert len(a.sealed) == 6 and a.daemon.counters.submitted_pages == 4
    assert a.daemon.counters.sync_seals_fallback >= 2


# --------------------------------------------------------------------------- swap log

