"""The decode graph's attention kernels (mosaickv_kernels.request_decode: queries, stage 1 over
each request's selected pages with per-row bases, stage 2) against their torch reference
`request_decode_reference`, on fresh random requests sealed by the serving pool with the default
layout candidates (a mix of layouts and several rows per request), with the GPU selection's page
lists, random page lists and no selection. Without CUDA the kernels run in Triton's interpreter.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import repro, write_requests
from mosaickv_sglang.config import MosaicConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PS, H, HQ, D, LAYERS = 128, 2, 4, 64, 2
CONTEXT = 1280  # 256-token blocks: W = 5 rows per request, 8 pages per row


def _graph(seed: int, lengths, bs: int, products: str = "exact", config: dict | None = None,
           **select):
    """A pool holding `lengths` requests (rows 1..) and a GraphDecode whose bucket `bs` has this
    step's tables prepared (requests past len(lengths) padded); `config`: more MosaicConfig
    fields."""
    from mosaickv_sglang.serving.graph_decode import GraphDecode
    from mosaickv_sglang.serving.pool import MosaicKVPool

    cfg = MosaicConfig(hot_tokens=0, basis_block_tokens=256, decode_kernel="triton",
                       graph_products=products,
                       select={"budget_tokens": 256, "sink_tokens": 32, "recent_tokens": 64,
                               **select}, **(config or {}))
    pool = MosaicKVPool(48 * PS, PS, torch.bfloat16, H, D, LAYERS, DEVICE, False,
                        mosaic_config=cfg)
    req_to_token = write_requests(pool, lengths, seed, DEVICE, width=CONTEXT).to(DEVICE)
    graph = GraphDecode(pool, CONTEXT, None)
    bk = graph.bucket_for(bs)
    n = len(lengths)
    idx = torch.tensor(list(range(1, n + 1)) + [0] * (bs - n), device=DEVICE)
    seq = torch.tensor(list(lengths) + [1] * (bs - n))
    fb = SimpleNamespace(batch_size=bs, req_pool_indices=idx, seq_lens=seq.to(DEVICE),
                         seq_lens_cpu=seq)
    graph.prepare(fb, req_to_token, n)
    graph.plan_bucket(bk, HQ, D ** -0.5)
    return graph, bk, pool


def _wholes(bk) -> list:
    """Each row's bases tensor, from the addresses the tables hold."""
    by_ptr = {t.data_ptr(): t for t in bk.keep}
    return [by_ptr.get(p) for p in bk.basis_ptrs.tolist()]


def _check(graph, bk, pool, q, local, seed, page_ids=None, page_counts=None):
    from mosaickv_kernels.request_decode import request_decode_reference

    dec, h = bk.decoder, pool.head_num
    q_rot, q_s = dec.queries(q, bk.basis_ptrs, local * h, bk.req_pages)
    out = torch.full((bk.bs, HQ, D), float("nan"), device=DEVICE)
    sel = {} if page_ids is None else dict(page_ids=page_ids, page_counts=page_counts)
    dec.run(q_rot, q_s, graph.tables(bk, local), bk.basis_ptrs, (pool.layer_num + local) * h,
            out, **sel)
    want = request_decode_reference(q, graph.tables(bk, local), _wholes(bk), local,
                                    pool.layer_num, graph.width, graph.row_pages, graph.pps,
                                    D ** -0.5, page_ids=page_ids, page_counts=page_counts,
                                    products=dec.products)
    got = out.cpu()
    assert torch.isfinite(got).all(), repro(seed)
    err = float((got - want).abs().max())
    # products from bf16 halves (~2^-16 relative each, `dot_exact` or the token gather's three
    # MMAs): ~2e-5 of the largest output measured; a wrong page, row basis or token moves it by
    # 1e-2 or more. Single bf16 MMAs ("bf16"): the reference rounds the same operands, the
    # softmax weights' rounding (2^-9 relative each, in p @ v) is what is left: 3e-4 to 7e-4 of
    # the largest output measured (CPU, 2026-12-07), against 5e-3 to 1.6e-2 for the exact
    # reference (the rounding is there: checked below)
    tol = 1e-4 if dec.products == "exact" else 2e-3
    assert err <= tol * float(want.abs().max()), (local, err, dec.products, repro(seed))
    if dec.products == "bf16":  # and the rounding is there: the exact reference differs
        exact = request_decode_reference(q, graph.tables(bk, local), _wholes(bk), local,
                                         pool.layer_num, graph.width, graph.row_pages,
                                         graph.pps, D ** -0.5, page_ids=page_ids,
                                         page_counts=page_counts)
        assert float((got - exact).abs().max()) > 1e-4 * float(exact.abs().max()), repro(seed)
    return got


@pytest.fixture(params=["pairs", "pairs-late-v", "pairs-bf16", "tokens", "tokens-bf16",
                        "channels"])
def gather(request, monkeypatch):
    """Each way stage 1 reads a page (`request_decode.GATHER`, the plan's default), V's loads
    with K's (`EARLY_V`, the default) or after the scores ("-late-v"); products exact
    (`graph_products`, the default) or single bf16 MMAs ("-bf16", `_products`)."""
    import mosaickv_kernels.request_decode as rd

    name = request.param.removesuffix("-late-v").removesuffix("-bf16")
    monkeypatch.setattr(rd, "GATHER", name)
    monkeypatch.setattr(rd, "EARLY_V", not request.param.endswith("-late-v"))
    return request.param


def _products(gather: str) -> str:
    return "bf16" if gather.endswith("-bf16") else "exact"


def test_selected_pages_match_the_reference(seed, gather):
    from mosaickv_kernels.page_select import page_bounds, select_page_list

    lengths = (700, 250, 1100)
    graph, bk, pool = _graph(seed, lengths, 4, _products(gather))
    assert bk.decoder.products == _products(gather)
    assert graph.width == 5 and graph.row_pages == 8
    assert bk.req_pages.tolist() == [20, 4, 32, 0]  # whole 128-token pages, in 32-token pages
    layouts = {int(pool.store.headers[0][p, 3]) for p in pool.sealed}
    assert len(layouts) > 1, ("one layout only: the mix is not exercised", repro(seed))
    before = int(bk.decoder.read)
    for local in range(LAYERS):
        q = torch.randn(bk.bs, HQ, D, device=DEVICE)
        dec = bk.decoder
        q_rot, _ = dec.queries(q, bk.basis_ptrs, local * H, bk.req_pages)
        bounds = page_bounds(q_rot, pool.store.meta[local], bk.seg_indptr, bk.seg_ids,
                             graph.row_pages, out=bk.bounds, rows_per_out=graph.width)
        ids, counts = select_page_list(bounds, bk.req_pages, graph.budget_pages,
                                       graph.sink_pages, graph.recent_pages)
        assert counts[2].tolist() == [graph.budget_pages] * H  # 32 pages > the budget's 8
        _check(graph, bk, pool, q, local, seed, ids, counts)
        before += int(counts.sum())
    assert int(dec.read) == before  # pages read, counted on the device


def test_random_page_lists_and_no_selection(seed, gather):
    lengths = (1100, 640)
    graph, bk, pool = _graph(seed, lengths, 3, _products(gather))
    n_pages = bk.req_pages.tolist()
    k = 24
    ids = torch.full((bk.bs, H, k), 10**6, dtype=torch.int32)
    counts = torch.zeros(bk.bs, H, dtype=torch.int32)
    for b in range(bk.bs):
        for hh in range(H):
            take = torch.randperm(n_pages[b])[:min(k, n_pages[b])].sort().values
            take = take[:int(torch.randint(0, take.numel() + 1, ()))]  # some lists empty
            ids[b, hh, :take.numel()] = take.to(torch.int32)
            counts[b, hh] = take.numel()
    _check(graph, bk, pool, torch.randn(bk.bs, HQ, D, device=DEVICE), 1, seed,
           ids.to(DEVICE), counts.to(DEVICE))
    # every page (the path without selection), q a strided view as the model hands it over
    qkv = torch.randn(bk.bs, (HQ + 2 * H) * D, device=DEVICE)
    q = qkv[:, :HQ * D].reshape(bk.bs, HQ, D)
    assert not q.is_contiguous()
    _check(graph, bk, pool, q, 0, seed)


def test_request_major_bounds_equal_the_row_bounds(seed):
    from mosaickv_kernels.page_select import page_bounds

    graph, bk, pool = _graph(seed, (700, 1100), 2)
    q_rot, _ = bk.decoder.queries(torch.randn(2, HQ, D, device=DEVICE), bk.basis_ptrs, 0,
                                  bk.req_pages)
    meta, w, p = pool.store.meta[0], graph.width, graph.row_pages
    rows = page_bounds(q_rot, meta, bk.seg_indptr, bk.seg_ids, p)  # [R, H, P]
    major = page_bounds(q_rot, meta, bk.seg_indptr, bk.seg_ids, p, rows_per_out=w)
    want = rows.view(2, w, H, p).permute(0, 2, 1, 3).reshape(2, H, w * p)
    assert torch.equal(major, want), repro(seed)
    assert (major[1] > float("-inf")).sum().item() == H * int(bk.req_pages[1])


def test_misuse_is_refused(seed):
    from mosaickv_kernels.request_decode import RequestDecode

    dec = RequestDecode()
    with pytest.raises(RuntimeError, match="plan"):
        dec.queries(torch.zeros(1, 4, 64), torch.zeros(1, dtype=torch.long), 0,
                    torch.zeros(1, dtype=torch.int32))
    kw = dict(batch=1, rows_per_request=1, row_pages=8, pages_per_seg=4, num_kv_heads=2,
              head_dim=64, max_selected=8, sm_scale=1.0, device="cpu")
    with pytest.raises(ValueError, match="group evenly"):
        dec.plan(num_qo_heads=3, **kw)
    with pytest.raises(ValueError, match="whole segments"):
        dec.plan(num_qo_heads=4, **{**kw, "row_pages": 6})
    with pytest.raises(ValueError, match="products='fp8' must be 'exact' or 'bf16'"):
        dec.plan(num_qo_heads=4, products="fp8", **kw)
    with pytest.raises(ValueError, match="products='bf16' is for the token gathers"):
        dec.plan(num_qo_heads=4, products="bf16", gather="channels", block_tokens=16, **kw)
    dec.plan(num_qo_heads=4, **kw)
    with pytest.raises(ValueError, match="q must be"):
        dec.queries(torch.zeros(1, 4, 32), torch.zeros(1, dtype=torch.long), 0,
                    torch.zeros(1, dtype=torch.int32))
