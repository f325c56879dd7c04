"""Many copies between arbitrary device addresses in one launch.

Adopting a daemon page writes ~200 pieces: each layer's block into its arena, each layer's
header row, each layer's rows of four page-metadata tables (strided by page). As torch ops that
was ~14 CUDA calls and as many tensor views (~0.5 ms of the H200 host a page); here each piece is
a row (dst address, src address, count, kind) of one int64 table that goes up in one small copy,
and one launch moves them all. Units are 2-byte elements: kind COPY copies `count` of them,
kind WIDEN reads `count` uint8 and writes them as int32 (page channel ids: uint8 in a result,
int32 in the store's table). Reference: `copy_rows_reference`, the same pieces as torch slices.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY, WIDEN = 0, 1
BLOCK = 2048


@triton.jit
def _copy_rows_kernel(rows, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    dst_addr = tl.load(rows + r * 4)
    src_addr = tl.load(rows + r * 4 + 1)
    count = tl.load(rows + r * 4 + 2)
    kind = tl.load(rows + r * 4 + 3)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    if start < count:
        offs = start + tl.arange(0, BLOCK)
        mask = offs < count
        if kind == 0:  # (each branch names its own pointers: their types differ)
            dst16 = dst_addr.to(tl.pointer_type(tl.int16))
            src16 = src_addr.to(tl.pointer_type(tl.int16))
            tl.store(dst16 + offs, tl.load(src16 + offs, mask=mask), mask=mask)
        else:
            dst32 = dst_addr.to(tl.pointer_type(tl.int32))
            src8 = src_addr.to(tl.pointer_type(tl.uint8))
            tl.store(dst32 + offs, tl.load(src8 + offs, mask=mask).to(tl.int32), mask=mask)


def copy_rows(rows: torch.Tensor, max_count: int) -> None:
    """Run every row of `rows` (int64 [R, 4] on the device the addresses belong to, in pinned
    host memory that device maps (`SegmentStore.reads_host` checks it can), or on the CPU under
    TRITON_INTERPRET=1); `max_count`: the largest count (sizes the grid). The caller
    keeps every addressed tensor alive and each piece inside its tensor (`rows_for` checks)."""
    if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[1] != 4 or \
            not rows.is_contiguous():
        raise ValueError("copy_rows: rows must be a contiguous int64 [R, 4] tensor")
    if rows.shape[0] and max_count > 0:
        _copy_rows_kernel[(rows.shape[0], triton.cdiv(max_count, BLOCK))](rows, BLOCK=BLOCK)


def _piece(dst: torch.Tensor, dst_at: int, src: torch.Tensor, src_at: int, n: int):
    """(dst elements, src elements) of one piece: offsets and n count each tensor's elements."""
    return dst.view(-1)[dst_at:dst_at + n], src.view(-1)[src_at:src_at + n]


def rows_for(pieces: list[tuple[torch.Tensor, int, torch.Tensor, int, int]]) -> torch.Tensor:
    """The host int64 [R, 4] table of `pieces` (dst tensor, dst offset, src tensor, src offset,
    n), offsets and n in elements of each tensor: the same dtype (a 2-byte multiple, COPY) or
    uint8 -> int32 (WIDEN). What a caller with precomputed addresses writes directly."""
    table = []
    for dst, dst_at, src, src_at, n in pieces:
        d, s = _piece(dst, dst_at, src, src_at, n)
        if d.numel() != n or s.numel() != n:
            raise ValueError(f"rows_for: a piece of {n} elements runs past its tensor")
        if d.dtype == torch.int32 and s.dtype == torch.uint8:
            table.append((d.data_ptr(), s.data_ptr(), n, WIDEN))
        elif d.dtype == s.dtype and d.element_size() % 2 == 0:
            table.append((d.data_ptr(), s.data_ptr(), n * d.element_size() // 2, COPY))
        else:
            raise ValueError(f"rows_for: cannot copy {s.dtype} into {d.dtype}")
    return torch.tensor(table, dtype=torch.int64).view(-1, 4)


def copy_rows_reference(pieces: list[tuple[torch.Tensor, int, torch.Tensor, int, int]]) -> None:
    """`pieces` as `rows_for` reads them, copied by torch slices (widening by dtype cast)."""
    for piece in pieces:
        d, s = _piece(*piece)
        d.copy_(s)
