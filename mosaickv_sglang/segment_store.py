"""Packed segment store: per layer one uint8 arena holding every sealed band segment, the bytes
the Triton decode kernel reads in place.

Installing a sealed page copies each layer's band codes and fp16 scales into an arena block laid
out as `codec.arena.BlockLayout` says, then points the segment's tensors at views of that block:
the bytes exist once, and the torch codec (CPU decode, prefill decompression, tests) reads the
same memory as the kernel. Headers sit in a per-layer table indexed by logical page, so a
request's segment list is just its page ids. Blocks come from per-size free lists and a bump
pointer (block sizes differ by layout); each layer's arena is the share of the packed-byte budget
the pool was sized with at start-up (`capacity_bytes`). Segments the kernel cannot read (not
`band` in the SVD basis, e.g. a dense fallback), or that find the arena full, stay in their own
tensors and are flagged unpacked (counted); their requests decode on the reference path.
"""
from __future__ import annotations

import torch

from mosaickv_kernels.band_decode import band_width_classes
from mosaickv_kernels.page_select import PackedPageMeta

from .codec.arena import ALIGN, HEADER_WIDTH, PLAN_FIELDS, BlockLayout, block_views, write_blocks
from .codec.layer import Segment, own_storage
from .codec.strategies.band import Band


def packable(seg: Segment, page_tokens: int) -> bool:
    """The kernel reads K and V as rotated bands whose token groups hold whole pages."""
    return all(isinstance(c.strategy, Band) and c.strategy.rot and c.strategy.group % page_tokens == 0
               for c in (seg.k, seg.v))


class SegmentStore:
    def __init__(self, layers: int, pages: int, heads: int, head_dim: int, segment_tokens: int,
                 page_tokens: int, device, meta_channels: int | None, capacity_bytes: int):
        self.heads, self.head_dim, self.device = heads, head_dim, device
        self.segment_tokens, self.page_tokens = segment_tokens, page_tokens
        self.capacity = capacity_bytes // ALIGN * ALIGN  # bytes per layer
        self.arena_full = 0  # segments left unpacked because the arena had no room
        # Uninitialized: only installed blocks are ever read (and CPU pages stay uncommitted).
        self.data = [torch.empty(max(self.capacity, ALIGN), dtype=torch.uint8, device=device)
                     for _ in range(layers)]
        self.headers = [torch.zeros(pages + 1, HEADER_WIDTH, dtype=torch.int32, device=device)
                        for _ in range(layers)]
        self.packed = torch.zeros(layers, pages + 1, dtype=torch.bool)  # host: kernel-readable
        self.blocks: dict[tuple[int, int], tuple[int, int]] = {}  # (layer, page) -> (base, size)
        self.free: list[dict[int, list[int]]] = [{} for _ in range(layers)]  # size -> bases
        self.top = [0] * layers  # bump pointer per layer
        self.live_bytes = 0
        self.layouts: dict[tuple, int] = {}  # BlockLayout.key() -> layout id (plans row)
        self._layout_of: dict[tuple, BlockLayout] = {}  # (K spec, V spec, tokens) -> layout
        self._plans: list[torch.Tensor] = []
        self.plans = torch.zeros(1, 2, len(PLAN_FIELDS), head_dim, dtype=torch.int32, device=device)
        self.width_classes: list[tuple[int, ...]] = []  # of the layouts in plans, for the kernel
        self.min_group = segment_tokens
        # Page-selection metadata per layer, indexed by logical page like the headers (the GPU
        # selector reads it by segment id); None when selection is off.
        self.meta = None
        if meta_channels is not None:
            m, pps = min(meta_channels, head_dim), segment_tokens // page_tokens
            self.meta = [PackedPageMeta(
                torch.zeros(pages + 1, heads, m, dtype=torch.int32, device=device),
                torch.zeros(pages + 1, heads, pps, m, dtype=torch.float16, device=device),
                torch.zeros(pages + 1, heads, pps, m, dtype=torch.float16, device=device),
                torch.zeros(pages + 1, heads, pps, dtype=torch.float16, device=device))
                for _ in range(layers)]

    # ---- install / release ----------------------------------------------------------------
    def install_pages(self, pages: list[int], segments: list[list[Segment]]) -> None:
        """Sealed pages (each one segment per layer) in, one `install` batch per layer; the
        segments the arena does not take get their own storage (`own_storage`)."""
        for layer in range(len(self.data)):
            segs = [page_segs[layer] for page_segs in segments]
            for seg, stored in zip(segs, self.install(layer, pages, segs)):
                if not stored:  # kept in its own tensors, not in views of the sealing batch
                    own_storage(seg)

    def install(self, layer: int, pages: list[int], segs: list[Segment]) -> list[bool]:
        """Copy one layer's segments (one per logical page) into the arena and re-point their
        tensors at the copy; per segment, False (nothing stored) when the kernel cannot read it
        or the arena is full. Blocks are taken in segment order; the copies go per layout, a
        few for the whole batch (staged blocks, one scatter into the arena, headers and page
        metadata in one write each), not a few per segment."""
        stored = [False] * len(segs)
        groups: dict[tuple, tuple[BlockLayout, list[int], list[int]]] = {}
        for i, seg in enumerate(segs):
            if not packable(seg, self.page_tokens):
                continue
            if self.meta is not None and (seg.pages is None or not seg.pages_rotated):
                raise ValueError("SegmentStore: selection is on but a band segment came without "
                                 "page metadata in its K basis")
            key = (seg.k.strategy.spec, seg.v.strategy.spec, seg.tokens)
            lay = self._layout_of.get(key)
            if lay is None:
                lay = self._layout_of[key] = BlockLayout.of(seg.k.strategy, seg.v.strategy,
                                                            seg.tokens, self.head_dim)
            base = self._alloc(layer, self.heads * lay.head_bytes)
            if base is None:
                self.arena_full += 1
                continue
            stored[i] = True
            groups.setdefault(lay.key(), (lay, [], []))
            groups[lay.key()][1].append(i)
            groups[lay.key()][2].append(base)
        for lay, idx, bases in groups.values():
            self._write(layer, lay, [pages[i] for i in idx], [segs[i] for i in idx], bases)
        return stored

    def _write(self, layer: int, lay: BlockLayout, pages: list[int], segs: list[Segment],
               bases: list[int]) -> None:
        """The copies of `install` for segments of one layout, their blocks at `bases`."""
        size = self.heads * lay.head_bytes
        staged = torch.zeros(len(segs), self.heads, lay.head_bytes, dtype=torch.uint8,
                             device=self.device)
        write_blocks(staged, lay, segs)
        rows = (torch.tensor(bases)[:, None] + torch.arange(0, size, ALIGN)) // ALIGN
        self.data[layer].view(-1, ALIGN).index_copy_(0, rows.flatten().to(self.device),
                                                     staged.view(-1, ALIGN))
        for seg, views in zip(segs, block_views(self.data[layer], bases, lay, segs)):
            for (kind, name), view in views.items():
                (seg.k if kind == "k" else seg.v).encoded.tensors[name] = view
        if lay.key() not in self.layouts:
            self.layouts[lay.key()] = len(self._plans)
            self._plans.append(lay.channel_plan())
            self.plans = torch.stack(self._plans).to(self.device)
            self.width_classes = band_width_classes(torch.stack(self._plans))  # host copy
            self.min_group = min(self.min_group, lay.k.group, lay.v.group)
        at = torch.tensor(pages, device=self.device)
        self.headers[layer][at] = lay.headers(bases, self.layouts[lay.key()]).to(self.device)
        if self.meta is not None:
            table = self.meta[layer]
            table.channels[at] = torch.stack([seg.pages.channels for seg in segs]).to(torch.int32)
            for name in ("lo", "hi", "rest_norm"):
                getattr(table, name)[at] = torch.stack([getattr(seg.pages, name) for seg in segs])
                for seg, page in zip(segs, pages):
                    setattr(seg.pages, name, getattr(table, name)[page])  # one copy: a view
        self.packed[layer, pages] = True
        for page, base in zip(pages, bases):
            self.blocks[(layer, page)] = (base, size)
        self.live_bytes += size * len(segs)

    def release(self, page: int) -> None:
        for layer in range(len(self.data)):
            block = self.blocks.pop((layer, page), None)
            if block is not None:
                base, size = block
                self.free[layer].setdefault(size, []).append(base)
                self.live_bytes -= size
            self.packed[layer, page] = False

    def clear(self) -> None:
        self.blocks.clear()
        self.free = [{} for _ in self.data]
        self.top = [0] * len(self.data)
        self.packed.zero_()
        self.live_bytes = 0

    def _alloc(self, layer: int, size: int) -> int | None:
        bases = self.free[layer].get(size)
        if bases:
            return bases.pop()
        base = self.top[layer]
        if base + size > self.capacity:
            return None
        self.top[layer] = base + size
        return base

    # ---- accounting ---------------------------------------------------------------------
    def reserved_bytes(self) -> int:
        """Physical bytes this store allocated (arenas, header tables, layout plans)."""
        meta = sum(m.nbytes() for m in self.meta) if self.meta is not None else 0
        return sum(t.numel() * t.element_size() for t in self.data + self.headers) + \
            self.plans.numel() * self.plans.element_size() + meta
