"""One page of every layer's dense K/V into one contiguous [L, 2, H, S, D] tensor, one launch.

SGLang keeps the dense cache as one [rows, H, D] tensor per layer and kind; a page is a slice of
rows of each. Copying a page of all of them into a daemon slot took a 64-input `torch.stack`
and 64 slices on the scheduler thread (~0.6 ms of host time a page on the H200 host); here the
buffers' addresses sit in a device table made once, and one launch copies the page of every
buffer (and transposes it to the slot's head-major order). Reference: `page_kv` (codec/seal.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_page_kernel(ptrs, out, row0, S, H, D, row_stride,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    buf = tl.program_id(0)  # layer * 2 + (0: K, 1: V)
    head = tl.program_id(1)
    s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mask = (s < S)[:, None] & (d < D)[None, :]
    src = tl.load(ptrs + buf).to(tl.pointer_type(out.dtype.element_ty))
    rows = (row0 + s).to(tl.int64)
    x = tl.load(src + rows[:, None] * row_stride + head * D + d[None, :], mask=mask)
    dst = ((buf * H + head) * S + s).to(tl.int64)
    tl.store(out + dst[:, None] * D + d[None, :], x, mask=mask)


class PageGather:
    """Copies pages of fixed K/V buffers (all the same [rows, H, D] shape, dtype and device,
    contiguous) into one [L, 2, H, page_size, D] tensor each. The buffers must outlive this
    object and keep their storage (SGLang's pool allocates them once)."""

    def __init__(self, k_buffer: list[torch.Tensor], v_buffer: list[torch.Tensor],
                 page_size: int):
        bufs = [b for pair in zip(k_buffer, v_buffer) for b in pair]
        if not bufs or len(k_buffer) != len(v_buffer):
            raise ValueError("PageGather: need one K and one V buffer per layer")
        first = bufs[0]
        for b in bufs:
            if (b.shape != first.shape or b.dtype != first.dtype or b.device != first.device
                    or b.dim() != 3 or not b.is_contiguous()):
                raise ValueError("PageGather: every buffer must be a contiguous [rows, H, D] "
                                 f"tensor like the first ({tuple(first.shape)}, {first.dtype}, "
                                 f"{first.device}); got {tuple(b.shape)}, {b.dtype}, {b.device}")
        self.rows, self.heads, self.head_dim = first.shape
        self.page_size = page_size
        self.ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64,
                                 device=first.device)
        self.shape = (len(k_buffer), 2, self.heads, page_size, self.head_dim)
        self.dtype = first.dtype
        self._keep = bufs  # the table holds raw addresses: keep the tensors alive with it

    def __call__(self, page: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Page `page` (rows page * page_size ...) of every buffer -> `out` (a new tensor on
        the current stream when None), returned."""
        row0 = page * self.page_size
        if not 0 <= row0 <= self.rows - self.page_size:
            raise IndexError(f"PageGather: page {page} outside the {self.rows} buffer rows")
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.ptrs.device)
        elif out.shape != self.shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"PageGather: out must be a contiguous {self.shape} {self.dtype} "
                             "tensor")
        block_s = min(32, triton.next_power_of_2(self.page_size))
        grid = (self.ptrs.numel(), self.heads, triton.cdiv(self.page_size, block_s))
        _gather_page_kernel[grid](self.ptrs, out, row0, self.page_size, self.heads,
                                  self.head_dim, self.heads * self.head_dim, BLOCK_S=block_s,
                                  BLOCK_D=triton.next_power_of_2(self.head_dim))
        return out
