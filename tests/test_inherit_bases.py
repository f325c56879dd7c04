"""`basis_inherit_below_tokens`: a group of pages opening a basis block with fewer tokens than
that (a decode page starting a block, a prompt's short tail block) takes the request's previous
block's bases instead of a fit on those few pages. Checked on a float32 CPU pool: the pair
shares the previous block's tensors but is its own object (a request's rows are its blocks),
its bytes are counted once and given back when the last page using them goes, larger groups
and `0` still fit, the decode paths read such a request as one row per block, and the codec's
`compress_layer` gives a short tail block the previous block's bases the same way. A basis_fit
"group" feature: the configs here set the chunk rule's keys (preset `chunk_rule`), the default
being the position rule with first-page bases since 2026-12-07."""

import pytest
import torch

from conftest import repro
from mosaickv_sglang.codec.layer import compress_layer
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.packed_decode import _sealed_runs
from mosaickv_sglang.serving.pool import MosaicKVPool
from pool_utils import write_random as write

PS, H, D, LAYERS, HOT = 128, 2, 64, 2, 64
CHUNK_RULE = {"read_rule": "chunk", "basis_fit": "group"}  # what basis inheritance needs


def make_pool(**cfg) -> MosaicKVPool:
    config = MosaicConfig(**{**CHUNK_RULE, "hot_tokens": HOT, "basis_block_tokens": 2 * PS,
                             "basis_inherit_below_tokens": 2048, **cfg})
    return MosaicKVPool(24 * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=config)


def filled(seed: int, **cfg):
    pool = make_pool(**cfg)
    slots = torch.arange(PS, 7 * PS)  # logical pages 1..6: blocks (1, 2), (3, 4), (5, 6)
    write(pool, slots, torch.Generator().manual_seed(seed))
    return pool, (slots[::PS] // PS).numpy()


def bases_bytes(pool) -> int:
    return pool.arena_bytes - sum(sp.nbytes for sp in pool.sealed.values())


def test_a_decode_page_opening_a_block_takes_the_previous_blocks_bases(seed):
    pool, pages = filled(seed)
    pool.seal_request_pages(pages, 2 * PS + HOT)  # block 0 (two pages) in one group: fitted
    assert sorted(pool.sealed) == [1, 2] and pool.counters.inherited_bases == 0
    own = pool.sealed[1].bases
    one = bases_bytes(pool)
    assert one == own.nbytes() > 0
    pool.seal_request_pages(pages, 3 * PS + HOT, decode_step=True)  # page 3 opens block 1 alone
    got = pool.sealed[3].bases
    assert got is not own and got.whole is own.whole, repro(seed)
    assert torch.equal(got.stacked(), own.stacked())
    assert pool.counters.inherited_bases == 1
    assert bases_bytes(pool) == one, "shared bases counted twice"
    pool.seal_request_pages(pages, 4 * PS + HOT)  # page 4: the rest of block 1, same pair
    assert pool.sealed[4].bases is got and pool.counters.inherited_bases == 1
    # the decode paths read the request as one run (row) per block, each with its own pair
    n, runs, run_bases = _sealed_runs(pool, pages, 4 * PS + HOT + 1)
    assert n == 4 and [list(r) for r in runs] == [[1, 2], [3, 4]], runs
    assert run_bases[0] is own and run_bases[1] is got
    assert len(pool.basis_blocks([1, 2, 3, 4])[0]) == 2
    # freeing block 0 keeps the tensors counted (block 1 uses them); freeing all gives them back
    pool.release_pages([1, 2])
    assert bases_bytes(pool) == one
    pool.release_pages([3, 4])
    assert pool.arena_bytes == 0 and not pool._basis_refs


@pytest.mark.parametrize("cfg,fitted", [({"basis_inherit_below_tokens": 0}, True),
                                        ({"basis_inherit_below_tokens": PS}, True),
                                        ({"basis_inherit_below_tokens": PS + 1}, False),
                                        ({"basis_fit": "first_page"}, True)],
                         ids=["off", "at-threshold", "below-threshold", "first_page"])
def test_one_page_opening_a_block_by_the_threshold(cfg, fitted, seed):
    """Page 3 (128 tokens) opening block 1 alone: fitted unless below the threshold."""
    pool, pages = filled(seed, **cfg)
    pool.seal_request_pages(pages, 2 * PS + HOT)
    pool.seal_request_pages(pages, 3 * PS + HOT)
    shared = pool.sealed[3].bases.whole is pool.sealed[1].bases.whole
    assert shared != fitted and pool.counters.inherited_bases == (0 if fitted else 1), \
        repro(seed)
    assert bases_bytes(pool) == sum(pool.sealed[p].bases.nbytes() for p in ((1,) if shared
                                                                             else (1, 3)))


def test_a_whole_block_in_one_group_fits_its_own(seed):
    """Pages 3 and 4 (the whole block 1) in one group: fitted whatever the threshold."""
    pool, pages = filled(seed, basis_inherit_below_tokens=1 << 20)
    pool.seal_request_pages(pages, 2 * PS + HOT)
    pool.seal_request_pages(pages, 4 * PS + HOT)
    assert pool.sealed[3].bases.whole is not pool.sealed[1].bases.whole, repro(seed)
    assert pool.sealed[4].bases is pool.sealed[3].bases and pool.counters.inherited_bases == 0


def test_batched_and_one_by_one_inherit_alike(seed):
    """The previous block queued in the same `batched_seals` batch is sealed first, so the
    page opening the next block inherits exactly as sealed one request at a time."""
    a, pages = filled(seed)
    b, _ = filled(seed)
    a.seal_request_pages(pages, 3 * PS + HOT, decode_step=True)
    with b.batched_seals():
        b.seal_request_pages(pages, 3 * PS + HOT, decode_step=True)
    for pool in (a, b):
        assert sorted(pool.sealed) == [1, 2, 3] and pool.counters.inherited_bases == 1
        assert pool.sealed[3].bases.whole is pool.sealed[1].bases.whole
    for p in (1, 2, 3):
        assert torch.equal(a.sealed[p].bases.stacked(), b.sealed[p].bases.stacked())
        assert a.sealed[p].nbytes == b.sealed[p].nbytes and \
            a.sealed[p].kinds() == b.sealed[p].kinds(), (p, repro(seed))


def test_the_codecs_short_tail_block_reuses_the_previous_bases(seed):
    gen = torch.Generator().manual_seed(seed)
    t = 2 * 256 + 128 + HOT  # two whole 256-token blocks, a 128-token tail block, the hot tail
    k = torch.randn(H, t, D, generator=gen) * (1 + torch.arange(D) % 5)
    v = torch.randn(H, t, D, generator=gen)
    shared = compress_layer(k, v, MosaicConfig(**CHUNK_RULE, hot_tokens=HOT,
                                               basis_block_tokens=256,
                                               basis_inherit_below_tokens=2048))
    assert len(shared.k_bases) == 2, repro(seed)
    assert {s.basis for s in shared.segments if s.start >= 512} == {1}
    own = compress_layer(k, v, MosaicConfig(**CHUNK_RULE, hot_tokens=HOT,
                                            basis_block_tokens=256,
                                            basis_inherit_below_tokens=0))
    assert len(own.k_bases) == 3 and not torch.equal(own.k_bases[2], own.k_bases[1])
    assert {s.basis for s in own.segments if s.start >= 512} == {2}
