"""The recompression daemon without a server: shared-memory results, worker seals identical to
the synchronous path, the swap (hot until adopted, then exactly the final segments), frees while
in flight, a killed or hung worker, backpressure, and the TP agreement over gloo."""
import contextlib
import gc
import os
import random
import signal
import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from mosaickv_sglang.codec.attention import decode_attention
from conftest import repro
from mosaickv_sglang.codec.arena import HDR
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.daemon import boundary as boundary_mod
from mosaickv_sglang.daemon.boundary import agree, agree_state
from mosaickv_sglang.daemon.channel import ResultTooLarge, dump, load
from mosaickv_sglang.serving.pool import MosaicKVPool
from mosaickv_sglang.serving.segment_store import SegmentStore

PS, H, D, LAYERS = 128, 2, 64, 2
BLOCK = 4 * PS  # 4 pages per basis block: a request of 6 pages spans two blocks


@pytest.fixture(autouse=True)
def one_thread():
    """Workers run 1 intra-op thread; the same here makes sync and daemon seals bitwise equal
    (GEMM reduction order depends on the thread count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_pool(daemon="process", pages=24, **cfg) -> MosaicKVPool:
    # basis_inherit_below_tokens 0: the daemon fits every block it opens (inheriting the
    # previous block's bases applies with the daemon off), so the inline pools these tests
    # compare its pages with must fit too. The chunk read rule (the default when these were
    # written: pages read hot until adopted) unless a test sets read_rule
    config = MosaicConfig(hot_tokens=0, basis_block_tokens=BLOCK, daemon=daemon,
                          daemon_queue_segments=8,
                          **{"hot_buffer_fraction": 1.0, "daemon_workers": 1,
                             "basis_inherit_below_tokens": 0, "read_rule": "chunk",
                             "basis_fit": "group", **cfg})
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


def write(pool, slots, seed):
    g = torch.Generator().manual_seed(seed)
    for layer_id in range(LAYERS):
        k = torch.randn(len(slots), H, D, generator=g)
        v = torch.randn(len(slots), H, D, generator=g)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots, k, v)


def settle(pool, timeout=120.0):
    """Adopt until nothing is pending (what the scheduler loop does every iteration)."""
    deadline = time.time() + timeout
    while pool.pending or pool.daemon.open_jobs():
        pool.step_boundary()
        assert time.time() < deadline, pool.daemon.stats()
        time.sleep(0.02)


def same_pages(a: MosaicKVPool, b: MosaicKVPool):
    assert a.sealed.keys() == b.sealed.keys()
    for page in a.sealed:
        pa, pb = a.sealed[page], b.sealed[page]
        assert pa.position == pb.position and pa.nbytes == pb.nbytes
        for x, y in zip(pa.bases.k + pa.bases.v, pb.bases.k + pb.bases.v):
            assert torch.equal(x, y), page
        for sa, sb in zip(pa.segments, pb.segments):
            for ca, cb in ((sa.k, sb.k), (sa.v, sb.v)):
                assert ca.strategy.spec == cb.strategy.spec
                assert ca.encoded.tensors.keys() == cb.encoded.tensors.keys()
                for name in ca.encoded.tensors:
                    assert torch.equal(ca.encoded.tensors[name], cb.encoded.tensors[name]), name
            assert torch.equal(sa.header, sb.header)
    assert a.arena_bytes == b.arena_bytes


def attend(pool, slots, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2 * H, D, generator=g)
    cfg = pool.cfg
    return [decode_attention(q, pool.layer_view(layer, slots), torch.tensor([len(slots) - 1]),
                             cfg.select, cfg.page_tokens, sm_scale=D ** -0.5)[0]
            for layer in range(LAYERS)]


# --------------------------------------------------------------------------- channel

def test_result_round_trip_through_shared_memory(seed):
    from mosaickv_sglang.codec.seal import BasisPair, SealedPage

    region = torch.zeros(1 << 16, dtype=torch.uint8)
    bases = BasisPair([torch.randn(2, 4, 4).bfloat16()], [torch.randn(2, 4, 4).bfloat16()])
    obj = {"page": SealedPage(128, [], bases, 7), "t": torch.randn(3, 5),
           "b": torch.rand(7) > 0.5, "i": torch.arange(6, dtype=torch.int32).reshape(2, 3)[:, 1:]}
    off, n = dump(obj, region, {id(bases): "bases"})
    mine = BasisPair([], [])
    back = load(region, off, n, {"bases": mine})
    assert back["page"].bases is mine and back["page"].nbytes == 7
    for key in ("t", "b", "i"):
        assert back[key].dtype == obj[key].dtype and torch.equal(back[key], obj[key]), key
    # bases the worker fitted travel as their one [2L, H, D, D] tensor, back as views of it
    whole = BasisPair.of(torch.randn(6, 2, 4, 4).bfloat16())
    off, n = dump({"bases": whole}, region)
    back = load(region, off, n)["bases"]
    assert back.whole is not None and len(back.k) == len(back.v) == 3
    assert torch.equal(back.stacked(), whole.whole) and back.nbytes() == whole.nbytes()
    assert all(t.data_ptr() == back.whole[i].data_ptr() for i, t in enumerate(back.k + back.v))
    assert n < 1000  # one tensor reference pickled, not 6
    with pytest.raises(ResultTooLarge):
        dump(torch.zeros(1 << 15), torch.zeros(1 << 16, dtype=torch.uint8)[:1024])


def test_a_result_read_in_place_is_views_of_its_slot_wherever_the_slot_is(seed):
    """device=None: no copy; every tensor a view of the region (a slot deep in the shared
    block, not at its start: views count from the storage's start)."""
    block = torch.zeros(3 << 16, dtype=torch.uint8)
    region = block[(1 << 16) + 4096:]  # a slot's result region, 4096-aligned in the block
    obj = {"t": torch.randn(3, 5), "h": torch.randn(4, 2).half(),
           "i": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    off, n = dump(obj, region)
    back = load(region, off, n, device=None)
    lo, hi = region.data_ptr(), region.data_ptr() + off
    for key, t in obj.items():
        assert torch.equal(back[key], t), key
        assert lo <= back[key].data_ptr() < hi, key  # inside this slot's tensor bytes
    copied = load(region, off, n)  # the default: a copy, unaffected by the slot's reuse
    region[:off].zero_()
    assert torch.equal(copied["t"], obj["t"]) and not torch.equal(back["t"], obj["t"])


# --------------------------------------------------------------------------- swap

@pytest.mark.parametrize("in_place", [True, False])
def test_daemon_seals_equal_sync_seals_and_reads_switch_atomically(pools, monkeypatch, in_place):
    """in_place False: the store cannot read the slots (a CUDA host where the check fails):
    results are copied when read and their slots freed at once; the same pages either way."""
    if not in_place:
        monkeypatch.setattr(SegmentStore, "reads_host", lambda self, scratch: False)
    a, b = pools("process"), pools("off")
    assert a.daemon.in_place is in_place
    slots = torch.arange(PS, 8 * PS + 40)  # pages 1..7 full: two basis blocks; a partial page 8
    for p in (a, b):
        write(p, slots, seed=0)
    hot_out = attend(a, slots, seed=1)
    b.seal_request(slots[:3 * PS], 3 * PS)  # the same two seal points, synchronously
    assert b.seal_request(slots, len(slots)) == 4 and len(b.sealed) == 7
    assert a.seal_request(slots[:3 * PS], 3 * PS) == 3  # block 0's first group: bases fitted
    assert a.seal_request(slots, len(slots)) == 4  # rest of block 0 waits for those bases
    assert a.deferred and not a.sealed
    # until adoption every read is the hot (dense) data, bit for bit
    assert all(torch.equal(x, y) for x, y in zip(hot_out, attend(a, slots, seed=1)))
    settle(a)
    same_pages(a, b)  # deferred pages reused the daemon-fitted bases, like the sync path
    # after the swap, decode reads exactly the final compressed segments
    assert all(torch.equal(x, y) for x, y in zip(attend(a, slots, 1), attend(b, slots, 1)))
    st = a.stats()["daemon"]
    assert st["adopted_pages"] == 7 and st["submitted_pages"] == 7 and st["free_slots"] == 8
    assert st["sync_seals_backpressure"] == st["discarded_pages"] == st["restarts"] == 0
    assert st["swaps"]["pages"] == 7 and not a.swaps.pending  # every swap logged at a step


@pytest.mark.parametrize("copies", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="the kernels on a CPU pool need Triton's interpreter "
    "(CPU-only machines; on a GPU adopt_bench and the kernel tests cover them)"))])
def test_arena_ready_results_are_the_inline_seal_bytes_in_the_store(pools, seed, caplog, copies):
    """A page the worker sends arena-ready and the store adopts with one copy holds exactly the
    bytes the inline seal installs: arena block (padding included: both arenas start poisoned),
    header row (but its base), page metadata; its Segments and decode outputs are the same. The
    sink page here stays dense (no sink candidate): it takes the per-tensor path, counted and
    logged once. `copies` triton: the daemon pool's slot copies (`page_gather`) and adoptions
    (`row_copy`) run on the kernels (the interpreter here, as on CUDA by default)."""
    cfg = dict(k_error_budget=1.0, v_error_budget=1.0, sink_candidates=[])
    a, b = pools("process", pack_kernel=copies, **cfg), pools("off", **cfg)
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


def test_an_arena_ready_page_without_room_leaves_the_store_as_it_was(pools, seed):
    """`SegmentStore.adopt` takes all layers or none: with room for one page, a second adopt
    returns None and allocates nothing; `install_pages` of its own-byte Segments then counts
    every layer as arena_full; once the first page is released, the second adopts with the
    same bytes."""
    from mosaickv_sglang.codec.arena import pack_page

    b = pools("off", k_error_budget=1.0, v_error_budget=1.0)
    slots = torch.arange(PS, 3 * PS)
    write(b, slots, seed)
    b.seal_request(slots, len(slots))
    ap = pack_page(b.sealed[2], b.cfg.page_tokens)
    assert ap is not None, repro(seed)
    room = max(H * lay.head_bytes for lay in ap.layouts())
    store = SegmentStore(LAYERS, 4, H, D, PS, b.cfg.page_tokens, "cpu", 8, room)
    assert store.adopt(1, ap) is not None
    def state():
        return (list(store.top), [(a.free_bytes(), a.fits()) for a in store.allocators],
                dict(store.blocks))

    before = state()
    assert store.adopt(2, ap) is None
    assert state() == before and not store.packed[:, 2].any()
    segs = ap.segments()
    store.install_pages([2], [segs])
    assert store.arena_full == LAYERS and not store.packed[:, 2].any()
    for x, y in zip(segs, b.sealed[2].segments):
        for name, t in x.k.encoded.tensors.items():
            assert torch.equal(t, y.k.encoded.tensors[name]), name
    store.release(1)
    store.release(2)
    got = store.adopt(2, ap)
    assert got is not None and len(got) == LAYERS
    for layer in range(LAYERS):
        base, size = store.blocks[(layer, 2)]
        ref, _ = b.store.blocks[(layer, 2)]
        assert torch.equal(store.data[layer][base:base + size],
                           b.store.data[layer][ref:ref + size]), layer
        assert torch.equal(got[layer].v.encoded.tensors["codes4"],
                           b.sealed[2].segments[layer].v.encoded.tensors["codes4"])


def test_a_step_boundary_spreads_daemon_work_over_steps(pools):
    """With no share of the step to spend (daemon_boundary_share 0) every boundary runs one
    budgeted operation: a job's copy into slots or a job's install, never two; reading where
    finished pages lie (results read in place, as on a CPU) is not one, so the finished pages
    of both workers are read in one boundary; everything still arrives."""
    a = pools("process", daemon_workers=2, daemon_boundary_share=0.0)
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


def test_a_low_hot_buffer_lifts_the_boundary_budget(pools):
    """Within twice the watermark of free hot pages a boundary copies, reads and installs all it
    can even with no share to spend: spreading the work would bring an inline seal closer."""
    a = pools("process", daemon_workers=2, daemon_boundary_share=0.0, daemon_hot_watermark=0.45)
    for r in range(2):  # 6 of 25 hot pages taken: 19 free, watermark 12, so below 2 x 12
        slots = torch.arange((1 + 4 * r) * PS, (4 + 4 * r) * PS)
        write(a, slots, seed=r)
        a.seal_request(slots, len(slots))
    assert a.step_boundary() == 0 and not a.sealed  # nothing sealed inline: 19 >= 12 free
    assert len(a.daemon.inflight) == 2 and a.daemon.budget.ops == 2  # both jobs in one boundary
    assert a.daemon.stats()["boundary"]["unbounded_boundaries"] == 1
    deadline = time.time() + 120
    while a.daemon.counters.worker_pages < 6:  # read (still unbudgeted), nothing installed yet
        a.daemon.collect()
        assert time.time() < deadline
        time.sleep(0.02)
    assert a.step_boundary() == 6  # both ready jobs in one boundary, not one per boundary
    assert len(a.sealed) == 6 and a.daemon.counters.sync_seals_backpressure == 0


def test_results_read_in_place_hold_their_slots_until_installed_or_dropped(pools):
    """A result read in place stays in its slot until the install copied it out: the slots are
    held while the job is ready, and free again after the boundary that installed it; a ready
    job dropped instead (its page freed) lets its slots go too."""
    a = pools("process", daemon_install_batch=3)  # a job's 3 pages go at the next boundary
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
    a, b = pools("process", daemon_install_batch=8), pools("off")
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
    same_pages(a, b)


def test_freed_page_result_is_discarded_not_installed(pools):
    a = pools("process")
    slots = torch.arange(PS, 3 * PS)  # pages 1, 2
    write(a, slots, seed=2)
    a.seal_request(slots, len(slots))
    a.release_pages([2])  # request aborted while page 2 is in flight
    write(a, torch.arange(2 * PS, 3 * PS), seed=3)  # logical page 2 reused by another request
    settle(a)
    assert 1 in a.sealed and 2 not in a.sealed  # the stale result never entered the reused page
    assert a.daemon.counters.discarded_pages == 1 and a.hot_page_of[2] >= 0
    a.release_pages([1, 2])
    assert a.arena_bytes == 0 and len(a.free_hot_pages) == a.num_hot_pages


def test_killed_worker_is_restarted_and_nothing_is_lost(pools):
    a, b = pools("process"), pools("off")
    slots = torch.arange(PS, 9 * PS)  # 8 pages, two blocks
    for p in (a, b):
        write(p, slots, seed=4)
        p.seal_request(slots, len(slots))
    settle_deadline = time.time() + 60
    while not a.daemon.inflight and time.time() < settle_deadline:  # sent to the worker
        a.step_boundary()
    os.kill(a.daemon.workers[0].proc.pid, signal.SIGKILL)
    settle(a)
    same_pages(a, b)
    st = a.daemon.stats()
    assert st["restarts"] == 1 and st["resubmitted_pages"] >= 1 and not st["broken"]


def test_health_checks_look_at_one_worker_at_a_time(pools, monkeypatch):
    """check() runs at every boundary; it looks at one worker per CHECK_EVERY_S / workers, in
    turn (all at once cost one boundary ~0.2 ms with 12 workers on the H200 host)."""
    client = pools("process", daemon_workers=2).daemon
    seen = []
    monkeypatch.setattr(client, "_alive", lambda w: seen.append(w.index))
    for _ in range(4):
        client._checked = float("-inf")  # as if the interval had passed
        client.check()
    client.check()  # at once again: too soon
    assert seen == [0, 1, 0, 1]


@pytest.mark.parametrize("nice", [19, 5])
def test_workers_run_at_the_configured_niceness(pools, nice):
    """Workers take only idle cores: their niceness is the scheduler's plus daemon_nice (clamped
    at 19 by the OS)."""
    pool = pools("process", daemon_nice=nice)
    pid = pool.daemon.workers[0].proc.pid
    want = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    deadline = time.time() + 60
    while os.getpriority(os.PRIO_PROCESS, pid) != want and time.time() < deadline:
        time.sleep(0.05)  # the worker renices itself on start-up
    assert os.getpriority(os.PRIO_PROCESS, pid) == want


def test_daemon_start_freezes_the_start_up_heap(pools):
    """Step-boundary unpickles must not make full collections walk the start-up heap."""
    gc.unfreeze()
    pools("process")
    assert gc.get_freeze_count() > 0


def test_hung_worker_is_detected_by_heartbeat(pools):
    a, b = pools("process", daemon_timeout_s=1.0), pools("off")
    slots = torch.arange(PS, 3 * PS)
    deadline = time.time() + 120
    while float(a.daemon.channel.heartbeats[0]) <= a.daemon.workers[0].spawned_at:
        assert time.time() < deadline  # wait until the worker is up (it beats)
        time.sleep(0.1)
    pid = a.daemon.workers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        for p in (a, b):
            write(p, slots, seed=5)
            p.seal_request(slots, len(slots))
        settle(a)
    finally:
        with contextlib.suppress(ProcessLookupError):  # normally already killed by the client
            os.kill(pid, signal.SIGKILL)
    same_pages(a, b)
    assert a.daemon.counters.restarts == 1


def test_backpressure_seals_oldest_pages_inline_when_hot_buffer_runs_low(pools):
    # 8 hot pages, a watermark of half of them, and the only worker stopped (daemon saturated)
    a = pools("process", pages=32, hot_buffer_fraction=0.25, daemon_hot_watermark=0.5)
    pid = a.daemon.workers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        slots = torch.arange(PS, 7 * PS)  # 6 pages (jobs of 4 + 2): 2 hot pages left
        write(a, slots, seed=6)
        a.seal_request(slots, len(slots))
        assert a.step_boundary() == 0  # nothing came back, but the oldest job was sealed here
        assert len(a.sealed) == a.daemon.counters.sync_seals_backpressure == 4
        assert len(a.free_hot_pages) == 6
        # a forward's first-layer write that finds no free hot page seals the next job inline
        # (before any attention of that forward) instead of failing the batch
        more = torch.arange(7 * PS, 14 * PS)  # 7 new pages, 6 free
        write(a, more, seed=7)
        assert len(a.sealed) == a.daemon.counters.sync_seals_backpressure == 6
        a.release_pages(list(range(7, 14)))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    deadline = time.time() + 120
    while a.daemon.inflight:  # the stopped worker's late results come back and are dropped
        a.step_boundary()
        assert time.time() < deadline
        time.sleep(0.02)
    # the first job was sealed inline before any boundary copied it out (nothing to discard); the
    # second went to the stopped worker at that boundary and its late result is dropped
    assert a.daemon.counters.discarded_pages == 2 and a.daemon.counters.adopted_pages == 0
    kept = sum(n for k, n in a.stats()["bytes"].items() if k != "hot_buffer_capacity")
    assert kept == a.arena_bytes and len(a.free_hot_pages) == 8


def test_sealing_out_of_request_order_is_logged_and_counted(pools, caplog):
    """Backpressure seals the first installable open job; were none installable (a bookkeeping
    fault: here a job made to wait on a page no job will seal), the oldest is sealed anyway,
    logged and counted, not silently."""
    a = pools("process", pages=32, hot_buffer_fraction=0.25, daemon_hot_watermark=0.5)
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
    of failing the batch (seen in the CPU server stress test)."""
    a = pools(daemon, pages=32)
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
        assert pages == [20, 21, 22, 23, 5, 6, 7, 8] and hot_start == len(swapped)
        assert (a.counters.prefix_repairs, a.counters.prefix_repair_pages) == (1, 4)
        assert a.request_view(1, swapped)[0] == pages and a.counters.prefix_repairs == 1
        a.release_pages(list(range(5, 9)) + list(range(20, 24)))
        assert a.arena_bytes == 0
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)


def test_a_later_basis_block_is_not_adopted_before_an_earlier_one(pools):
    """Block 1's job finishes first; it waits (readers need sealed pages to be a prefix) and goes
    in at the first adoption point after block 0's."""
    a = pools("process", daemon_workers=2)
    for w in a.daemon.workers:  # both workers up, so the first job goes to worker 0
        deadline = time.time() + 120
        while float(a.daemon.channel.heartbeats[w.index]) <= w.spawned_at:
            assert time.time() < deadline
            time.sleep(0.1)
    pid = a.daemon.workers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)  # block 0's job stays unfinished, block 1's comes back
    try:
        slots = torch.arange(PS, 7 * PS)  # 6 pages: block 0 = 4 pages, block 1 = 2 pages
        write(a, slots, seed=10)
        assert a.seal_request(slots, len(slots)) == 6
        deadline = time.time() + 60
        while not any(j.ready for j in a.daemon.open_jobs()):
            a.daemon.collect()
            assert time.time() < deadline
            time.sleep(0.02)
        a.step_boundary()
        assert a.request_view(0, slots)[0] == []  # block 1 waits for block 0: nothing sealed yet
        assert len(a.daemon.open_jobs()) == 2
        os.kill(pid, signal.SIGCONT)
        deadline = time.time() + 120
        while a.daemon.open_jobs():
            a.step_boundary()
            pages, *_ = a.request_view(0, slots)  # a prefix at every step (else this raises)
            assert time.time() < deadline
            time.sleep(0.02)
        assert a.request_view(0, slots)[0] == (slots[::PS] // PS).tolist()
        assert a.daemon.counters.adopted_pages == 6
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


def test_install_batches_wait_for_pages_or_age_and_keep_request_order():
    """`install_batch` (no daemon needed): nothing until the installable ready jobs hold
    `pages` pages (or more than that is ready) or the oldest waited `pages` boundaries, then up
    to `pages` pages (the first job always); a job whose earlier pages are in an earlier job of
    the batch goes with it, one whose earlier pages are not ready stays; with the hot buffer
    low (None) all installable go."""
    from mosaickv_sglang.daemon.boundary import install_batch

    def job(i, pages, needs=(), agreed_at=0):
        return SimpleNamespace(id=i, pages=pages, needs=list(needs), agreed_at=agreed_at)

    pending = {1, 2, 3, 4, 5, 9}  # pages on their way; page 9's job is not ready

    class Pool:
        @staticmethod
        def installable(j, with_pages=()):
            return all(p not in pending or p in with_pages for p in j.needs)

    a, b = job(0, [1]), job(1, [2], needs=[1])  # b's earlier page is a's
    c, d = job(2, [3], needs=[9]), job(3, [4, 5], agreed_at=3)
    names = lambda got: [j.id for j in got]  # noqa: E731
    assert install_batch(Pool, [a], boundary=2, pages=3) == []  # 1 page, waited 2 < 3
    assert names(install_batch(Pool, [a], boundary=3, pages=3)) == [0]  # waited 3: due
    assert names(install_batch(Pool, [b, a], boundary=1, pages=2)) == [0, 1]  # order: a then b
    # d does not fit the cap of 3: due now
    assert names(install_batch(Pool, [a, b, c, d], boundary=1, pages=3)) == [0, 1]
    assert names(install_batch(Pool, [a, b, c, d], boundary=1, pages=4)) == [0, 1, 3]
    assert names(install_batch(Pool, [d], boundary=3, pages=1)) == [3]  # the first job always
    assert names(install_batch(Pool, [a, b, c, d], boundary=0, pages=None)) == [0, 1, 3]
    assert install_batch(Pool, [c], boundary=99, pages=2) == []  # never ahead of page 9


# --------------------------------------------------------------------------- TP agreement

def _client_with_ready(flags):
    """A stand-in client: open jobs 0.. and those of `flags` ready (the client's own ready set)."""
    jobs = [SimpleNamespace(id=i) for i in range(len(flags))]
    ready = {job.id: job for job, ok in zip(jobs, flags) if ok}
    return jobs, SimpleNamespace(ready=ready, ready_jobs=lambda: [ready[i] for i in sorted(ready)])


def _agree_rank(rank, init, ready, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    jobs, client = _client_with_ready(ready[rank])
    out[rank] = [job.id for job in agree(client, jobs, dist.group.WORLD)]
    dist.destroy_process_group()


def test_ranks_agree_on_the_ready_set(tmp_path):
    ready = [[True, True, False, True], [True, False, False, True]]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_agree_rank, args=(f"file://{tmp_path}/rdv", ready, out), nprocs=2)
        assert out[0] == out[1] == [0, 3]
    jobs, client = _client_with_ready([False, True, True])
    assert [job.id for job in agree(client, jobs)] == [1, 2]  # no group: the local decision


def _state_rank(rank, init, cases, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    results = []
    for jobs, broken in cases[rank]:
        jobs = [SimpleNamespace(pages=p, gens=g) for p, g in jobs]
        try:
            results.append(agree_state(jobs, broken, dist.group.WORLD))
        except RuntimeError as exc:
            results.append(str(exc)[:60])
    out[rank] = results
    dist.destroy_process_group()


def test_ranks_check_their_open_jobs_and_share_a_broken_daemon(tmp_path):
    jobs = [([3, 4], [0, 0]), ([9], [2])]
    cases = [[(jobs, False), (jobs, False), (jobs, False), (jobs, False)],
             [(jobs, False), (jobs, True),  # rank 1's daemon broke: both ranks learn it
              ([([3, 4], [0, 1]), ([9], [2])], False),  # a generation differs
              ([([3], [0]), ([4], [0]), ([9], [2])], False)]]  # same pages, other jobs
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_state_rank, args=(f"file://{tmp_path}/rdv", cases, out), nprocs=2)
        for rank in (0, 1):
            assert out[rank][:2] == [False, True]
            assert all(r.startswith("MosaicKV: tensor-parallel ranks hold different open")
                       for r in out[rank][2:]), out[rank]
    assert agree_state([], True) is True  # no group: the local state


def test_a_broken_daemon_on_another_rank_makes_this_rank_seal_inline(pools, monkeypatch):
    """What step_boundary() does when agree_state reports a broken daemon elsewhere (tested above)."""
    a = pools("process")
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

def test_swap_log_lines_compare_equal_only_when_ranks_swapped_the_same(caplog):
    from mosaickv_sglang.daemon.swaplog import SwapLog, compare

    def run(rank, pages_per_step):
        log = SwapLog()
        for pages in pages_per_step:
            for p in pages:
                log.add(p, 0)
            log.flush(rank)
        return log

    with caplog.at_level("INFO", logger="mosaickv_sglang.daemon.swaplog"):
        a = run(0, [[1, 2], [], [5]])
        b = run(1, [[2, 1], [], [5]])  # order inside a step does not matter
    assert a.stats() == {**b.stats()} and a.stats()["swap_lines"] == 2
    text = caplog.text
    assert compare(text)[0], compare(text)[1]
    caplog.clear()
    with caplog.at_level("INFO", logger="mosaickv_sglang.daemon.swaplog"):
        run(0, [[1, 2], [], [5]])
        run(1, [[1, 2], [5], []])  # the same pages, one step early
    ok, report = compare(caplog.text)
    assert not ok and "differs" in report
    ok, report = compare(text.replace("rank=1", "rank=0"))
    assert not ok and "expected 2 ranks" in report


# --------------------------------------------------------------------------- cold pages

COLD = {"enabled": True, "k_error_budget": 0.5, "v_error_budget": 0.5, "pages_per_step": 16}


def _shaped(pool, slots, seed):
    """K/V the default candidates seal as bands (uneven channel scales), so cold candidates
    have something to make smaller."""
    g = torch.Generator().manual_seed(seed)
    for layer_id in range(LAYERS):
        k = torch.randn(len(slots), H, D, generator=g) * (1 + torch.arange(D) % 7)
        v = torch.randn(len(slots), H, D, generator=g)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots, k, v)


@pytest.mark.parametrize("in_place", [True, False])
def test_cold_pages_recompressed_by_the_workers_equal_the_inline_ones(pools, monkeypatch,
                                                                      in_place):
    """With the daemon running, `recompress_cold` sends the cold pages to the workers as one
    cold job (the pages as the store holds them) instead of re-encoding them on the scheduler
    thread; at a later boundary each result replaces its page. The store then holds exactly
    what the inline path stores (segments, bytes, counters) and decode reads the same; a page
    freed while its job is out is dropped, its slot and bytes given back."""
    if not in_place:
        monkeypatch.setattr(SegmentStore, "reads_host", lambda self, scratch: False)
    a, b = pools("process", cold=COLD), pools("off", cold=COLD)
    slots = torch.arange(PS, 7 * PS)  # pages 1..6 full: page 1 the sink
    for p in (a, b):
        _shaped(p, slots, seed=3)
        p.seal_request(slots, len(slots))
    settle(a)
    same_pages(a, b)
    sent = a.recompress_cold(set())
    assert sent == 5 and len(a.daemon.open_jobs()) == 1 and a.daemon.open_jobs()[0].cold
    assert a.counters.cold_pages == 0  # nothing replaced on this thread
    assert b.recompress_cold(set()) == 5
    a.release_pages([6])  # freed while its cold job is out: its result is dropped
    b.release_pages([6])
    settle(a)
    same_pages(a, b)
    # b re-encoded page 6 before its free, a dropped it: 4 of 5 replaced there
    assert a.counters.cold_pages == 4 and b.counters.cold_pages == 5
    assert a.counters.cold_saved_bytes > 0
    assert a.sealed[2].segments[0].k.reason == "cold"
    st = a.daemon.counters
    assert st.cold_submitted_pages == 5 and st.discarded_pages == 1
    assert st.sync_seals_fallback == st.adopted_pages - 6 == 0  # 6: the sealing jobs' pages
    assert a.store.live_bytes == b.store.live_bytes == \
        sum(n for _, n in a.store.blocks.values())
    assert a.recompress_cold(set()) == 0 and not a.daemon.open_jobs()  # each page once
    assert all(torch.equal(x, y) for x, y in zip(attend(a, slots[:5 * PS], 1),
                                                 attend(b, slots[:5 * PS], 1)))
    assert len(a.daemon.free_slots) == a.daemon.channel.spec.slots


def test_a_cold_job_the_worker_fails_is_recompressed_here(pools, monkeypatch):
    """A worker error on a cold job: its pages are re-encoded on the scheduler thread (the
    inline path), not counted as sealing fallbacks."""
    a, b = pools("process", cold=COLD), pools("off", cold=COLD)
    slots = torch.arange(PS, 4 * PS)
    for p in (a, b):
        _shaped(p, slots, seed=4)
        p.seal_request(slots, len(slots))
    settle(a)
    a.recompress_cold(set())
    real = a.daemon._send

    def bad_send(j):  # the worker gets an input it cannot read
        if j.cold:
            j.inputs = [(0, 1)] * len(j.pages)
        real(j)
    monkeypatch.setattr(a.daemon, "_send", bad_send)
    b.recompress_cold(set())
    settle(a)
    same_pages(a, b)
    assert a.daemon.counters.worker_errors == 1 and a.counters.cold_pages == 2
    assert a.daemon.counters.sync_seals_fallback == 0
