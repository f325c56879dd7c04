"""GPU page selection (mosaickv_kernels.page_select) against codec.pages on fresh random inputs:
the Triton bounds vs page_upper_bound, and the page list vs select_pages' keep mask."""
from __future__ import annotations

import pytest
import torch

from mosaickv_kernels.page_select import (page_bounds, page_bounds_reference, pack_page_meta,
                                          select_page_list, select_page_list_reference)
from mosaickv_sglang.codec.pages import build_page_meta, select_pages

from conftest import assert_finite, assert_rel_close, repro

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_meta(nseg, h, d, seg=128, page=32, m=8):
    spectrum = torch.exp(-torch.linspace(0, 3, d)) * 3
    return pack_page_meta([build_page_meta(torch.randn(h, seg, d) * spectrum, page, m)
                           for _ in range(nseg)])


def test_bounds_match_reference_and_bound_scores(seed):
    torch.manual_seed(seed)
    h, g, d = 2, 3, 64
    meta = random_meta(7, h, d)
    counts = [3, 0, 4]  # request 1 has no sealed segment
    seg_indptr = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    seg_ids = torch.randperm(7).to(torch.int32)
    q = torch.randn(3, h, g, d)
    max_pages = max(counts) * 4 + 2  # padding past every request
    got = page_bounds(q.to(DEVICE), meta.to(DEVICE), seg_indptr.to(DEVICE), seg_ids.to(DEVICE),
                      max_pages).cpu()
    ref = page_bounds_reference(q, meta, seg_indptr, seg_ids, max_pages)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got)), repro(seed)
    assert fin.sum() == sum(counts) * 4 * h, repro(seed)
    assert_rel_close(got[fin], ref[fin], 1e-5, "page bounds", seed)


def test_the_reference_bound_is_the_codecs(seed):
    """page_bounds_reference (kernel side, no package import) == codec.pages.page_upper_bound."""
    from mosaickv_sglang.codec.pages import PageMeta, page_upper_bound

    torch.manual_seed(seed)
    h, g, d = 2, 3, 64
    meta = random_meta(3, h, d)
    q = torch.randn(1, h, g, d)
    ref = page_bounds_reference(q, meta, torch.tensor([0, 3], dtype=torch.int32),
                                torch.arange(3, dtype=torch.int32), 12)
    want = torch.cat([page_upper_bound(PageMeta(meta.channels[s].to(torch.uint8), meta.lo[s],
                                                meta.hi[s], meta.rest_norm[s]), q[0]).amax(1)
                      for s in range(3)], -1)
    assert torch.equal(ref[0], want), repro(seed)


def test_page_list_matches_select_pages(seed):
    torch.manual_seed(seed)
    bsz, h, g, p = 3, 2, 4, 40
    bounds = torch.randn(bsz, h, g, p)
    num = torch.tensor([40, 9, 23])
    budget, sink, recent = 12, 2, 3
    flat = bounds.amax(2)
    flat = flat.masked_fill(torch.arange(p)[None, None, :] >= num[:, None, None], float("-inf"))
    ids, counts = select_page_list(flat.to(DEVICE), num, budget, sink, recent)
    ids, counts = ids.cpu(), counts.cpu()
    for b in range(bsz):
        want = select_pages(bounds[b, :, :, :num[b]], 1, budget, sink, recent)  # [H, n]
        for hh in range(h):
            c = int(counts[b, hh])
            got = ids[b, hh, :c]
            assert torch.equal(got, want[hh].nonzero()[:, 0].to(torch.int32)), repro(seed)
            assert bool((ids[b, hh, c:] == p).all()), repro(seed)


@pytest.mark.parametrize("p,budget,sink,recent", [(300, 40, 2, 8), (64, 64, 2, 8), (5, 1, 4, 4)])
def test_top_pages_kernel_matches_torch_topk(p, budget, sink, recent, seed):
    torch.manual_seed(seed)
    bsz, h = 4, 3
    num = torch.randint(0, p + 1, (bsz,))
    num[0] = p
    bounds = torch.randn(bsz, h, p) * 10
    bounds = bounds.masked_fill(torch.arange(p) >= num[:, None, None], float("-inf"))
    ids, counts = select_page_list(bounds.to(DEVICE), num, budget, sink, recent)
    ref_ids, ref_counts = select_page_list_reference(bounds, num, budget, sink, recent)
    assert torch.equal(counts.cpu(), ref_counts), repro(seed)
    assert torch.equal(ids.cpu(), ref_ids), repro(seed)


@pytest.mark.parametrize("early_exit,warps,digits", [(True, None, False), (False, None, False),
                                                     (True, 8, False), (True, None, True),
                                                     (True, 8, True)])
@pytest.mark.parametrize("ties", [False, True])
def test_top_pages_plans_agree_with_torch_topk(early_exit, warps, digits, ties, seed):
    """Every plan of the top-k (radix steps by bit, stopped early or not, or by 8-bit digit;
    warps) keeps the reference's pages, with ties at the threshold (bounds on a coarse grid:
    lowest ids win)."""
    torch.manual_seed(seed)
    bsz, h, p = 3, 4, 700
    num = torch.tensor([p, 513, 37])
    bounds = torch.randn(bsz, h, p) * 10
    if ties:
        bounds = bounds.round() / 4  # ~80 distinct values over 700 pages
    bounds = bounds.masked_fill(torch.arange(p) >= num[:, None, None], float("-inf"))
    for budget in (1, 40, 200):
        ids, counts = select_page_list(bounds.to(DEVICE), num, budget, 2, 8, num_warps=warps,
                                       early_exit=early_exit, digits=digits)
        ref_ids, ref_counts = select_page_list_reference(bounds, num, budget, 2, 8)
        assert torch.equal(counts.cpu(), ref_counts), (budget, repro(seed))
        # the documented tie rule (torch.topk's order among equal bounds is another): forced
        # pages, then by bound, equal bounds by lowest id
        idx = torch.arange(p)
        score = torch.where(((idx < 2) | (idx >= num[:, None, None] - 8)) &
                            (idx < num[:, None, None]), torch.inf, bounds)
        order = score.sort(dim=-1, descending=True, stable=True).indices
        for b in range(bsz):
            for hh in range(h):
                c = int(ref_counts[b, hh])
                want = order[b, hh, :c].sort().values.to(torch.int32)
                assert torch.equal(ids[b, hh, :c].cpu(), want), (budget, b, hh, repro(seed))
                assert bool((ids[b, hh, c:] == p).all()), (budget, b, hh, repro(seed))


def test_selection_feeds_the_decode_kernel_shape(seed):
    """bounds of an empty batch and misuse raise or return -inf, never garbage."""
    torch.manual_seed(seed)
    meta = random_meta(1, 1, 64)
    q = torch.randn(1, 1, 1, 64)
    out = page_bounds(q.to(DEVICE), meta.to(DEVICE), torch.zeros(2, dtype=torch.int32,
                                                                  device=DEVICE),
                      torch.zeros(1, dtype=torch.int32, device=DEVICE), 0)
    assert bool(torch.isneginf(out).all())
    with pytest.raises(ValueError, match="float32"):
        page_bounds(q.double(), meta, torch.zeros(2, dtype=torch.int32), torch.zeros(1), 4)
    with pytest.raises(ValueError, match="budget_pages"):
        select_page_list(torch.zeros(1, 1, 4), torch.tensor([4]), 0, 0, 0)
    with pytest.raises(ValueError, match="differ"):
        pack_page_meta([build_page_meta(torch.randn(1, 64, 64), 32, 8),
                        build_page_meta(torch.randn(1, 128, 64), 32, 8)])
    assert_finite(meta.lo.float(), "meta", seed)


def test_wrapper_select_matches_reference_pipeline(seed):
    """compress_layer -> pack_layer + pack_page_meta -> wrapper.select -> wrapper.run: the same
    pages as the reference selector and the same output as decode_attention."""
    from mosaickv_kernels.band_decode import BandDecodeWrapper
    from mosaickv_sglang.codec.arena import pack_layer
    from mosaickv_sglang.codec.attention import decode_attention
    from mosaickv_sglang.codec.layer import compress_layer
    from mosaickv_sglang.config import MosaicConfig, SelectionConfig
    torch.manual_seed(seed)
    h, g, d = 2, 2, 64
    # wrapper.select is the first stage (the metadata bound) alone: the reference's second stage
    # off (the default rescores since 2026-12-07)
    sel = SelectionConfig(budget_tokens=128, sink_tokens=32, recent_tokens=32, meta_channels=8,
                          rescore_factor=0, rescore_channels=0)
    cfg = MosaicConfig(sink_candidates=["band:b8=64,b4=0,b2=0,group=32"], k_error_budget=10.0,
                       v_error_budget=10.0, sink_error_budget=10.0, select=sel)
    q = torch.randn(2, h * g, d) * 2
    layers, refs, keeps = [], [], []
    for b, t in enumerate((5 * 128 + 70, 3 * 128 + 100)):
        k = (torch.randn(h, t, d) * torch.exp(-torch.linspace(0, 2, d)) * 3).to(torch.bfloat16)
        layer = compress_layer(k, torch.randn(h, t, d).to(torch.bfloat16), cfg)
        out, info = decode_attention(q[b:b + 1], layer, torch.tensor([t - 1]), sel, 32)
        layers.append(layer)
        refs.append(out[0])
        keeps.append(info.page_keep[0])
    arena = pack_layer(layers).to(DEVICE)
    meta = pack_page_meta([s.pages for layer in layers for s in layer.segments]).to(DEVICE)
    wrapper = BandDecodeWrapper()
    wrapper.plan(arena, h * g, num_kv_splits=2)
    ids, counts = wrapper.select(q.to(DEVICE), arena, meta, budget_pages=4, sink_pages=1,
                                 recent_pages=1)
    for b, kp in enumerate(keeps):
        for hh in range(h):
            got = ids[b, hh, :int(counts[b, hh])].cpu().long()
            assert torch.equal(got, kp[hh].nonzero()[:, 0]), repro(seed)
    out = wrapper.run(q.to(DEVICE), arena, page_ids=ids, page_counts=counts)
    assert_rel_close(out.cpu(), torch.stack(refs), 2e-3, "select + decode", seed)


def test_row_selection_budget_spans_rows(seed):
    """Rows of one request share its budget: same pages as select_pages over the request's
    concatenated rows."""
    from mosaickv_kernels.page_select import RowSelection
    torch.manual_seed(seed)
    row_req, row_pages = [0, 0, 0, 1, 2, 2], [16, 16, 7, 5, 16, 12]
    h, g, pmax = 2, 3, 16
    bounds = torch.randn(len(row_req), h, g, pmax)
    budget, sink, recent = 9, 1, 2
    rs = RowSelection(row_req, row_pages, DEVICE)
    flat = bounds.amax(2)
    ids, counts = rs.select(flat.to(DEVICE), budget, sink, recent)
    ids, counts = ids.cpu(), counts.cpu()
    for b in range(3):
        rows = [r for r, x in enumerate(row_req) if x == b]
        cat = torch.cat([bounds[r, :, :, :row_pages[r]] for r in rows], -1)  # [H, G, P_req]
        want = select_pages(cat, 1, budget, sink, recent)  # [H, P_req]
        off = 0
        for r in rows:
            for hh in range(h):
                got = ids[r, hh, :int(counts[r, hh])]
                exp = want[hh, off:off + row_pages[r]].nonzero()[:, 0].to(torch.int32)
                assert torch.equal(got, exp), repro(seed)
            off += row_pages[r]
    with pytest.raises(ValueError, match="sorted"):
        RowSelection([1, 0], [3, 3], DEVICE)


def test_wrapper_select_over_rows_matches_row_selection(seed):
    """wrapper.select(rows=...) = page_bounds over the arena rows + RowSelection."""
    from mosaickv_kernels.band_decode import BandDecodeWrapper
    from mosaickv_kernels.page_select import RowSelection
    from mosaickv_sglang.codec.arena import pack_layer
    from test_band_decode_kernel import make_layer
    torch.manual_seed(seed)
    h, g, d = 2, 2, 64
    layers = [make_layer(h, d, 3, 10), make_layer(h, d, 2, 10, first=1), make_layer(h, d, 2, 4)]
    arena = pack_layer(layers).to(DEVICE)  # rows 0 and 1: one request; row 2: another
    meta = random_meta(7, h, d)
    meta = meta.to(DEVICE)
    q = torch.randn(3, h * g, d, device=DEVICE)
    wrapper = BandDecodeWrapper()
    wrapper.plan(arena, h * g)
    rows = RowSelection([0, 0, 1], [12, 8, 8], DEVICE)
    ids, counts = wrapper.select(q, arena, meta, budget_pages=6, sink_pages=1, recent_pages=1,
                                 rows=rows)
    q_rot = torch.matmul((q.float() * d ** -0.5).view(3, h, g, d), arena.k_basis).contiguous()
    bounds = page_bounds(q_rot, meta, arena.seg_indptr, arena.seg_ids, 12)
    want_ids, want_counts = rows.select(bounds, 6, 1, 1)
    assert torch.equal(counts, want_counts) and torch.equal(ids, want_ids), repro(seed)
    assert int(counts[0].sum() + counts[1].sum()) == 6 * h  # the budget spans rows 0 and 1


def test_rows_from_requests_matches_reference(seed):
    """The split of each request's kept pages into its rows: kernel == torch form."""
    from mosaickv_kernels.page_select import rows_from_requests, rows_from_requests_reference
    gen = torch.Generator().manual_seed(seed)
    h = 3
    row_req = [0, 0, 0, 1, 2, 2, 3]
    row_pages = [int(x) for x in torch.randint(1, 40, (len(row_req),), generator=gen)]
    lo, req_pages = [], [0] * 4
    for b, n in zip(row_req, row_pages):
        lo.append(req_pages[b])
        req_pages[b] += n
    k = 24
    ids = torch.full((4, h, k), max(req_pages), dtype=torch.int32)
    for b in range(4):
        for hh in range(h):
            take = min(req_pages[b], int(torch.randint(1, k + 1, (), generator=gen)))
            ids[b, hh, :take] = torch.randperm(req_pages[b], generator=gen)[:take].sort().values
    args = (ids.to(DEVICE), torch.tensor(row_req).to(DEVICE),
            torch.tensor(lo, dtype=torch.int32).to(DEVICE),
            (torch.tensor(lo) + torch.tensor(row_pages)).int().to(DEVICE), max(row_pages))
    got, want = rows_from_requests(*args), rows_from_requests_reference(*args)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), repro(seed)
    assert int(got[1].sum()) == int((ids < max(req_pages)).sum()), repro(seed)  # nothing lost


def test_row_selection_reads_bounds_in_place(seed):
    """page_bounds written into bounds_out() (as the wrapper does) selects what a copy does."""
    from mosaickv_kernels.page_select import RowSelection
    torch.manual_seed(seed)
    row_req, row_pages, h = [0, 0, 1], [16, 9, 12], 2
    bounds = torch.randn(3, h, 16, device=DEVICE)
    for r, n in enumerate(row_pages):
        bounds[r, :, n:] = float("-inf")
    copied = RowSelection(row_req, row_pages, DEVICE).select(bounds, 6, 1, 2)
    rs = RowSelection(row_req, row_pages, DEVICE)
    rs.bounds_out(h).copy_(bounds)
    in_place = rs.select(rs.bounds_out(h), 6, 1, 2)
    assert all(torch.equal(a, b) for a, b in zip(copied, in_place)), repro(seed)
