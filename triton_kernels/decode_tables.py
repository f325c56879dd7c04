"""The decode graph's per-step tables, built on the device in one launch.

A decode step with nothing for the host to do (no page to start, map or seal) still needs the
graph's tables rebuilt from the batch: each row's segment list (CSR over position-block rows),
each row's bases address, each request's compressed pages, hot length and hot-buffer rows.
`GraphDecode.device_tables` builds them with ~25 static-shaped torch ops (its torch reference:
tests/test_graph_decode.py checks both against the host plan); issued from Python they cost
1.5-2.2 ms of host time per step on the H200 (2026-12-05). This kernel is one program that walks
the batch's requests in order (the CSR offsets are a running sum over them), each request's
pages, rows and hot tokens as vectors: one launch.

    build_decode_tables(req_to_token, req_pool_indices, seq_lens, rows, sealed, basis_addr,
                        hot_page, out, page_size=128, width=W, block_pages=32,
                        pages_per_seg=4, available=counter, count_scale=H * layers,
                        window=0)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# Nothing specialized on values: the batch size and real rows change from step to step, and
# the tables are views of flat buffers at offsets that differ per captured batch size. With
# Triton's default (an int equal to 1 or divisible by 16, a pointer 16-byte aligned, each a
# variant of its own) the first device-planned step of each new combination compiled in a live
# step: a ~0.7 s stall on an H100 (2026-12-06). One variant per server, compiled at start-up
# (`compile_variant`); a single program walking the requests gains nothing from the hints.
_INTS = ["r2t_stride", "r2t_cols", "bs", "rows", "ps", "W", "block", "pps", "cap", "most",
         "count_scale", "window"]
_POINTERS = ["REQ_TO_TOKEN", "RPI", "SEQ_LENS", "SEALED", "BASIS_ADDR", "HOT_PAGE", "INDPTR",
             "SEG_IDS", "HOT_LENS", "REQ_PAGES", "PTRS", "HOT_ROWS", "AVAILABLE"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _decode_tables(
    REQ_TO_TOKEN, r2t_stride, r2t_cols,  # int32 [R, L]: each request's token slots
    RPI, SEQ_LENS,  # [bs] the batch's request rows and lengths (the first `rows` real)
    SEALED, BASIS_ADDR, HOT_PAGE,  # per logical page: bool, int64 (0: none), int64 (-1: none)
    INDPTR, SEG_IDS, HOT_LENS, REQ_PAGES, PTRS, HOT_ROWS,  # the bucket's tables (outputs)
    AVAILABLE,  # int64 [1]: += compressed pages x count_scale (the selection's denominator)
    bs, rows, ps, W, block, pps, cap, most, count_scale,
    window,  # the position rule's dense window (0: none; the chunk rule passes 0)
    BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
):
    offs_p = tl.arange(0, BLOCK_P)
    offs_w = tl.arange(0, BLOCK_W)
    offs_t = tl.arange(0, BLOCK_T)
    in_p = offs_p < most
    in_w = offs_w < W
    in_t = offs_t < cap
    tl.store(INDPTR, 0)
    prefix = tl.full([], 0, tl.int64)  # compressed pages of the requests before this one
    for b in range(bs):
        live = b < rows
        ln = tl.where(live, tl.load(SEQ_LENS + b).to(tl.int64), 0)
        row = REQ_TO_TOKEN + tl.load(RPI + b).to(tl.int64) * r2t_stride
        # the request's logical pages (0 where it owns none), the sealed prefix (chunk rule)
        owned = in_p & (offs_p < (ln + ps - 1) // ps)
        pages = tl.load(row + tl.minimum(offs_p * ps, r2t_cols - 1), mask=owned,
                        other=0).to(tl.int64) // ps
        sealed = (tl.load(SEALED + pages, mask=owned, other=0) != 0) & owned
        n = tl.min(tl.where(sealed, BLOCK_P, offs_p), 0).to(tl.int64)  # first unsealed page
        # the window: pages ending less than `window` before the token stay dense (sealed
        # ones keep their hot copy while a later token of the request reads them dense)
        n = tl.minimum(n, tl.maximum(ln - 1 - window, 0) // ps)
        tl.store(REQ_PAGES + b, (n * pps).to(tl.int32))
        hot_len = tl.where(live, ln - n * ps, 1)  # padded: the padding page's token 0
        tl.store(HOT_LENS + b, hot_len.to(tl.int32))
        # rows are position blocks: row w holds pages [w * block, (w + 1) * block) of the prefix
        starts = offs_w * block
        cnt = tl.minimum(tl.maximum(n - starts, 0), block)
        first = tl.load(row + tl.minimum(starts * ps, r2t_cols - 1), mask=in_w & (cnt > 0),
                        other=0).to(tl.int64) // ps
        ptr = tl.load(BASIS_ADDR + first, mask=in_w & (cnt > 0), other=0)
        tl.store(PTRS + b * W + offs_w, ptr, mask=in_w)
        tl.store(INDPTR + b * W + offs_w + 1, (prefix + tl.minimum(n, starts + block))
                 .to(tl.int32), mask=in_w)
        tl.store(SEG_IDS + prefix + offs_p, pages.to(tl.int32), mask=offs_p < n)
        # hot rows: token t of the hot tail sits in page n + t // ps
        at = tl.minimum(n + offs_t // ps, most - 1)
        hot_ok = in_t & (offs_t < hot_len) & live
        pg = tl.load(row + tl.minimum(at * ps, r2t_cols - 1), mask=hot_ok, other=0) \
            .to(tl.int64) // ps
        hot = tl.load(HOT_PAGE + pg, mask=hot_ok, other=0) * ps + offs_t % ps
        tl.store(HOT_ROWS + b * cap + offs_t, tl.where(hot_ok, hot, 0), mask=in_t)
        prefix += n
    tl.store(AVAILABLE, tl.load(AVAILABLE) + prefix * pps * count_scale)


def _constants(width: int, block_pages: int, hot_cap: int) -> dict:
    return dict(BLOCK_P=triton.next_power_of_2(width * block_pages),
                BLOCK_W=triton.next_power_of_2(width), BLOCK_T=triton.next_power_of_2(hot_cap),
                num_warps=4)


def compile_variant(*, width: int, block_pages: int, hot_cap: int,
                    r2t_dtype: torch.dtype = torch.int32,
                    index_dtype: torch.dtype = torch.int64) -> None:
    """Compile `_decode_tables` now for the variant `build_decode_tables` launches on a server
    with these table sizes (Triton's `warmup`: nothing runs), `req_to_token` in `r2t_dtype`
    (SGLang's: int32) and the batch's request rows and lengths in `index_dtype` (SGLang's
    decode graph buffers: int64). CUDA only."""
    i32, i64 = torch.int32, torch.int64
    _decode_tables.warmup(r2t_dtype, 0, 0, index_dtype, index_dtype, torch.bool, i64, i64,
                          i32, i32, i32, i32, i64, i64, i64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                          grid=(1,), **_constants(width, block_pages, hot_cap))


def build_decode_tables(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                        seq_lens: torch.Tensor, rows: int, sealed: torch.Tensor,
                        basis_addr: torch.Tensor, hot_page: torch.Tensor, out: dict, *,
                        page_size: int, width: int, block_pages: int, pages_per_seg: int,
                        available: torch.Tensor, count_scale: int, window: int = 0) -> None:
    """Write the step's tables into `out` (the bucket's tensors: `seg_indptr` int32 [bs*W+1],
    `seg_ids` int32 [>= bs*W*block], `hot_lens`, `req_pages` int32 [bs], `basis_ptrs` int64
    [bs*W], `hot_rows` int64 [bs, cap]) for a batch of `req_pool_indices.numel()` requests whose
    first `rows` are real, from the device page table (`sealed`, `basis_addr`, `hot_page` per
    logical page). A request's compressed pages are its sealed prefix, at most the pages ending
    `window` or more tokens before its token (the position rule's dense window; 0: none).
    `seg_ids` past the last offset is left as it was. One launch, no host sync."""
    bs = req_pool_indices.numel()
    hot_rows = out["hot_rows"]
    cap = hot_rows.shape[1]
    most = width * block_pages
    if req_to_token.stride(1) != 1:
        raise ValueError("build_decode_tables: req_to_token rows must be contiguous")
    for name, dtype in (("seg_indptr", torch.int32), ("seg_ids", torch.int32),
                        ("hot_lens", torch.int32), ("req_pages", torch.int32),
                        ("basis_ptrs", torch.int64), ("hot_rows", torch.int64)):
        t = out[name]
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"build_decode_tables: {name} must be contiguous {dtype}, got "
                             f"{t.dtype}")
    _decode_tables[(1,)](
        req_to_token, req_to_token.stride(0), req_to_token.shape[1], req_pool_indices, seq_lens,
        sealed, basis_addr, hot_page, out["seg_indptr"], out["seg_ids"], out["hot_lens"],
        out["req_pages"], out["basis_ptrs"], hot_rows, available,
        bs, rows, page_size, width, block_pages, pages_per_seg, cap, most, count_scale, window,
        **_constants(width, block_pages, cap))
