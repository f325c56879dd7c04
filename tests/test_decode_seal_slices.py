"""`decode_seal_layers` (pool.DecodeSeal): pages a decode step makes sealable are sealed a few
layers per step and installed after their last layer, under the chunk rule without the daemon.
Checked on a float32 CPU pool: the same bytes as sealing each page at once (bases, strategies,
decoded K/V), the block's bases fitted before its later pages start, nothing left in flight or
leaked when requests go away, hot-buffer pressure and finished requests finishing the pages in
flight, and the default (0) sealing at once as before. The pools set the chunk rule's keys
(preset `chunk_rule`): the default read rule is "position" since 2026-12-07."""

import pytest
import torch

from conftest import repro
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.pool import MosaicKVPool
from pool_utils import assert_same_pages as same_pages
from pool_utils import write_random as write

PS, H, D, LAYERS, HOT = 128, 2, 64, 4, 64


def make_pool(hot_pages: int | None = None, **cfg) -> MosaicKVPool:
    """A pool under the chunk rule (the `chunk_rule` preset: decode_seal_layers is its feature;
    the default read rule is "position" since 2026-12-07), unless `cfg` says otherwise."""
    config = MosaicConfig(**{"read_rule": "chunk", "basis_fit": "group", "hot_tokens": HOT,
                             **cfg})
    return MosaicKVPool(24 * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=config,
                        hot_tokens=None if hot_pages is None else hot_pages * PS)


def decode(pool, requests, positions) -> None:
    """The decode step's sealing as `_prepare_decode` runs it, once per step: each request
    (its page ids) at its position, then the pages in flight advanced."""
    for pages, pos in zip(requests, positions):
        pool.seal_request_pages(pages, pos, decode_step=True)
    if pool.decode_sealing:
        pool.advance_decode_seals()


@pytest.mark.parametrize("basis_fit", ["group", "first_page"])
@pytest.mark.parametrize("layers_per_step", [1, 3])
@pytest.mark.parametrize("lengths", [(200, 60), (200, 72)], ids=["apart", "together"])
def test_pages_sealed_in_slices_are_the_bytes_sealed_at_once(basis_fit, layers_per_step,
                                                              lengths, seed):
    """Two requests decoding past page boundaries (2-page basis blocks, so a block's first page
    is fitted in slices and its second reuses those bases), one of them with a prefix sealed at
    once by its prefill; every page equal to the all-at-once pool's, and equal at the end.
    "together": lengths equal modulo a page, so both requests' pages are in slices on the same
    steps and advance in one batch (`_seal_layers` over both seals)."""
    pools = [make_pool(basis_block_tokens=2 * PS, basis_fit=basis_fit,
                       decode_seal_layers=n) for n in (0, layers_per_step)]
    final = (lengths[0] + 520, lengths[1] + 500)
    slots = [torch.arange(1 * PS, 1 * PS + final[0]), torch.arange(10 * PS, 10 * PS + final[1])]
    for pool in pools:
        gen = torch.Generator().manual_seed(seed)
        for s in slots:
            write(pool, s, gen)
        pool.seal_request(slots[0][:lengths[0]], lengths[0])  # the prefill's seal, at once
    pages = [(s[::PS] // PS).numpy() for s in slots]
    steps_in_flight = together = 0
    for step in range(500):
        positions = [n + step for n in lengths]
        for pool in pools:
            decode(pool, pages, positions)
        a, b = pools
        steps_in_flight += bool(b.decode_sealing)
        together = max(together, len(b._decode_seals()))
        # pages in slices are read dense meanwhile: b's sealed pages are a's less those
        assert set(b.sealed) | set(b.decode_sealing) == set(a.sealed), (step, repro(seed))
        if not b.decode_sealing:
            same_pages(a, b, [s[:p + 1] for s, p in zip(slots, positions)], seed)
    a, b = pools
    # positions 699 and 559 read (699 - 64) // 128 = 4 and 3 pages compressed
    assert not b.decode_sealing and len(b.sealed) == 4 + 3, repro(seed)
    # each page took ceil(layers / n) steps (pages of both requests overlap in time or not)
    per_page = -(-LAYERS // layers_per_step)
    assert per_page <= steps_in_flight <= 6 * per_page, steps_in_flight
    if lengths[0] % PS == lengths[1] % PS:  # both requests' seals advanced in one batch
        assert together == 2, together
    st = b.stats()
    assert st["counters"]["decode_seal_slices"] == 6 * LAYERS  # 6 pages sealed by decode
    assert st["counters"]["decode_sealed_pages"] == 6 and st["decode_seal_pending_pages"] == 0
    assert st["counters"]["decode_seals_forced"] == 0
    assert a.stats()["counters"]["decode_seal_slices"] == 0  # 0: all at once, as before
    assert st["arena_bytes"] == a.stats()["arena_bytes"]


def test_a_block_s_later_page_waits_for_its_first_page_s_bases(seed):
    """A block's first page still in slices when the next page of its block becomes sealable:
    the later page (and the request's pages after it) start only once the bases exist."""
    a, b = (make_pool(basis_block_tokens=2 * PS, decode_seal_layers=n) for n in (0, 1))
    slots = torch.arange(PS, PS + 5 * PS)
    for pool in (a, b):
        write(pool, slots, torch.Generator().manual_seed(seed))
    pages = (slots[::PS] // PS).numpy()
    pool_pages = [pages]
    for pool in (a, b):
        decode(pool, pool_pages, [PS + HOT])  # page 0 of block 0
    assert list(b.decode_sealing) == [int(pages[0])] and not b.sealed
    for pool in (a, b):  # a jump: pages 1..3 sealable while page 0 is in its 2nd layer
        decode(pool, pool_pages, [4 * PS + HOT])
    # page 0 in flight still (2 of 4 layers): page 1 (same block) waits, and so do 2 and 3
    assert list(b.decode_sealing) == [int(pages[0])] and not b.sealed, repro(seed)
    for _ in range(2):
        decode(b, pool_pages, [4 * PS + HOT])
    assert list(b.sealed) == [int(pages[0])] and not b.decode_sealing  # installed after the step's
    decode(b, pool_pages, [4 * PS + HOT])  # seal calls: page 1 starts at the next step, 2, 3 too
    assert sorted(b.decode_sealing) == sorted(int(p) for p in pages[1:4])
    for _ in range(LAYERS - 1):
        decode(b, pool_pages, [4 * PS + HOT])
    # a sealed pages 1..3 in one call, as b did: the same groups, the same bytes
    same_pages(a, b, [slots[:4 * PS + HOT + 1]], seed)


def test_released_requests_leave_nothing_in_flight(seed):
    """A request freed mid-way (its pages in slices) and one cleared: no state left in flight,
    no hot page leaked, nothing sealed or counted as bytes."""
    pool = make_pool(decode_seal_layers=1)
    gen = torch.Generator().manual_seed(seed)
    slots = [torch.arange(PS, 4 * PS + 10), torch.arange(8 * PS, 11 * PS)]
    for s in slots:
        write(pool, s, gen)
    pages = [(s[::PS] // PS).numpy() for s in slots]
    decode(pool, pages, [2 * PS + HOT + 5, PS + HOT])
    assert len(pool.decode_sealing) == 3 and not pool.sealed  # 2 + 1 pages, 1 of 4 layers each
    pool.release_pages([int(p) for p in pages[0]])
    assert sorted(pool.decode_sealing) == [int(pages[1][0])]
    for _ in range(LAYERS - 1):
        decode(pool, pages[1:], [PS + HOT])
    assert not pool.decode_sealing and list(pool.sealed) == [int(pages[1][0])], repro(seed)
    pool.release_pages([int(p) for p in pages[1]])
    assert len(pool.free_hot_pages) == pool.num_hot_pages and pool.arena_bytes == 0
    # clear() with pages in flight
    for s in slots:
        write(pool, s, gen)
    decode(pool, pages, [2 * PS + HOT + 5, PS + HOT])
    assert pool.decode_sealing
    pool.clear()
    assert not pool.decode_sealing and len(pool.free_hot_pages) == pool.num_hot_pages
    assert pool.stats()["decode_seal_pending_pages"] == 0


def test_hot_pressure_finishes_the_pages_in_flight(seed):
    """Every hot page taken while a page is in slices: the next write's hot page comes from
    finishing that page at once (counted), never from failing the forward."""
    pool = make_pool(hot_pages=3, decode_seal_layers=1)
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(PS, PS + 4 * PS)
    write(pool, slots[:3 * PS], gen)  # three hot pages, all of them
    pages = (slots[::PS] // PS).numpy()
    decode(pool, [pages], [PS + HOT])
    assert list(pool.decode_sealing) == [int(pages[0])] and not pool.free_hot_pages
    write(pool, slots[3 * PS:3 * PS + 1], gen)  # a fourth page: no hot page free
    assert not pool.decode_sealing and int(pages[0]) in pool.sealed, repro(seed)
    assert pool.counters.decode_seals_forced == 1 and pool.counters.decode_sealed_pages == 1
    # the same bytes as sealing it at once
    ref = make_pool(hot_pages=3)
    write(ref, slots[:3 * PS], torch.Generator().manual_seed(seed))
    decode(ref, [pages], [PS + HOT])
    same_pages(ref, pool, [slots[:PS]], seed)


def test_a_finished_request_and_a_prefill_finish_the_pages_in_flight(seed):
    """`seal_finished` (before the radix insert) and any other seal_request reaching a page in
    slices seal its other layers now; the bytes are those of sealing it at once."""
    a, b = (make_pool(decode_seal_layers=n) for n in (0, 2))
    slots = torch.arange(PS, PS + 3 * PS + 20)
    for pool in (a, b):
        write(pool, slots, torch.Generator().manual_seed(seed))
    pages = (slots[::PS] // PS).numpy()
    for pool in (a, b):
        decode(pool, [pages], [2 * PS + HOT])  # pages 0, 1 sealable
    assert len(b.decode_sealing) == 2 and not b.sealed
    for pool in (a, b):
        pool.seal_finished(slots)  # every full page
    assert not b.decode_sealing and sorted(b.sealed) == sorted(int(p) for p in pages[:3])
    assert b.counters.decode_seals_forced == 2
    same_pages(a, b, [slots], seed)
    # a prefill's seal_request reaching pages in flight: the same
    r, c = (make_pool(decode_seal_layers=n) for n in (0, 1))
    for pool in (r, c):
        write(pool, slots, torch.Generator().manual_seed(seed))
        decode(pool, [pages], [2 * PS + HOT])
        pool.seal_request(slots[:2 * PS + HOT + 1], 2 * PS + HOT + 1)
    assert not c.decode_sealing and c.counters.decode_seals_forced == 2
    same_pages(r, c, [slots], seed)


def test_default_seals_at_once_and_other_rules_ignore_the_key(seed):
    """decode_seal_layers 0 (the default): a decode step seals its pages at once, nothing in
    flight. Under the position rule (and the daemon) the key is ignored: pages are sealed
    when read, as before."""
    pool = make_pool()
    slots = torch.arange(PS, PS + 2 * PS)
    write(pool, slots, torch.Generator().manual_seed(seed))
    decode(pool, [(slots[::PS] // PS).numpy()], [PS + HOT])
    assert list(pool.sealed) == [1] and not pool.decode_sealing
    assert pool.counters.decode_seal_slices == 0
    position = make_pool(read_rule="position", basis_fit="first_page", decode_seal_layers=2)
    assert position.decode_seal_layers == 0
    write(position, slots, torch.Generator().manual_seed(seed))
    decode(position, [(slots[::PS] // PS).numpy()], [PS + HOT])
    assert list(position.sealed) == [1] and not position.decode_sealing
