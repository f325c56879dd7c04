"""`WriteTransformCache`: the write transforms (R^-1) of basis blocks still taking pages, kept
between seals. A decode step seals one page of each request's open block; without the cache
the block's bases are inverted again at every page. Checked on float32 CPU pools decoding
across page and block boundaries: each block inverted once while open (counted at the torch
op), the same pages sealed with the same bytes as with the cache off, a block's entry dropped
with its last page and freed with its bases, and a cache too small for a block inverting each
time (counted), never evicting another's."""

import gc

import pytest
import torch

from conftest import repro
from mosaickv_sglang.codec.seal import WriteTransformCache, fit_bases, write_transforms
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.pool import MosaicKVPool
from pool_utils import Inversions, assert_same_pages
from pool_utils import write_random as write

PS, H, D, LAYERS, HOT = 128, 2, 64, 3, 64
BLOCK = 4  # pages per basis block


def make_pool(**cfg) -> MosaicKVPool:
    config = MosaicConfig(**{"hot_tokens": HOT, "basis_block_tokens": BLOCK * PS, **cfg})
    return MosaicKVPool(40 * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=config)


def _decode(pools, seed, steps=range(0, 3 * PS, 8)):
    """Two requests decoding from inside their first block to past its end, every pool the
    same K/V; yields after each step (sealing batched as the backend's decode step does)."""
    lengths = (PS + HOT - 3, PS + HOT - 3)
    slots = [torch.arange(1 * PS, 1 * PS + 8 * PS), torch.arange(12 * PS, 12 * PS + 8 * PS)]
    for pool in pools:
        write(pool, torch.cat(slots), torch.Generator().manual_seed(seed))
    pages = [(s[::PS] // PS).numpy() for s in slots]
    for step in steps:
        positions = [n + step for n in lengths]
        for pool in pools:
            with pool.batched_seals():
                for i, pos in enumerate(positions):
                    pool.seal_request_pages(pages[i], pos, decode_step=True)
        yield [s[:p + 1] for s, p in zip(slots, positions)], step


def test_each_open_block_is_inverted_once_and_pages_match_the_cache_off(seed):
    """Two requests seal their first block's 4 pages one decode step at a time, then open the
    second block: per request the first block is inverted at its opening (the fit) and kept for
    its 3 later pages, dropped with its last, and the second block inverted at its opening.
    Every step seals the same pages to the same bytes as the same pool with the cache off."""
    cached, plain = make_pool(), make_pool(write_transform_cache_mb=0)
    seen_open = False
    for reqs, step in _decode([cached, plain], seed, steps=range(0, 5 * PS, 8)):
        assert_same_pages(plain, cached, reqs, seed, step, ordered=True)
        seen_open |= len(cached.write_cache) > 0
    assert seen_open and cached.counters.sealed_pages == 2 * (BLOCK + 1), \
        (cached.counters.sealed_pages, repro(seed))
    st = cached.write_cache.stats()
    assert st == {**st, "misses": 4, "hits": 2 * (BLOCK - 1), "uncached": 0, "blocks": 2}, \
        (st, repro(seed))
    off = plain.write_cache.stats()
    assert off["hits"] == 0 and off["blocks"] == 0 and off["uncached"] == off["misses"] > 4, off


def test_inversions_counted_per_step(seed):
    """At the torch op: the steps after a block's first seal invert nothing with the cache, a
    block's matrices at every seal step without it."""
    for mb, want_zero in ((1024, True), (0, False)):
        pool = make_pool(write_transform_cache_mb=mb)
        later = []
        gen = _decode([pool], seed, steps=range(0, 3 * PS, 8))
        first_block_done = False
        while True:
            before = pool.counters.sealed_pages
            with Inversions() as inv:
                try:
                    next(gen)
                except StopIteration:
                    break
            new = pool.counters.sealed_pages - before
            if first_block_done and new:
                later.append(inv.matrices)
            first_block_done |= pool.counters.sealed_pages > 0
        assert later, repro(seed)
        if want_zero:
            assert all(m == 0 for m in later), (later, repro(seed))
        else:
            assert all(m >= 2 * LAYERS * H for m in later), (later, repro(seed))


def test_entry_dropped_with_the_blocks_last_page_and_freed_with_its_bases(seed):
    pool = make_pool()
    for _ in _decode([pool], seed, steps=range(0, 5 * PS, 8)):
        pass
    # both requests sealed their whole first block (4 pages) and opened the second
    firsts = {int(p) for p, sp in pool.sealed.items() if sp.position == 0}
    assert len(firsts) == 2
    block0 = {id(pool.sealed[p].bases) for p in firsts}
    keys = set(pool.write_cache._entries)
    assert not (keys & block0), repro(seed)  # complete blocks: dropped
    assert pool.write_cache.bytes == sum(e[3] for e in pool.write_cache._entries.values())
    # a cache that holds bases no one else holds lets them go
    cache = WriteTransformCache(1 << 30)
    gen_ = torch.Generator().manual_seed(seed)
    k = torch.randn(1, LAYERS, H, PS, D, generator=gen_)
    bases = fit_bases(k, k.clone(), "host")
    got = cache.tables([bases])[0]
    want = write_transforms(bases)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(cache) == 1 and cache.bytes == 2 * want[0].numel() * 4
    del bases, got
    gc.collect()
    assert len(cache) == 0 and cache.bytes == 0


def test_a_block_that_does_not_fit_is_inverted_each_time_and_evicts_nothing(seed):
    gen = torch.Generator().manual_seed(seed)
    blocks = [fit_bases(k, k.clone(), "host") for k in
              (torch.randn(1, LAYERS, H, PS, D, generator=gen) for _ in range(3))]
    one = 2 * LAYERS * H * D * D * 4
    cache = WriteTransformCache(2 * one)  # room for two blocks
    first = cache.tables(blocks)
    assert len(cache) == 2 and cache.uncached == 1 and cache.misses == 3
    for b, (kt, vt) in zip(blocks, first):
        want = write_transforms(b)
        assert torch.equal(kt, want[0]) and torch.equal(vt, want[1]), repro(seed)
    cache.tables(blocks)
    assert cache.hits == 2 and cache.misses == 4 and cache.uncached == 2  # the third again
    assert len(cache) == 2 and cache.bytes == 2 * one


def test_config_rejects_a_negative_size():
    with pytest.raises(ValueError, match="write_transform_cache_mb"):
        MosaicConfig(write_transform_cache_mb=-1)
