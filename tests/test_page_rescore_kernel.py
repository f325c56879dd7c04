"""The second selection stage's kernel (mosaickv_kernels.page_rescore) against its torch
reference on fresh random requests sealed by the serving pool with the default layout
candidates (a mix of layouts, several rows per request): candidate lists from the first stage
and random ones, leading channels and every channel. Without CUDA the kernel runs in Triton's
interpreter."""
from __future__ import annotations

import pytest
import torch

from conftest import repro
from mosaickv_kernels.page_rescore import LAYOUTS  # every layout on one pool (CI time)
from test_request_decode_kernel import DEVICE, D, H, HQ, LAYERS, _graph


def _scores(graph, bk, local, q, ids, counts, channels, layouts=LAYOUTS, variants=None):
    """Each of `layouts`' kernel scores (layout -> [B, H, P] on the CPU) and the reference's;
    `variants`: (layout, kwargs) of `page_rescore` also run, keyed (layout, sorted kwargs)."""
    from mosaickv_kernels.page_rescore import page_rescore, page_rescore_reference

    q_rot, _ = bk.decoder.queries(q, bk.basis_ptrs, local * H, bk.req_pages)
    t = graph.tables(bk, local)
    p = graph.width * graph.row_pages
    args = (t.data, t.headers, t.plans, t.seg_indptr, t.seg_ids, ids, counts)
    kw = dict(rows_per_owner=graph.width, row_pages=graph.row_pages, pages_per_seg=graph.pps,
              channels=channels)

    def run(layout, **extra):
        return page_rescore(q_rot, *args, **kw, layout=layout, **extra,
                            out=torch.full((bk.bs, H, p), float("nan"), device=DEVICE)).cpu()

    got = {layout: run(layout) for layout in layouts}
    for layout, extra in variants or ():
        got[(layout, tuple(sorted(extra.items())))] = run(layout, **extra)
    return got, page_rescore_reference(q_rot, *args, **kw, pages_out=p)


@pytest.mark.parametrize("channels", [32, D])
def test_candidates_scored_as_the_reference(seed, channels):
    from mosaickv_kernels.page_select import page_bounds, select_page_list

    graph, bk, pool = _graph(seed, (700, 250, 1100), 4)
    layouts = {int(pool.store.headers[0][p, 3]) for p in pool.sealed}
    assert len(layouts) > 1, ("one layout only: the mix is not exercised", repro(seed))
    for local in range(LAYERS):
        q = torch.randn(bk.bs, HQ, D, device=DEVICE)
        q_rot, _ = bk.decoder.queries(q, bk.basis_ptrs, local * H, bk.req_pages)
        bounds = page_bounds(q_rot, pool.store.meta[local], bk.seg_indptr, bk.seg_ids,
                             graph.row_pages, out=bk.bounds, rows_per_out=graph.width)
        ids, counts = select_page_list(bounds, bk.req_pages, 2 * graph.budget_pages,
                                       graph.sink_pages, graph.recent_pages)
        got, want = _scores(graph, bk, local, q, ids, counts, channels)
        listed = torch.zeros_like(want, dtype=torch.bool)
        for b in range(bk.bs):
            for hh in range(H):
                listed[b, hh, ids[b, hh, :int(counts[b, hh])].long().cpu()] = True
        assert int(listed.sum()) == int(counts.sum()) > 0
        for layout, g in got.items():
            # the rest: -inf, no NaN left
            assert torch.isneginf(g[~listed]).all(), (layout, repro(seed))
            err = (g[listed] - want[listed]).abs().max()
            # float32 products of the same dequantized values, summed in another order
            assert err <= 1e-4 * want[listed].abs().max(), (layout, local, float(err),
                                                             repro(seed))


def test_random_lists_and_empty_ones(seed):
    graph, bk, pool = _graph(seed, (1100, 640), 3)
    n_pages = bk.req_pages.tolist()
    k = 24
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((bk.bs, H, k), 10**6, dtype=torch.int32)
    counts = torch.zeros(bk.bs, H, dtype=torch.int32)
    for b in range(bk.bs):
        for hh in range(H):
            take = torch.randperm(n_pages[b], generator=gen)[:min(k, n_pages[b])].sort().values
            take = take[:int(torch.randint(0, take.numel() + 1, (), generator=gen))]
            ids[b, hh, :take.numel()] = take.to(torch.int32)
            counts[b, hh] = take.numel()
    q = torch.randn(bk.bs, HQ, D, device=DEVICE)
    # the per-candidate loads (no prefetch) and smaller program blocks: the same scores, bit
    # for bit (the same products in the same order per candidate; partial and empty blocks)
    variants = [(layout, extra) for layout in LAYOUTS
                for extra in ({"prefetch": False}, {"block": 4}, {"block": 2, "prefetch": False})]
    got, want = _scores(graph, bk, 1, q, ids.to(DEVICE), counts.to(DEVICE), 16,
                        variants=variants)
    fin = ~torch.isneginf(want)
    for layout, g in got.items():
        assert torch.equal(torch.isneginf(g), ~fin), (layout, repro(seed))
        assert (g[fin] - want[fin]).abs().max() <= 1e-4 * want[fin].abs().max(), \
            (layout, repro(seed))
        if not isinstance(layout, str):
            assert torch.equal(g, got[layout[0]]), (layout, repro(seed))


@pytest.mark.parametrize("channels", [16, 32])
def test_bands_cut_inside_a_code_byte(seed, channels):
    """K bands whose leading `channels` end inside a code byte (3 8-bit channels, then 4-bit
    and 2-bit ones: the band layout's masked last byte) score as the reference."""
    from mosaickv_sglang.config import MosaicConfig

    odd = ["band:b8=3,b4=42,b2=16,group=128", "band:b8=3,b4=10,b2=48,group=128"]
    graph, bk, pool = _graph(seed, (900, 400), 2, config={
        "k_candidates": odd, "k_error_budget": MosaicConfig().k_error_budget})
    n8 = {int(pool.store.headers[0][p, 4]) for p in pool.sealed}
    assert 3 in n8, ("no segment with 3 8-bit K channels", n8, repro(seed))
    n_pages = bk.req_pages.tolist()
    ids = torch.full((bk.bs, H, max(n_pages)), 10**6, dtype=torch.int32)
    counts = torch.zeros(bk.bs, H, dtype=torch.int32)
    for b in range(bk.bs):
        ids[b, :, :n_pages[b]] = torch.arange(n_pages[b], dtype=torch.int32)
        counts[b] = n_pages[b]
    q = torch.randn(bk.bs, HQ, D, device=DEVICE)
    got, want = _scores(graph, bk, 0, q, ids.to(DEVICE), counts.to(DEVICE), channels, ("bands",))
    fin = ~torch.isneginf(want)
    assert torch.equal(torch.isneginf(got["bands"]), ~fin), repro(seed)
    err = (got["bands"][fin] - want[fin]).abs().max()
    assert err <= 1e-4 * want[fin].abs().max(), (float(err), repro(seed))


def test_misuse_is_refused(seed):
    from mosaickv_kernels.page_rescore import page_rescore

    graph, bk, pool = _graph(seed, (700,), 1)
    q_rot, _ = bk.decoder.queries(torch.randn(1, HQ, D, device=DEVICE), bk.basis_ptrs, 0,
                                  bk.req_pages)
    t = graph.tables(bk, 0)
    ids = torch.zeros(1, H, 4, dtype=torch.int32, device=DEVICE)
    counts = torch.ones(1, H, dtype=torch.int32, device=DEVICE)
    out = torch.empty(1, H, 40, device=DEVICE)
    kw = dict(rows_per_owner=graph.width, row_pages=graph.row_pages, pages_per_seg=graph.pps)
    args = (t.data, t.headers, t.plans, t.seg_indptr, t.seg_ids)
    for channels in (8, 48, 2 * D):
        with pytest.raises(ValueError, match="channels"):
            page_rescore(q_rot, *args, ids, counts, **kw, channels=channels, out=out)
    with pytest.raises(ValueError, match="page_ids"):
        page_rescore(q_rot, *args, ids.long(), counts, **kw, channels=32, out=out)
    with pytest.raises(ValueError, match="q_rot"):
        page_rescore(q_rot[:, :1].contiguous(), *args, ids, counts, **kw, channels=32, out=out)
    with pytest.raises(ValueError, match="layout"):
        page_rescore(q_rot, *args, ids, counts, **kw, channels=32, out=out, layout="tiles")
    for block in (1, 3, 256):
        with pytest.raises(ValueError, match="block"):
            page_rescore(q_rot, *args, ids, counts, **kw, channels=32, out=out, block=block)


def test_the_configs_layouts_are_the_kernels():
    from mosaickv_sglang.config import RESCORE_LAYOUTS, MosaicConfig

    assert RESCORE_LAYOUTS == LAYOUTS
    for layout in LAYOUTS:
        MosaicConfig.parse(f'{{"select": {{"rescore_layout": "{layout}"}}}}')
    with pytest.raises(ValueError, match="rescore_layout"):
        MosaicConfig.parse('{"select": {"rescore_layout": "diagonal"}}')
