"""Pool sizing and the byte gate (serving/sizing.py): page byte bounds equal to the arena's real
blocks, the memory plan, and a gate that never lets an admitted page find the arena full."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import repro
from mosaickv_sglang.codec.arena import layout_of
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.pool import MosaicKVPool
from mosaickv_sglang.serving.sizing import (PageBytes, auto_hot_tokens, byte_deficit,
                                            plan_memory, slot_fraction)

PS, H, D, LAYERS = 128, 2, 64, 2


def test_page_bytes_are_the_arena_blocks_of_the_candidates():
    cfg = MosaicConfig()
    pb = PageBytes.of(cfg, 8, 128)
    blocks = [8 * layout_of(k, v, 128, 128).head_bytes
              for k in cfg.k_candidates for v in cfg.v_candidates]
    assert pb.best == min(blocks) and max(blocks) <= pb.worst
    sink = 8 * layout_of(cfg.sink_candidates[0], cfg.sink_candidates[0], 128, 128).head_bytes
    assert pb.worst == sink  # the 8-bit sink/rescue band is the largest layout
    assert pb.best < pb.expected < pb.worst and pb.dense == 2 * 8 * 128 * 128 * 2
    # the default K/V candidates keep 0.24-0.34 of bf16 in the arena
    assert 0.23 < pb.best / pb.dense < 0.25


def test_slot_fraction_and_plan_split_the_memory():
    cfg = MosaicConfig()
    pb = PageBytes.of(cfg, 8, 128)
    frac = slot_fraction(cfg, pb)
    assert 0.25 < frac < 0.3  # smallest layout + bases + tables: ~3.6x the dense slots
    slots, layers = 500_000 // PS * PS, 32
    hot = auto_hot_tokens(cfg, PS, 8192, 131072, window_tokens=64)
    assert hot == (8192 // PS + 1 + 64 * 2) * PS  # a chunk (+ window) and 64 requests' pages
    plan = plan_memory(cfg, pb, slots, layers, PS, hot)
    memory = int(slots * frac * pb.dense / PS * layers)
    assert plan.total <= memory and memory - plan.total < layers * 16 + 16
    assert plan.arena_bytes > 0 and plan.hot_bytes == (hot + PS) * pb.dense // PS * layers
    # a fixed fraction adds its share to every slot
    half = MosaicConfig(hot_buffer_fraction=0.5)
    assert slot_fraction(half, pb) == pytest.approx(frac + 0.5)


def test_plan_refuses_a_hot_buffer_that_leaves_no_arena():
    cfg = MosaicConfig()
    pb = PageBytes.of(cfg, 2, 64)
    with pytest.raises(ValueError, match="hot_buffer_requests"):
        plan_memory(cfg, pb, 4096, 2, PS, 4096)


def test_byte_deficit():
    fits = np.array([9, 4])  # layer 1 decides: 4 - 2 unsealed = 2 pages
    assert byte_deficit(free_slots=10 * PS, unsealed_pages=2, page_fits=fits,
                        page_size=PS) == 8 * PS
    assert byte_deficit(2 * PS, 2, fits, PS) == 0  # the bytes back every free slot
    assert byte_deficit(5 * PS, 7, fits, PS) == 5 * PS  # over-committed: none


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_allocator_merges_and_counts_what_fits(seed):
    """Random blocks of three sizes in and out: blocks never overlap or leave the arena, a
    block fits whenever `fits` promised one of the largest size, and freeing everything gives
    the whole arena back."""
    from mosaickv_sglang.serving.block_alloc import BlockAllocator

    rng = np.random.default_rng(seed)
    sizes, unit, cap = [48, 80, 128], 128, 128 * 40 + 32
    a = BlockAllocator(cap, unit)
    live = {}
    for step in range(2000):
        if live and (rng.random() < 0.45 or a.fits() == 0):
            base = list(live)[int(rng.integers(len(live)))]
            a.free(base, live.pop(base))
        else:
            promised = a.fits() > 0
            size = int(rng.choice(sizes))
            base = a.alloc(size)
            assert base is not None or not promised, f"{repro(seed)} step {step}"
            if base is not None:
                assert 0 <= base and base + size <= cap
                for b, n in live.items():
                    assert base + size <= b or b + n <= base, f"{repro(seed)} overlap"
                live[base] = size
        assert a.free_bytes() == cap - sum(live.values()), f"{repro(seed)} step {step}"
    for base in list(live):
        a.free(base, live.pop(base))
    assert a.top == 0 and a.free_bytes() == cap and a.fits() == cap // unit


def _write(pool, page, g):
    slots = torch.arange(page * PS, (page + 1) * PS)
    for layer_id in range(LAYERS):
        scale = torch.rand(1, generator=g) * 3 + 0.1
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots,
                           torch.randn(PS, H, D, generator=g) * scale,
                           torch.randn(PS, H, D, generator=g) * scale)


def _gated_pool(cfg: MosaicConfig, pages: int) -> MosaicKVPool:
    """`pages` slots of memory at the smallest layout, with a hot buffer of 8 pages carved out
    of it: the bytes, not the slots, run out first."""
    pb = PageBytes.of(cfg, H, D, 4)
    memory = int(pages * PS * slot_fraction(cfg, pb) * pb.dense / PS * LAYERS) + \
        9 * pb.dense * LAYERS
    return MosaicKVPool(pages * PS, PS, torch.float32, H, D, LAYERS, "cpu", False,
                        mosaic_config=cfg, hot_tokens=8 * PS, memory_bytes=memory)


@pytest.mark.parametrize("arena", ["shared", "per_layer"])
@pytest.mark.parametrize("seed", [0, 1])
def test_admitted_pages_always_fit_the_arena(seed, arena):
    """Admit only what the gate allows (requests of 1-4 pages, the first a sink page), seal,
    free some: the arena never fills (no segment left unpacked) and the gate does stop
    admission before the slots run out."""
    pages = 40
    pool = _gated_pool(MosaicConfig(hot_tokens=0, sink_segments=1, arena=arena), pages)
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    free = list(range(1, pages + 1))
    live_requests, gated = [], 0
    for step in range(60):
        deficit = pool.refresh_byte_gate(len(free) * PS)
        admit = len(free) - deficit // PS
        gated += admit < len(free)
        n = int(rng.integers(1, 5))
        if n <= admit:
            req = [free.pop(0) for _ in range(n)]
            for page in req:
                _write(pool, page, g)
            assert pool.seal_request_pages(req, n * PS) == n  # page 0: the sink layout
            live_requests.append(req)
        if live_requests and (rng.random() < 0.3 or admit < 1):
            req = live_requests.pop(int(rng.integers(len(live_requests))))
            pool.release_pages(req)
            free += req
        assert pool.store.arena_full == pool.store.over_capacity == 0, f"{repro(seed)} step {step}"
        st = pool.store
        assert (np.bincount(st.group_of, st.layer_live) <= st.group_layers * st.capacity).all(), \
            f"{repro(seed)} step {step}"
    assert gated > 0, repro(seed)  # the bytes, not the slots, limited admission
    cap = pool.capacity()
    assert cap["tokens_that_fit"] < pages * PS and cap["byte_limited"] >= 1


def _fill_until_gated(arena: str, seed: int):
    """Pages whose layer 0 is low-rank (the cheapest layout) and layer 1 noise (a costly one),
    one request growing a page at a time while the gate allows: (pages sealed, the store).
    (One request, so its pages share a block's bases: one-page requests would each hold a whole
    pair, and the bases past their reserve, which the gate also charges, would stop both
    arenas alike.)"""
    pages = 40
    pool = _gated_pool(MosaicConfig(hot_tokens=0, sink_segments=0, arena=arena), pages)
    g = torch.Generator().manual_seed(seed)
    # layer 0's K and V in one rank-2 subspace for the whole request (a block's bases, fitted
    # on its first page, then hold every later page's)
    proj = [torch.randn(2, D, generator=g) for _ in range(2)]
    sealed = 0
    for page in range(1, pages + 1):
        if pool.refresh_byte_gate((pages + 1 - page) * PS) >= (pages + 1 - page) * PS:
            break
        slots = torch.arange(page * PS, (page + 1) * PS)
        low = [torch.randn(PS, H, 2, generator=g) @ p for p in proj]
        for layer_id, (k, v) in enumerate([low, [torch.randn(PS, H, D, generator=g)
                                                 for _ in range(2)]]):
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), slots, k, v)
        assert pool.seal_request_pages(list(range(1, page + 1)), page * PS + 1) == 1
        sealed += 1
    return sealed, pool.store


@pytest.mark.parametrize("seed", [0, 1])
def test_a_shared_arena_takes_the_bytes_an_equal_share_per_layer_leaves_free(seed):
    """Layers that compress unequally: with a range per layer the costly layer's range fills
    and the gate stops admission while the cheap layer's range has bytes free; one range shared
    by both layers admits more pages from the same bytes, and every admitted page still got its
    blocks (nothing left outside the arena, no over-capacity)."""
    shared, st = _fill_until_gated("shared", seed)
    per_layer, pl = _fill_until_gated("per_layer", seed)
    assert st._data.numel() == pl._data.numel()  # the same bytes
    assert pl.layer_live[1] > pl.layer_live[0]  # the layers do compress unequally
    assert shared > per_layer, repro(seed)
    for store in (st, pl):
        assert store.arena_full == store.over_capacity == 0 and not store.outside_bytes.any()
    assert len(st.allocators) == 1 and len(pl.allocators) == LAYERS
