"""SegmentStore.install takes one layer's batch of segments with a few copies per layout: the
arena, headers, page metadata, block allocation (free lists, a full arena) and the re-pointed
segment tensors are what installing the same segments one at a time gives."""
import copy

import pytest
import torch

from conftest import repro
from mosaickv_sglang.codec.arena import BlockLayout
from mosaickv_sglang.codec.basis import fit_basis
from mosaickv_sglang.codec.layer import Candidates, seal_segments
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.segment_store import AdoptRows, SegmentStore

H, S, D, N = 2, 128, 64, 12


def _segments(seed):
    """N segments interleaving two band layouts and dense K (a zero error budget)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(N, H, S, D, generator=gen) * torch.logspace(0, -1, D)
    v = torch.randn(N, H, S, D, generator=gen)
    kb = torch.stack([fit_basis(x) for x in k])
    vb = torch.stack([fit_basis(x) for x in v])
    cfgs = [MosaicConfig(k_candidates=["band:b8=4,b4=44,b2=16,group=128"], k_error_budget=1.0),
            MosaicConfig(k_candidates=["band:b8=16,b4=48,b2=0,group=64"], k_error_budget=1.0),
            MosaicConfig(k_error_budget=0.0)]
    segs = [None] * N
    for c, cfg in enumerate(cfgs):
        idx = list(range(c, N, len(cfgs)))
        for i, seg in zip(idx, seal_segments(k[idx], v[idx], kb[idx], vb[idx], 0,
                                             [S * (i + 1) for i in idx], cfg,
                                             Candidates.from_config(cfg), False, True)):
            segs[i] = seg
    return segs


def _store(capacity):
    return SegmentStore(1, N + 1, H, D, S, 32, "cpu", 8, capacity)


def _same_store(a, b, seed):
    assert a.blocks == b.blocks and a.arena_full == b.arena_full, repro(seed)
    assert a.live_bytes == b.live_bytes and torch.equal(a.packed, b.packed)
    assert torch.equal(a.headers[0], b.headers[0]) and torch.equal(a.plans, b.plans)
    for name in ("channels", "lo", "hi", "rest_norm"):
        assert torch.equal(getattr(a.meta[0], name), getattr(b.meta[0], name)), name


def test_batch_install_equals_one_at_a_time(seed):
    segs = _segments(seed)
    want = copy.deepcopy(segs)  # the tensors before the store re-points them
    size = H * max(BlockLayout.of(s.k.strategy, s.v.strategy, S, D).head_bytes for s in segs
                   if s.k.strategy.name == "band")
    capacity = size * (N // 2)  # the arena fills up part-way through the batch
    a, b = _store(capacity), _store(capacity)
    one = copy.deepcopy(segs)
    pages = list(range(1, N + 1))
    stored = a.install(0, pages, segs)
    assert stored == [b.install(0, [p], [s])[0] for p, s in zip(pages, one)]
    assert any(stored) and not all(stored) and a.arena_full > 0
    _same_store(a, b, seed)
    for seg, ref, ok in zip(segs, want, stored):
        for got, exp in ((seg.k, ref.k), (seg.v, ref.v)):
            for name, t in got.encoded.tensors.items():
                assert torch.equal(t, exp.encoded.tensors[name]), f"{name} {repro(seed)}"
                in_arena = t.untyped_storage().data_ptr() == a.data[0].untyped_storage().data_ptr()
                assert in_arena == ok
        for ta, tb in zip(seg.pages.tensors().values(), ref.pages.tensors().values()):
            assert torch.equal(ta, tb)
    # freed blocks are reused, in the same order either way
    for page in pages[::3]:
        a.release(page)
        b.release(page)
    again = pages[::3]
    fresh, fresh_one = copy.deepcopy(want[:len(again)]), copy.deepcopy(want[:len(again)])
    stored = a.install(0, again, fresh)
    assert stored == [b.install(0, [p], [s])[0] for p, s in zip(again, fresh_one)]
    _same_store(a, b, seed)


def test_headers_of_a_batch_equal_header_per_base():
    segs = _segments(0)
    seg = next(s for s in segs if s.k.strategy.name == "band")
    lay = BlockLayout.of(seg.k.strategy, seg.v.strategy, S, D)
    bases = [0, 4096, 16 * 12345]
    assert torch.equal(lay.headers(bases, 3), torch.stack([lay.header(b, 3) for b in bases]))


def test_adopting_a_page_issues_as_many_tensor_writes_for_any_layer_count(seed):
    """An arena-ready page is adopted, and released, with a fixed number of writing tensor ops
    (one fused copy for all layers' blocks, one per table), not one per layer: each is a launch
    or a host-tensor write on the scheduler thread. Counted at 2 and 6 layers; views (slices,
    selects) are free. The packed flags are written through their numpy view (no tensor op), so
    a release issues none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mosaickv_sglang.codec.arena import pack_page
    from mosaickv_sglang.codec.seal import seal_group, worst_page_bytes
    from mosaickv_sglang.codec.strategies import parse_strategy

    views = {"slice", "select", "as_strided", "view", "detach", "alias", "lift_fresh", "unbind",
             "t", "transpose", "expand", "unsqueeze", "squeeze"}

    class Writes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in views:
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    cfg, dense = MosaicConfig(), parse_strategy("dense")
    g = torch.Generator().manual_seed(seed)
    counts, released = {}, {}
    for layers in (2, 6):
        kv = (torch.randn(layers, 2, H, cfg.segment_tokens, D, generator=g)
              * torch.logspace(0.5, -1, D)).bfloat16()
        page = seal_group(lambda idx: (kv[None, :, 0], kv[None, :, 1]), [cfg.segment_tokens], None,
                          cfg, Candidates.from_config(cfg), dense)[0]
        ap = pack_page(page, cfg.page_tokens)
        store = SegmentStore(layers, 2, H, D, cfg.segment_tokens, cfg.page_tokens, "cpu",
                             cfg.select.meta_channels, 2 * worst_page_bytes(cfg, H, D, dense))
        assert store.adopt(1, ap) is not None, repro(seed)  # first use: layout rows made here
        store.release(1)
        with Writes() as w:
            assert store.adopt(1, ap) is not None, repro(seed)
        counts[layers] = sorted(w.ops)
        assert store.packed[:, 1].all(), repro(seed)
        with Writes() as w:
            store.release(1)
        released[layers] = sorted(w.ops)
        assert not store.packed[:, 1].any() and not store.blocks, repro(seed)
        assert store.adopt(1, ap) is not None, repro(seed)
        for layer in range(layers):  # and it did write every layer's block
            base, size = store.blocks[(layer, 1)]
            off = sum(store.blocks[(lyr, 1)][1] for lyr in range(layer))
            assert torch.equal(store.data[layer][base:base + size], ap.blocks[off:off + size])
    assert counts[2] == counts[6], (counts, repro(seed))
    assert released[2] == released[6] == [], (released, repro(seed))
    assert counts[6].count("_foreach_copy_") == 2 and "copy_" in counts[6]


def test_adopting_by_kernel_refuses_what_it_cannot_read_by_address():
    """The kernel path (`AdoptRows`) reads an arena-ready page's tensors by address: a part that is
    not contiguous, or metadata whose rows do not fit the store's tables, is refused with the
    field named, and the store takes the page after that as the torch path does."""
    from dataclasses import replace

    from mosaickv_sglang.codec.arena import META_FIELDS, pack_page
    from mosaickv_sglang.codec.pages import PageMeta
    from mosaickv_sglang.codec.seal import seal_group, worst_page_bytes
    from mosaickv_sglang.codec.strategies import parse_strategy

    cfg, dense, layers = MosaicConfig(), parse_strategy("dense"), 2
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(layers, 2, H, cfg.segment_tokens, D, generator=g)
          * torch.logspace(0.5, -1, D)).bfloat16()
    page = seal_group(lambda idx: (kv[None, :, 0], kv[None, :, 1]), [cfg.segment_tokens], None,
                      cfg, Candidates.from_config(cfg), dense)[0]
    ap = pack_page(page, cfg.page_tokens)
    stores = {k: SegmentStore(layers, 2, H, D, cfg.segment_tokens, cfg.page_tokens, "cpu",
                              cfg.select.meta_channels, 2 * worst_page_bytes(cfg, H, D, dense),
                              pack_kernel=k) for k in ("torch", "triton")}
    meta = {f: getattr(ap.pages, f) for f in META_FIELDS}
    strided = replace(ap, pages=PageMeta(**{**meta, "lo": meta["lo"].transpose(-1, -2)}))
    with pytest.raises(ValueError, match="lo is on cpu .contiguous: False"):
        stores["triton"].adopt(1, strided)
    short = replace(ap, pages=PageMeta(**{**meta, "hi": meta["hi"][..., :-1].contiguous()}))
    with pytest.raises(ValueError, match="page metadata hi .* does not fit the table rows"):
        stores["triton"].adopt(1, short)
    for store in stores.values():
        store.clear()
        for _ in range(AdoptRows.RING + 1):  # around the ring of staging buffers
            assert store.adopt(1, ap) is not None
            store.release(1)
        assert store.adopt(1, ap) is not None
    a, b = stores.values()
    for layer in range(layers):
        (ba, size), (bb, _) = a.blocks[(layer, 1)], b.blocks[(layer, 1)]
        assert torch.equal(a.data[layer][ba:ba + size], b.data[layer][bb:bb + size])
        assert torch.equal(a.headers[layer][1], b.headers[layer][1])
        for f in META_FIELDS:
            assert torch.equal(getattr(a.meta[layer], f)[1], getattr(b.meta[layer], f)[1]), f


@pytest.mark.parametrize("seed", [0, 1])
def test_adopting_a_batch_by_kernel_equals_adopting_each_page_by_torch(seed, monkeypatch):
    """`adopt_pages` with the pack kernel writes a batch of different pages (more than one
    staging buffer holds) in ceil(n / PAGES) launches, and stores what the torch path stores
    page by page: blocks, headers, page metadata. A page no arena has room for is left out
    (None, its blocks given back) and the batch's other pages still land; a page outside the
    store's tables is refused before anything is written (the kernel writes by address)."""
    from mosaickv_sglang.serving import segment_store as store_mod
    from mosaickv_sglang.codec.arena import META_FIELDS, pack_page
    from mosaickv_sglang.codec.seal import seal_group, worst_page_bytes
    from mosaickv_sglang.codec.strategies import parse_strategy

    launches = []
    real = store_mod.copy_rows
    monkeypatch.setattr(store_mod, "copy_rows", lambda rows, n: (launches.append(len(rows)),
                                                                 real(rows, n)))
    cfg, dense, layers, n = MosaicConfig(), parse_strategy("dense"), 2, AdoptRows.PAGES + 3
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(n, layers, 2, H, cfg.segment_tokens, D, generator=g)
          * torch.logspace(0.5, -1, D)).bfloat16()
    sealed = seal_group(lambda idx: (kv[idx, :, 0], kv[idx, :, 1]),
                        [cfg.segment_tokens * i for i in range(n)], None, cfg,
                        Candidates.from_config(cfg), dense)
    aps = [pack_page(sp, cfg.page_tokens) for sp in sealed]
    room = sum(aps[i].blocks.numel() for i in range(n - 1))  # the last page does not fit
    stores = {k: SegmentStore(layers, n, H, D, cfg.segment_tokens, cfg.page_tokens, "cpu",
                              cfg.select.meta_channels, room // layers + 4096, pack_kernel=k)
              for k in ("torch", "triton")}
    ref, kern = stores["torch"], stores["triton"]
    with pytest.raises(IndexError, match=r"pages \[%d\] outside" % (n + 1)):
        kern.adopt_pages([1, n + 1], aps[:2])  # refused before anything is written
    assert not kern.blocks and kern.live_bytes == 0
    kern.prepare_adoption()
    launches.clear()
    pages = list(range(1, n + 1))
    got = kern.adopt_pages(pages, aps)
    want = [ref.adopt(p, ap) for p, ap in zip(pages, aps)]
    assert launches and len(launches) == -(-sum(x is not None for x in got) // AdoptRows.PAGES)
    assert [x is None for x in got] == [x is None for x in want], repro(seed)
    assert got[0] is not None and any(x is None for x in got), "the test's arena is mis-sized"
    assert kern.live_bytes == ref.live_bytes and kern.top == ref.top, repro(seed)
    for page, x in zip(pages, got):
        if x is None:
            assert not any(key[1] == page for key in kern.blocks), repro(seed)
            continue
        for layer in range(layers):
            (ba, size), (bb, _) = ref.blocks[(layer, page)], kern.blocks[(layer, page)]
            assert torch.equal(ref.data[layer][ba:ba + size], kern.data[layer][bb:bb + size])
            assert torch.equal(ref.headers[layer][page], kern.headers[layer][page]), repro(seed)
            for f in META_FIELDS:
                assert torch.equal(getattr(ref.meta[layer], f)[page],
                                   getattr(kern.meta[layer], f)[page]), (f, repro(seed))


def test_prepare_adoption_builds_the_staging_ring_and_runs_the_copy_kernel_once(monkeypatch):
    """The daemon's start prepares adoption (no Triton compile in the step of the first adopted
    page): with the pack kernel the staging ring exists afterwards and one real `copy_rows`
    launch ran (its scratch element copied); without it there is nothing to prepare."""
    from mosaickv_sglang.serving import segment_store as store_mod

    launches = []
    real = store_mod.copy_rows
    monkeypatch.setattr(store_mod, "copy_rows", lambda rows, n: (launches.append(n), real(rows, n)))
    cfg = MosaicConfig()
    stores = {k: SegmentStore(2, 2, H, D, cfg.segment_tokens, cfg.page_tokens, "cpu",
                              cfg.select.meta_channels, 1 << 20, pack_kernel=k)
              for k in ("torch", "triton")}
    for store in stores.values():
        store.prepare_adoption()
    assert stores["torch"]._adopt_rows is None
    assert isinstance(stores["triton"]._adopt_rows, AdoptRows) and launches == [1]
    stores["triton"].prepare_adoption()  # once only
    assert launches == [1]
    monkeypatch.setattr(store_mod, "copy_rows", lambda rows, n: None)  # a launch that does nothing
    fresh = SegmentStore(2, 2, H, D, cfg.segment_tokens, cfg.page_tokens, "cpu",
                         cfg.select.meta_channels, 1 << 20, pack_kernel="triton")
    with pytest.raises(RuntimeError, match="warm-up launch did not copy"):
        fresh.prepare_adoption()


def test_each_new_decode_width_class_is_logged_once(caplog, seed):
    """A layout whose band widths the decode kernel has not launched with yet makes the next
    decode step compile a variant (a stall on a GPU server): each such class is logged once, a
    layout of known widths is not."""
    import logging

    segs = _segments(seed)
    store = _store(1 << 24)
    with caplog.at_level(logging.INFO, logger="mosaickv_sglang.serving.segment_store"):
        store.install(0, list(range(N)), segs)
        store.install(0, list(range(N)), segs)  # the same layouts again: nothing new
    lines = [r.getMessage() for r in caplog.records if "adds decode width class" in r.getMessage()]
    assert len(lines) == len(store.width_classes) >= 2, (lines, repro(seed))
    assert len(set(lines)) == len(lines)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_layers_share_an_arena_as_far_as_an_int32_header_addresses(path, monkeypatch):
    """`shared`: consecutive layers share one byte range and one allocator, as many as a base16
    header reaches (here MAX_ARENA_BYTES is lowered so 5 layers make groups of 2, 2 and 1); each
    layer's view is its group's range. Adopted pages land in every layer's block of the right
    group (read back through the layer's view, by both write paths), and `page_fits` counts a
    page as one block per layer of a group."""
    from mosaickv_sglang.serving import segment_store as store_mod
    from mosaickv_sglang.codec.arena import pack_page
    from mosaickv_sglang.codec.seal import seal_group, worst_page_bytes
    from mosaickv_sglang.codec.strategies import parse_strategy

    cfg, dense, layers, n = MosaicConfig(), parse_strategy("dense"), 5, 3
    per = 2 * n * worst_page_bytes(cfg, H, D, dense) // 16 * 16
    monkeypatch.setattr(store_mod, "MAX_ARENA_BYTES", 2 * per + 16)
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(n, layers, 2, H, cfg.segment_tokens, D, generator=g)
          * torch.logspace(0.5, -1, D)).bfloat16()
    sealed = seal_group(lambda idx: (kv[idx, :, 0], kv[idx, :, 1]),
                        [cfg.segment_tokens * i for i in range(n)], None, cfg,
                        Candidates.from_config(cfg), dense)
    store = SegmentStore(layers, n + 1, H, D, cfg.segment_tokens, cfg.page_tokens, "cpu",
                         cfg.select.meta_channels, per, pack_kernel=path)
    assert store.group_of.tolist() == [0, 0, 1, 1, 2] and store.group_layers.tolist() == [2, 2, 1]
    assert store.data[1].data_ptr() == store.data[0].data_ptr() != store.data[2].data_ptr()
    assert store.data[2].numel() == 2 * per and store.data[4].numel() == per
    unit = store.allocators[0].unit
    assert store.page_fits().tolist() == [2 * per // unit // 2, 2 * per // unit // 2,
                                          per // unit]
    aps = [pack_page(sp, cfg.page_tokens) for sp in sealed]
    assert all(x is not None for x in store.adopt_pages(list(range(1, n + 1)), aps))
    for page, ap in zip(range(1, n + 1), aps):
        off = 0
        for layer in range(layers):
            base, size = store.blocks[(layer, page)]
            assert base + size <= store.data[layer].numel()
            assert torch.equal(store.data[layer][base:base + size], ap.blocks[off:off + size])
            off += size
    # the two layers of a group took their blocks from one range, side by side
    b0, b1 = store.blocks[(0, 1)], store.blocks[(1, 1)]
    assert b0[0] + b0[1] <= b1[0] or b1[0] + b1[1] <= b0[0]
