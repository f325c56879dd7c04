"""Merge of a request's arena rows (one row per basis block) into its decode output.

A long request is decoded as several rows, each in its own basis; every row returns its output
and the log-sum-exp of its scores, and the request's output is the softmax(lse)-weighted sum of
its rows. One program per (request, query head) reads the request's rows from a padded row table
and writes the merged output straight into the batch's output tensor: one launch where the torch
form (`merge_rows_reference`) takes ~10 small ops per layer (measured on the H200: the decode
step is launch bound, see benchmarks/RESULTS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import rounds_bf16_stores, store_rounded


@triton.jit
def _merge_rows(
    O,  # fp32 [R, HQ, D]: each row's output
    LSE,  # fp32 [R, HQ]: each row's log-sum-exp (-inf: the row attended to nothing)
    REQ_ROWS,  # int64 [K, W]: each request's rows, padded with R
    REQS,  # int64 [K]: each request's index in OUT
    OUT,  # [B, HQ, D] (any float dtype)
    R, HQ, W, D,
    BLOCK_D: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # the interpreter with a bf16 OUT: round on the bits first
):
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask_d = offs < D
    m = tl.full((), float("-inf"), tl.float32)
    for w in range(W):
        r = tl.load(REQ_ROWS + k * W + w)
        m = tl.maximum(m, tl.load(LSE + r * HQ + h, mask=r < R, other=float("-inf")))
    den = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for w in range(W):
        r = tl.load(REQ_ROWS + k * W + w)
        lse = tl.load(LSE + r * HQ + h, mask=r < R, other=float("-inf"))
        use = lse > float("-inf")  # an empty row's output (maybe NaN) is never summed
        p = tl.where(use, tl.exp(lse - m), 0.0)
        o = tl.load(O + (tl.where(r < R, r, 0) * HQ + h) * D + offs, mask=mask_d, other=0.0)
        acc += tl.where(use, p * o, 0.0)
        den += p
    b = tl.load(REQS + k)
    res = store_rounded(acc / den, ROUND_BF16)
    tl.store(OUT + (b * HQ + h) * D + offs, res.to(OUT.dtype.element_ty), mask=mask_d)


def merge_rows(o_rows: torch.Tensor, lse: torch.Tensor, req_rows: torch.Tensor,
               reqs: torch.Tensor, out: torch.Tensor) -> None:
    """out[reqs[k]] = sum over request k's rows r of softmax(lse[rows])[r] * o_rows[r].

    o_rows fp32 [R, Hq, D], lse fp32 [R, Hq], req_rows int64 [K, W] (padded with R), reqs int64
    [K], out [B, Hq, D] contiguous (written in place at rows `reqs` only). Every request needs
    one row with a finite lse. No host sync."""
    rows, hq, d = o_rows.shape
    for name, t, dtype in (("o_rows", o_rows, torch.float32), ("lse", lse, torch.float32),
                           ("req_rows", req_rows, torch.int64), ("reqs", reqs, torch.int64)):
        if t.dtype != dtype or not t.is_contiguous() or t.device != out.device:
            raise ValueError(f"merge_rows: {name} must be contiguous {dtype} on {out.device}, "
                             f"got {t.dtype} on {t.device}")
    if tuple(lse.shape) != (rows, hq) or req_rows.dim() != 2 or \
            tuple(reqs.shape) != (req_rows.shape[0],):
        raise ValueError(f"merge_rows: lse {tuple(lse.shape)}, req_rows {tuple(req_rows.shape)}, "
                         f"reqs {tuple(reqs.shape)} do not fit o_rows {tuple(o_rows.shape)}")
    if out.dim() != 3 or tuple(out.shape[1:]) != (hq, d) or not out.is_contiguous():
        raise ValueError(f"merge_rows: out must be contiguous [B, {hq}, {d}], got "
                         f"{tuple(out.shape)}")
    if reqs.numel():
        _merge_rows[(reqs.numel(), hq)](o_rows, lse, req_rows, reqs, out, rows, hq,
                                        req_rows.shape[1], d,
                                        BLOCK_D=triton.next_power_of_2(d),
                                        ROUND_BF16=rounds_bf16_stores(out.dtype),
                                        num_warps=1)


def merge_rows_reference(o_rows: torch.Tensor, lse: torch.Tensor, req_rows: torch.Tensor,
                         reqs: torch.Tensor, out: torch.Tensor) -> None:
    """Torch form of `merge_rows` (the same contract)."""
    rows, hq = lse.shape
    lse = torch.cat([lse, lse.new_full((1, hq), float("-inf"))])[req_rows]  # [K, W, Hq]
    w = torch.softmax(lse, dim=1)[..., None]
    o = o_rows[req_rows.clamp_max(rows - 1)]  # pad rows: weight 0, any row
    out[reqs] = torch.where(w > 0, o * w, 0.0).sum(1).to(out.dtype)
