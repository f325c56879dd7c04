"""A sealed page's per-layer blocks, back to back in one buffer, into each layer's arena at its
own byte offset, one launch.

Adopting a daemon page (`SegmentStore.adopt`) copies layer l's bytes [start_l, start_l + size_l)
of the page into arena l at base_l. As 32 slices, 32 narrows and a `_foreach_copy_` that was
~0.3 ms of the scheduler thread's ~0.6 ms per page on the H200 host; here the arenas' addresses
sit in a device table made once, the (start, base, size) triples go in one small copy, and one
launch moves every layer. Reference: `scatter_blocks_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

WORD = 4  # bytes moved per element: offsets and sizes must be multiples of it
BLOCK_WORDS = 1024


@triton.jit
def _scatter_blocks_kernel(src, table, ptrs, BLOCK: tl.constexpr):
    layer = tl.program_id(0)
    start = tl.load(table + layer * 3)
    base = tl.load(table + layer * 3 + 1)
    size = tl.load(table + layer * 3 + 2)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    dst = tl.load(ptrs + layer).to(tl.pointer_type(tl.int32))
    tl.store(dst + base + offs, tl.load(src + start + offs, mask=mask), mask=mask)


def scatter_blocks_reference(arenas: list[torch.Tensor], src: torch.Tensor, bases: list[int],
                             sizes: list[int]) -> None:
    """Layer l's `sizes[l]` bytes (consecutive in `src`, layer 0 first) to arenas[l][bases[l]:]."""
    parts = src[:sum(sizes)].split(sizes)
    torch._foreach_copy_([arena.narrow(0, base, size) for arena, base, size
                          in zip(arenas, bases, sizes)], parts)


class BlockScatter:
    """`scatter_blocks_reference` as one launch, for fixed per-layer uint8 arenas on one CUDA
    device (or the CPU under TRITON_INTERPRET=1). The arenas must outlive this object and keep
    their storage (SegmentStore allocates them once)."""

    def __init__(self, arenas: list[torch.Tensor]):
        for a in arenas:
            if a.dtype != torch.uint8 or a.dim() != 1 or a.device != arenas[0].device:
                raise ValueError("BlockScatter: arenas must be 1-D uint8 tensors on one device")
            if a.data_ptr() % WORD:
                raise ValueError(f"BlockScatter: an arena is not {WORD}-byte aligned")
        self.device = arenas[0].device
        self.ptrs = torch.tensor([a.data_ptr() for a in arenas], dtype=torch.int64,
                                 device=self.device)
        self.capacity = [a.numel() for a in arenas]
        self._keep = arenas  # the table holds raw addresses: keep the tensors alive with it

    def __call__(self, src: torch.Tensor, bases: list[int], sizes: list[int]) -> None:
        if len(bases) != len(self.capacity) or len(sizes) != len(self.capacity):
            raise ValueError(f"BlockScatter: need a base and a size for each of the "
                             f"{len(self.capacity)} arenas")
        if src.dtype != torch.uint8 or src.dim() != 1 or not src.is_contiguous() or \
                src.device != self.device or src.data_ptr() % WORD:
            raise ValueError(f"BlockScatter: src must be a contiguous, {WORD}-byte aligned 1-D "
                             f"uint8 tensor on {self.device}")
        starts, at = [], 0
        for base, size, cap in zip(bases, sizes, self.capacity):
            if base % WORD or size % WORD or not (0 <= base and base + size <= cap):
                raise ValueError(f"BlockScatter: block of {size} bytes at {base} does not fit "
                                 f"an arena of {cap} bytes in {WORD}-byte words")
            starts.append(at)
            at += size
        if at > src.numel():
            raise ValueError(f"BlockScatter: blocks need {at} bytes, src has {src.numel()}")
        table = torch.tensor([[s // WORD, b // WORD, n // WORD]
                              for s, b, n in zip(starts, bases, sizes)], dtype=torch.int64)
        if self.device.type == "cuda":  # pinned: queued like a kernel, no wait on the stream
            table = table.pin_memory().to(self.device, non_blocking=True)
        grid = (len(sizes), triton.cdiv(max(sizes) // WORD, BLOCK_WORDS))
        if grid[1]:
            _scatter_blocks_kernel[grid](src[:at].view(torch.int32), table, self.ptrs,
                                         BLOCK=BLOCK_WORDS)
