"""`MosaicKVPool.batched_seals`: a decode step's (or a prefill batch's) inline seals of every
request sealed in one batch (one gather, one chooser batch, one install) instead of one per
request and basis block. Checked on a float32 CPU pool against sealing request by request: the
same pages sealed at every step with the same bytes (bases, strategies, K/V as they read back),
entering `sealed` in the same order, with a shared prefix (two requests needing the same pages:
the queue is sealed before the second asks) and under both read rules; and an exception inside
the block leaves the queued pages hot and unsealed."""

import pytest
import torch

from conftest import repro
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.daemon.client import DaemonCounters
from mosaickv_sglang.serving.pool import MosaicKVPool
from pool_utils import assert_same_pages
from pool_utils import write_random as write

PS, H, D, LAYERS, HOT = 128, 2, 64, 3, 64


def make_pool(**cfg) -> MosaicKVPool:
    config = MosaicConfig(**{"hot_tokens": HOT, "basis_block_tokens": 2 * PS, **cfg})
    return MosaicKVPool(40 * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=config)


@pytest.mark.parametrize("cfg", [{}, {"basis_fit": "first_page"},
                                 {"read_rule": "position", "basis_fit": "first_page",
                                  "hot_tokens": 0}],
                         ids=["chunk-group", "chunk-first_page", "position"])
def test_a_step_sealed_in_one_batch_equals_request_by_request(cfg, seed):
    """Three requests decoding across page and block boundaries; request 2 shares request 0's
    first two pages (a radix-tree prefix), so both ask for them at the same step."""
    pools = [make_pool(**cfg) for _ in range(2)]
    lengths = (150, 22, 278)  # equal modulo a page: they cross page boundaries together
    final = [n + 420 for n in lengths]
    own = [torch.arange(1 * PS, 1 * PS + final[0]), torch.arange(12 * PS, 12 * PS + final[1])]
    shared = torch.cat([own[0][:2 * PS], torch.arange(24 * PS, 24 * PS + final[2] - 2 * PS)])
    slots = own + [shared]
    for pool in pools:
        gen = torch.Generator().manual_seed(seed)
        write(pool, torch.cat([own[0], own[1], shared[2 * PS:]]), gen)
    pages = [(s[::PS] // PS).numpy() for s in slots]
    a, b = pools
    for step in range(0, 420, 3):
        positions = [n + step for n in lengths]
        for i, pos in enumerate(positions):
            a.seal_request_pages(pages[i], pos, decode_step=True)
        with b.batched_seals():
            for i, pos in enumerate(positions):
                b.seal_request_pages(pages[i], pos, decode_step=True)
        assert_same_pages(a, b, [s[:p + 1] for s, p in zip(slots, positions)], seed, step,
                          ordered=True)
    want = {int(p) for i, pos in enumerate(positions) for p in pages[i][:a.compressed_pages(pos)]}
    assert set(b.sealed) == want and len(want) >= 7, (sorted(want), repro(seed))
    assert b.counters.seal_batches > 0 and b.counters.seal_batch_groups > b.counters.seal_batches
    assert b.counters.sealed_pages == a.counters.sealed_pages
    assert b._seal_queue is None and not b._queued


def test_an_exception_inside_the_block_leaves_the_queued_pages_hot(seed):
    pool = make_pool()
    slots = torch.arange(PS, PS + 3 * PS)
    write(pool, slots, torch.Generator().manual_seed(seed))
    pages = (slots[::PS] // PS).numpy()
    with pytest.raises(KeyError):
        with pool.batched_seals():
            pool.seal_request_pages(pages, 3 * PS - 1, decode_step=True)
            assert pool._queued and not pool.sealed  # queued, not sealed yet
            raise KeyError("a failing step")
    assert not pool.sealed and pool._seal_queue is None and not pool._queued
    assert (pool.hot_page_of[pages] >= 0).all()
    # the next step seals them as usual
    with pool.batched_seals():
        pool.seal_request_pages(pages, 3 * PS - 1, decode_step=True)
    assert len(pool.sealed) == 2, repro(seed)


def test_a_group_after_a_queued_block_start_gets_its_bases(seed):
    """Position rule with the daemon: a request's pages needed next step are sealed inline (and
    queued in `batched_seals`), the block's later pages go to the daemon with the bases the
    inline seal fits. The queue is sealed first, so the daemon job carries those bases (it
    would otherwise fit its own on a group that does not start the block)."""
    pool = make_pool(read_rule="position", basis_fit="first_page", hot_tokens=0,
                     basis_block_tokens=4 * PS)
    slots = torch.arange(PS, PS + 4 * PS)
    write(pool, slots, torch.Generator().manual_seed(seed))
    pages = (slots[::PS] // PS).numpy()
    jobs = []

    class Daemon:  # records what the pool submits; the pool takes it as a running daemon
        broken = False
        counters = DaemonCounters()

        def submit(self, pages, gens, positions, first, bases, needs):
            jobs.append((list(pages), bases))
            return len(jobs)

    pool.daemon = Daemon()
    pool.dense_window = PS  # as with daemon_lag_tokens 128
    with pool.batched_seals():
        # position 3 * PS: the first two pages are needed next step (inline, queued), the
        # third full page goes to the daemon
        pool.seal_request_pages(pages, 3 * PS, decode_step=True)
    assert sorted(pool.sealed) == pages[:2].tolist(), repro(seed)
    assert jobs and all(b is pool.sealed[int(pages[0])].bases for _, b in jobs), (jobs, repro(seed))
    # nothing was with the daemon yet: no page of it was sealed on this thread
    assert pool.daemon.counters.sync_seals_needed == 0, repro(seed)
