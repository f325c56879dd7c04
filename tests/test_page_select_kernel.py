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
    sel = SelectionConfig(budget_tokens=128, sink_tokens=32, recent_tokens=32, meta_channels=8)
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
