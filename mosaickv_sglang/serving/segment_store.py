"""Packed segment store: one uint8 arena holding every sealed band segment of every layer, the
bytes the Triton decode kernel reads in place.

Installing a sealed page copies each layer's band codes and fp16 scales into an arena block laid
out as `codec.arena.BlockLayout` says; the page's segments are then views of that block (made on
read, `StoredSegments`, for pages sealed in batches and adopted daemon pages; re-pointed for
segments given one by one): the bytes exist once, and the torch codec (CPU decode, prefill
decompression, tests) reads the same memory as the kernel. Headers sit in a per-layer table
indexed by logical page, so a request's segment list is just its page ids.

The arena is one flat tensor sized at start-up (`capacity_bytes` per layer, the pool's plan).
Layers share it (`shared`, config `arena`): consecutive layers, as many as an int32 header in
16-byte units addresses (all of them below 32 GiB), take their blocks from one range and one
`BlockAllocator` (per-size free lists, a bump pointer, merging), and a layer's `data` view is
its group's range. The chooser picks layouts per segment, so layers compress unequally; with an
equal range per layer the fullest one refused pages while the others held free bytes (SmolLM2:
124 vs 102 MB of 140, docs/serving.md). Segments the kernel cannot read (not `band` in the SVD
basis, e.g. a dense fallback), or that find the arena full, stay in their own tensors and are
flagged unpacked (counted); their requests decode on the reference path.

A daemon result comes arena-ready (`codec.arena.ArenaPage`: the worker ran `write_blocks`), so
`adopt` takes all its layers with one arena copy and one write per table, and its Segments are
made only when something reads them (`StoredSegments`). Its tensors may still be views of the
daemon's shared-memory slot (read in place): on CUDA the copy kernel then reads them over PCIe
from the pinned, mapped slot (`reads_host` checks once that it can), and nothing the store keeps
points into the slot afterwards.

Who writes a block's codes and scales (`pack_kernel`): on CUDA the GPU pack kernel
(`band_pack.pack_layout`) encodes them in place from the chooser's rotated K/V, one launch per
layout and kind per batch, instead of staging the chooser's encoded tensors and scattering them
(the chooser still encodes every candidate: it measures each one's error). Both write the same
bytes (tests/test_pack_install.py); segments without rotated K/V (daemon results that were not
arena-ready) take the torch copy. Counted per path in `pack_counts`. The same choice writes an
adopted page: every layer's block, header row and page-metadata rows in one `row_copy` launch
(their addresses computed on the host, no tensor views), or the torch slices it is tested
against (byte-identical).
"""
from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from mosaickv_kernels.band_decode import band_width_classes
from mosaickv_kernels.band_errors import compile_variants as compile_errors_variants
from mosaickv_kernels.band_encode import compile_variants as compile_encode_variants
from mosaickv_kernels.band_pack import compile_variants, pack_layout
from mosaickv_kernels.page_select import PackedPageMeta
from mosaickv_kernels.row_copy import COPY, WIDEN, copy_rows

from ..codec.arena import (ALIGN, HDR, HEADER_WIDTH, MAX_ARENA_BYTES, META_FIELDS,
                          PLAN_FIELDS, ArenaPage, BlockLayout, block_segment,
                          block_views, check_part, layout_of, packable, tensor_parts,
                          write_blocks, write_part)
from ..codec.layer import Segment, Tried, own_storage, segment_bytes
from ..codec.pages import PageMeta
from ..codec.seal import PageSegments
from ..codec.strategies.band import Band
from ..codec.transfer import to_device_async
from ..config import PACK_KERNELS
from .block_alloc import BlockAllocator

logger = logging.getLogger(__name__)


def block_units(first: np.ndarray, size: int, device) -> torch.Tensor:
    """The ALIGN-byte units of blocks of `size` bytes starting at units `first` (int64 [m]), as
    one flat int64 index on `device`, built there: only the m starts cross from the host (the
    host-built index of a decode step's 512 Llama-8B segments was 2.4M entries, ~14 ms of numpy
    on the dev box plus a 19 MB pinned copy)."""
    starts = to_device_async(np.asarray(first, dtype=np.int64), device)
    return (starts[:, None] + torch.arange(-(-size // ALIGN), device=device)).reshape(-1)


def use_pack_kernel(choice: str, device) -> bool:
    """The `pack_kernel` config value on this device: does the GPU pack kernel write blocks?"""
    if choice not in PACK_KERNELS:
        raise ValueError(f"SegmentStore: pack_kernel={choice!r} must be one of "
                         f"{list(PACK_KERNELS)}")
    kind = torch.device(device).type
    if choice == "triton" and kind == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("mosaickv pack_kernel 'triton' on a CPU runs through Triton's "
                         "interpreter: set TRITON_INTERPRET=1, or use pack_kernel 'auto'")
    return choice == "triton" or (choice == "auto" and kind == "cuda")


class SegmentStore:
    def __init__(self, layers: int, pages: int, heads: int, head_dim: int, segment_tokens: int,
                 page_tokens: int, device, meta_channels: int | None, capacity_bytes: int,
                 pack_kernel: str = "auto", page_block_bytes: int = ALIGN, shared: bool = True):
        self.heads, self.head_dim, self.device = heads, head_dim, device
        self.pack_kernel = use_pack_kernel(pack_kernel, device)
        # segments whose blocks were written by the kernel / by torch copies; "no_rotated": the
        # kernel path's segments that came without rotated K/V (daemon results, a prefill
        # chunk's layers past pool.CHUNK_ROTATED_BYTES), copied by torch
        self.pack_counts = {"kernel": 0, "torch": 0, "no_rotated": 0}
        self.segment_tokens, self.page_tokens = segment_tokens, page_tokens
        self.capacity = capacity_bytes // ALIGN * ALIGN  # bytes per layer (its share)
        self.arena_full = 0  # segments left unpacked because the arena had no room
        # Uninitialized: only installed blocks are ever read (and CPU pages stay uncommitted).
        # One flat byte tensor; each group of consecutive layers shares a range of it and one
        # allocator (`shared`: as many layers as a base16 header addresses, else one each), and
        # a layer's `data` view is its group's range: its blocks' bases are offsets in it.
        per = max(self.capacity, ALIGN)
        span = max(1, min(layers, MAX_ARENA_BYTES // per)) if shared else 1
        if per > MAX_ARENA_BYTES:
            raise ValueError(f"SegmentStore: {per} arena bytes per layer exceed what an int32 "
                             f"header in {ALIGN}-byte units addresses ({MAX_ARENA_BYTES})")
        self.group_of = np.arange(layers) // span  # layer -> its arena group
        firsts = list(range(0, layers, span))
        self.group_layers = np.array([min(span, layers - f) for f in firsts], dtype=np.int64)
        self.group_start = np.array(firsts, dtype=np.int64) * per  # byte offset in `_data`
        self._data = torch.empty(layers * per, dtype=torch.uint8, device=device)
        groups = [self._data.narrow(0, int(at), int(n) * per)
                  for at, n in zip(self.group_start, self.group_layers)]
        self.data = [groups[g] for g in self.group_of.tolist()]
        self._layer_start = self.group_start[self.group_of]  # layer -> its view's offset
        # Headers and page metadata: per layer a view of one tensor per table, so an adopted
        # page (`adopt`: all layers at once) is one write per table.
        self._headers = torch.zeros(layers, pages + 1, HEADER_WIDTH, dtype=torch.int32,
                                    device=device)
        self.headers = list(self._headers.unbind(0))
        self._header_rows: list[torch.Tensor] = []  # per layout id: its header at base 0
        self._header_table = np.zeros((0, HEADER_WIDTH), dtype=np.int32)  # the same, stacked
        self.device_type = torch.device(device).type
        self._adopt_rows: AdoptRows | None = None  # prepare_adoption (daemon start)
        # adopted pages may sit in host memory (CPU tensors): on a CPU always; on CUDA once
        # `reads_host` found the copy kernel reads registered host memory in place
        self.host_sources = self.device_type == "cpu"
        # the adoption's row table read by the kernel from its pinned staging buffer (CUDA, once
        # `reads_host` found that works too): no copy of it up to the device per page
        self.host_rows = False
        self.packed = torch.zeros(layers, pages + 1, dtype=torch.bool)  # host: kernel-readable
        self._packed_np = self.packed.numpy()  # the same memory: a page's flags in ~1 us, not ~15
        self.unreadable: set[int] = set()  # stored pages with a layer the kernel cannot read
        self.blocks: dict[tuple[int, int], tuple[int, int]] = {}  # (layer, page) -> (base, size)
        # per group: its blocks (`fits` counted in blocks of the largest a page's layer takes)
        self.allocators = [BlockAllocator(int(n) * self.capacity, page_block_bytes)
                           for n in self.group_layers]
        self.live_bytes = 0
        self.layer_live = np.zeros(layers, dtype=np.int64)  # live block bytes per layer
        # segments kept in their own tensors (not packable, or no room): bytes per layer
        self.outside: dict[tuple[int, int], int] = {}  # (layer, page) -> bytes
        self.outside_bytes = np.zeros(layers, dtype=np.int64)
        self.over_capacity = 0  # installs after which live + outside bytes exceeded capacity
        self.layouts: dict[tuple, int] = {}  # BlockLayout.key() -> layout id (plans row)
        # an adopted page's per-layer specs -> (block sizes, layout ids): pages repeat a few
        # spec lists, and looking up 32 layouts and their ids costs ~60 us (bounded: FIFO)
        self._page_layouts: dict[tuple, tuple[list[int], list[int]]] = {}  # (tokens, *specs)
        self._plans: list[torch.Tensor] = []
        self.plans = torch.zeros(1, 2, len(PLAN_FIELDS), head_dim, dtype=torch.int32, device=device)
        self.width_classes: list[tuple[int, ...]] = []  # of the layouts in plans, for the kernel
        self.frozen = False  # freeze_layouts: no layout may be added
        self.min_group = segment_tokens
        # Page-selection metadata per layer, indexed by logical page like the headers (the GPU
        # selector reads it by segment id); None when selection is off.
        self.meta = self._meta = None
        if meta_channels is not None:
            m, pps = min(meta_channels, head_dim), segment_tokens // page_tokens
            self._meta = PackedPageMeta(
                torch.zeros(layers, pages + 1, heads, m, dtype=torch.int32, device=device),
                torch.zeros(layers, pages + 1, heads, pps, m, dtype=torch.float16, device=device),
                torch.zeros(layers, pages + 1, heads, pps, m, dtype=torch.float16, device=device),
                torch.zeros(layers, pages + 1, heads, pps, dtype=torch.float16, device=device))
            self.meta = [PackedPageMeta(*(getattr(self._meta, f)[layer] for f in META_FIELDS))
                         for layer in range(layers)]

    # ---- install / release ----------------------------------------------------------------
    def store_pages(self, pages: list[int], sealed: list) -> list[Sequence[Segment]]:
        """Sealed pages in, whatever form they came in: the arena-ready daemon results
        (`ArenaPage`) by `adopt_pages` (one launch for all of them), the rest (SealedPages, or an
        ArenaPage the arena has no room for, as views of its own bytes) in one `install_pages`
        batch. Returns each page's per-layer Segments."""
        out = self._store_pages(pages, sealed)
        used = self.by_group(self.layer_live + self.outside_bytes)
        if (used > self.group_layers * self.capacity).any():
            # the planned memory exceeded (segments outside the arena): counted, logged once
            if not self.over_capacity:
                logger.warning("MosaicKV: sealed pages take more bytes than the arena was planned"
                               " with (%d bytes > %d in some arena group): the byte gate let in "
                               "more than fits; counted (segment_store.over_capacity)",
                               int(used.max()), int(self.group_layers.min() * self.capacity))
            self.over_capacity += 1
        if pages:  # pages some layer of which the kernel cannot read (not packed: no room,
            # or a segment it does not read): such a page's requests decode by the reference
            ok = self._packed_np[:, pages].all(0)
            self.unreadable.update(p for p, good in zip(pages, ok) if not good)
        return out

    def _store_pages(self, pages: list[int], sealed: list) -> list[Sequence[Segment]]:
        segments = [None if isinstance(sp, ArenaPage) else sp.segments for sp in sealed]
        ready = [i for i, sp in enumerate(sealed) if isinstance(sp, ArenaPage)]
        rest = [i for i, sp in enumerate(sealed) if not isinstance(sp, ArenaPage)]
        for i, got in zip(ready, self.adopt_pages([pages[i] for i in ready],
                                                  [sealed[i] for i in ready])):
            if got is None:  # no room: its segments keep their bytes, never a daemon slot's
                got = sealed[i].copy_to(self.device).segments()
                rest.append(i)
            segments[i] = got
        if rest:
            for i, got in zip(rest, self.install_pages([pages[i] for i in rest],
                                                       [segments[i] for i in rest])):
                segments[i] = got
        return segments

    def install_pages(self, pages: list[int],
                      segments: list[Sequence[Segment]]) -> list[Sequence[Segment]]:
        """Sealed pages (each one segment per layer) in; the segments the arena does not take
        get their own storage (`own_storage`). Pages sealed by `seal_pages` (`PageSegments`)
        go in from their batches' arrays (`_install_batched`), others one `install` batch per
        layer. Returns each page's segments as the store keeps them (lazily made views of the
        arena for the batched pages, the given segments re-pointed for the others)."""
        out = list(segments)
        lazy = [i for i, segs in enumerate(segments) if isinstance(segs, PageSegments)]
        if lazy:
            for i, got in zip(lazy, self._install_batched([pages[i] for i in lazy],
                                                          [segments[i] for i in lazy])):
                out[i] = got
        rest = [i for i, segs in enumerate(segments) if not isinstance(segs, PageSegments)]
        if rest:
            self._install_segments([pages[i] for i in rest], [segments[i] for i in rest])
        return out

    def _install_segments(self, pages: list[int], segments: list[Sequence[Segment]]) -> None:
        """`install_pages` for Segment lists: one `install` batch per layer."""
        for layer in range(len(self.data)):
            segs = [page_segs[layer] for page_segs in segments]
            for page, seg, stored in zip(pages, segs, self.install(layer, pages, segs)):
                if not stored:  # kept in its own tensors, not in views of the sealing batch
                    own_storage(seg)
                    # memory beside the arena, charged to its byte gate all the same
                    size = sum(segment_bytes(seg).values())
                    self.outside[(layer, page)] = size
                    self.outside_bytes[layer] += size

    def _install_batched(self, pages: list[int],
                         segments: list[PageSegments]) -> list["StoredSegments"]:
        """Pages sealed by `seal_pages` in, from the arrays of the `SegmentBatch`es they refer
        to, every layer at once: per (batch, K try, V try) group its layout, packability and
        block size; blocks allocated per layer in page order (as `install` takes them); the
        header rows in one write; per group the blocks written in one copy over all layers
        (staged from the tries' tensors by row index) or, with the pack kernel, one launch pair
        per layer from the batch's rotated K/V by row index; page metadata in one write per
        field and batch. No Segment is made for a stored segment: each page's segments are a
        `StoredSegments` view of the arena (made on read), and the few the arena does not take
        are made and given their own storage, as `install_pages` does."""
        layers, n = len(self.data), len(pages)
        batches: dict[int, int] = {}  # id(batch) -> its index in `blist`
        blist = []
        bidx = np.empty((n, layers), dtype=np.int64)  # (page, layer) -> batch
        ridx = np.empty((n, layers), dtype=np.int64)  # (page, layer) -> index in its batch
        for i, segs in enumerate(segments):
            if len(segs.refs) != layers:
                raise ValueError(f"SegmentStore: page {pages[i]} has {len(segs.refs)} layers, "
                                 f"the store {layers}")
            for layer, (batch, r) in enumerate(segs.refs):
                b = batches.get(id(batch))
                if b is None:
                    b = batches[id(batch)] = len(blist)
                    blist.append(batch)
                bidx[i, layer], ridx[i, layer] = b, r
        # groups: (batch, K try, V try), each with one layout (or none: not packable)
        groups: list[_Group] = []
        gid = np.empty((n, layers), dtype=np.int64)
        for b, batch in enumerate(blist):
            mine = bidx == b
            nv = len(batch.v.tries)
            pair = batch.k.try_of * nv + batch.v.try_of  # per index of the batch
            used, local = np.unique(pair[ridx[mine]], return_inverse=True)
            gid[mine] = len(groups) + local
            for code in used.tolist():
                groups.append(self._group(batch, b, *divmod(code, nv)))
        size_of = np.array([g.size for g in groups], dtype=np.int64)
        packs = np.array([g.layout is not None for g in groups], dtype=bool)[gid]
        # blocks, per layer in page order (what `install` takes, segment by segment)
        base = np.full((n, layers), -1, dtype=np.int64)
        for layer in range(layers):
            rows = np.nonzero(packs[:, layer])[0]
            if not len(rows):
                continue
            got = self.allocators[self.group_of[layer]].alloc_many(
                size_of[gid[rows, layer]].tolist())
            base[rows, layer] = [-1 if b is None else b for b in got]
        self.arena_full += int((packs & (base < 0)).sum())
        stored = base >= 0
        # layout ids in the order `install` gives them: layer by layer, a layout when its first
        # stored segment (page order) is written
        seq = gid.T[stored.T]
        used, first = np.unique(seq, return_index=True)
        for g in used[np.argsort(first)].tolist():
            groups[g].layout_id = self._layout_id(groups[g].layout)
        pi, li = np.nonzero(stored)  # stored segments, page-major
        page_of = np.asarray(pages, dtype=np.int64)
        sb, sg = base[pi, li], gid[pi, li]
        if len(pi):
            self._write_batched(blist, groups, pi, li, page_of[pi], sb, sg, bidx[pi, li],
                                ridx[pi, li])
        # per page what its lazy Segments need: group, errors, codec headers
        errs = np.empty((n, layers, 2))
        headers = torch.empty(n, layers, blist[0].headers.shape[1], dtype=torch.int32)
        for b, batch in enumerate(blist):
            mine = bidx == b
            r = ridx[mine]
            errs[mine] = np.stack([batch.k.errors()[r], batch.v.errors()[r]], 1)
            at = np.nonzero(mine)
            headers[torch.from_numpy(at[0]), torch.from_numpy(at[1])] = \
                batch.headers[torch.from_numpy(r)]
        made = [dict() for _ in range(n)]
        for layer in range(layers):  # the segments left outside the arena, layer by layer
            for i in np.nonzero(~stored[:, layer])[0].tolist():
                seg = blist[bidx[i, layer]][int(ridx[i, layer])]
                own_storage(seg)  # kept in its own tensors, not in views of the sealing batch
                size = sum(segment_bytes(seg).values())  # beside the arena, charged to its gate
                self.outside[(layer, pages[i])] = size
                self.outside_bytes[layer] += size
                made[i][layer] = seg
        out = []
        for i, (page, segs) in enumerate(zip(pages, segments)):
            first = segs.refs[0][0]
            record = SealedRecord(first.starts[segs.refs[0][1]], first.tokens, first.basis,
                                  groups, gid[i], errs[i], headers[i])
            out.append(StoredSegments(self, page, record, made[i]))
        return out

    def _group(self, batch, b: int, kt: int, vt: int) -> "_Group":
        """The install group of a batch's (K try, V try): strategies, reasons, layout (None when
        the kernel cannot read it: `packable`), block size, layout id and tensor parts."""
        k, v = batch.k.tries[kt], batch.v.tries[vt]
        ok = all(isinstance(t.strategy, Band) and t.strategy.rot and
                 t.strategy.group % self.page_tokens == 0 for t in (k, v))
        if not ok:
            return _Group(b, k, v, None, 0, -1, [])
        if self.meta is not None and batch.meta is None:
            raise ValueError("SegmentStore: selection is on but a band segment came without "
                             "page metadata in its K basis")
        lay = layout_of(k.spec, v.spec, batch.tokens, self.head_dim)
        h = self.heads
        parts = [(kind, name, t.dtype, (h, *t.shape[1:])) for kind, tried in (("k", k), ("v", v))
                 for name, t in tried.tensors.items()]
        return _Group(b, k, v, lay, h * lay.head_bytes, -1, parts)  # layout id: on install

    def _write_batched(self, blist, groups, pi, li, pages, bases, gids, bidx, ridx) -> None:
        """`_install_batched`'s writes for its stored segments (arrays, page-major): page,
        layer, block base, group, batch and index in the batch of each."""
        dev = self.device
        if (bases % ALIGN).any() or (bases > MAX_ARENA_BYTES).any():
            bad = bases[(bases % ALIGN != 0) | (bases > MAX_ARENA_BYTES)][0]
            raise ValueError(f"segment base {bad} must be a multiple of {ALIGN} below "
                             f"{MAX_ARENA_BYTES} (int32 header in {ALIGN}-byte units)")
        # headers first (one write): the pack kernel finds each block through its header row
        layout_ids = np.array([g.layout_id for g in groups], dtype=np.int64)[gids]
        rows = self._header_table[layout_ids]
        rows[:, HDR["base16"]] = bases // ALIGN
        at_layer = to_device_async(li, dev)
        at_page = to_device_async(pages, dev)
        self._headers[at_layer, at_page] = to_device_async(rows, dev)
        flat = self._data.view(-1, ALIGN)
        for g in np.unique(gids).tolist():
            grp = groups[g]
            sel = np.nonzero(gids == g)[0]
            batch, lay, m = blist[grp.batch], grp.layout, len(sel)
            r = ridx[sel]
            units = block_units((self._layer_start[li[sel]] + bases[sel]) // ALIGN, grp.size,
                                dev)
            kernel = self.pack_kernel and batch.rotated is not None
            if self.pack_kernel and not kernel:
                if not self.pack_counts["no_rotated"]:
                    logger.info("MosaicKV: sealed segments without rotated K/V (daemon results, "
                                "a prefill chunk's layers past its rotated-K/V budget) are copied "
                                "into the arena by torch, not packed by the kernel; counted in "
                                "stats (segment_store.packed_by.no_rotated)")
                self.pack_counts["no_rotated"] += m
            if kernel:
                flat.index_fill_(0, units, 0)  # alignment padding as the torch copy leaves it
                n_rot = batch.rotated[0].shape[0]
                if m == n_rot and (r == np.arange(n_rot)).all():  # the whole batch, in order
                    k_rot, v_rot = batch.rotated
                else:
                    idx = to_device_async(r, dev)
                    k_rot, v_rot = batch.rotated[0][idx], batch.rotated[1][idx]
                self._pack(li[sel], pages[sel], k_rot, v_rot, lay)
            else:
                staged = torch.zeros(m, self.heads, lay.head_bytes, dtype=torch.uint8,
                                     device=dev)
                for kind, tried, choice in (("k", grp.k, batch.k), ("v", grp.v, batch.v)):
                    rows_in_try = to_device_async(choice.row_of[r], dev)
                    for name in tried.tensors:
                        key = f"{kind}.{name}"
                        part = tried.rows_of(name)  # [rows, H, ...]
                        check_part(lay, key, part[0], self.heads)
                        write_part(staged, lay, key, part[rows_in_try])
                flat.index_copy_(0, units, staged.view(-1, ALIGN))
            self.pack_counts["kernel" if kernel else "torch"] += m
        if self._meta is not None:
            for b, batch in enumerate(blist):
                sel = np.nonzero(bidx == b)[0]
                if not len(sel):
                    continue
                at = (to_device_async(li[sel], dev),
                      to_device_async(pages[sel], dev))
                idx = to_device_async(ridx[sel], batch.meta.lo.device)
                for f in META_FIELDS:
                    src = getattr(batch.meta, f)[idx]
                    table = getattr(self._meta, f)
                    table[at] = src.to(table.dtype) if f == "channels" else src
        self._packed_np[li, pages] = True
        sizes = np.array([g.size for g in groups], dtype=np.int64)[gids]
        self.blocks.update(zip(zip(li.tolist(), pages.tolist()),
                               zip(bases.tolist(), sizes.tolist())))
        self.live_bytes += int(sizes.sum())
        np.add.at(self.layer_live, li, sizes)

    def _pack(self, layers: np.ndarray, pages: np.ndarray, k_rot: torch.Tensor,
              v_rot: torch.Tensor, lay: BlockLayout) -> None:
        """The pack kernel writes segments (layer, page) of one layout, whatever their layers,
        in one launch pair: the layers' arenas as one byte range (`_data`), their header tables
        as one (`_headers`), each segment offset by its layer's view. Header rows written
        first; k_rot/v_rot float32 [n, H, T, D], row i for segment i."""
        dev = self.device
        rows = layers.astype(np.int64) * self._headers.shape[1] + pages
        pack_layout(self._data.view(-1), self._headers.view(-1, HEADER_WIDTH),
                    to_device_async(rows.astype(np.int32), dev),
                    k_rot.contiguous(), v_rot.contiguous(), lay.k.widths(self.head_dim),
                    lay.v.widths(self.head_dim),
                    to_device_async(self._layer_start[layers], dev))

    def install(self, layer: int, pages: list[int], segs: list[Segment]) -> list[bool]:
        """Copy one layer's segments (one per logical page) into the arena and re-point their
        tensors at the copy; per segment, False (nothing stored) when the kernel cannot read it
        or the arena is full. Blocks are taken in segment order; the writes go per layout, a
        few for the whole batch (the pack kernel, or staged blocks and one scatter; headers and
        page metadata in one write each), not a few per segment. Every segment's rotated K/V
        (`Segment.rotated`) is dropped here, whatever path it took."""
        stored = [False] * len(segs)
        groups: dict[tuple, tuple[BlockLayout, list[int], list[int]]] = {}
        for i, seg in enumerate(segs):
            if not packable(seg, self.page_tokens):
                continue
            if self.meta is not None and (seg.pages is None or not seg.pages_rotated):
                raise ValueError("SegmentStore: selection is on but a band segment came without "
                                 "page metadata in its K basis")
            lay = layout_of(seg.k.strategy.spec, seg.v.strategy.spec, seg.tokens, self.head_dim)
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
        for seg in segs:
            seg.rotated = None  # the chooser's batch is no longer needed
        return stored

    def _write(self, layer: int, lay: BlockLayout, pages: list[int], segs: list[Segment],
               bases: list[int]) -> None:
        """The writes of `install` for segments of one layout, their blocks at `bases`."""
        size = self.heads * lay.head_bytes
        # small host tables go up through pinned memory: a pageable copy would make the host
        # wait for the stream's queued work (the running step's forward) at every layer
        at = to_device_async(torch.tensor(pages), self.device)
        # headers first: the pack kernel finds each block through its header row
        self.headers[layer][at] = to_device_async(lay.headers(bases, self._layout_id(lay)),
                                                   self.device)
        rows = block_units(np.asarray(bases, dtype=np.int64) // ALIGN, size, self.device)
        blocks = self.data[layer].view(-1, ALIGN)
        kernel = self.pack_kernel and all(seg.rotated is not None for seg in segs)
        if self.pack_kernel and not kernel:
            if not self.pack_counts["no_rotated"]:
                logger.info("MosaicKV: sealed segments without rotated K/V (daemon results, a "
                            "prefill chunk's layers past its rotated-K/V budget) are copied into "
                            "the arena by torch, not packed by the kernel; counted in stats "
                            "(segment_store.packed_by.no_rotated)")
            self.pack_counts["no_rotated"] += len(segs)
        if kernel:
            blocks.index_fill_(0, rows, 0)  # alignment padding as the torch copy leaves it
            self._pack(np.full(len(pages), layer), np.asarray(pages),
                       torch.stack([seg.rotated[0] for seg in segs]),
                       torch.stack([seg.rotated[1] for seg in segs]), lay)
        else:
            staged = torch.zeros(len(segs), self.heads, lay.head_bytes, dtype=torch.uint8,
                                 device=self.device)
            write_blocks(staged, lay, segs)
            blocks.index_copy_(0, rows, staged.view(-1, ALIGN))
        self.pack_counts["kernel" if kernel else "torch"] += len(segs)
        views_of = block_views(self.data[layer], bases, lay, tensor_parts(segs[0]))
        for seg, views in zip(segs, views_of):
            for (kind, name), view in views.items():
                (seg.k if kind == "k" else seg.v).encoded.tensors[name] = view
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
        self.layer_live[layer] += size * len(segs)

    def pack_variants(self, pairs: list[tuple[str, str]], segment_tokens: int) -> list[tuple]:
        """The pack kernel's compile-time variants that sealing pages of the (K spec, V spec)
        band `pairs` launches: (kind, (b8, b4, b2, group)), each once."""
        out = []
        for k, v in pairs:
            lay = layout_of(k, v, segment_tokens, self.head_dim)
            out += [(kind, band.widths(self.head_dim))
                    for kind, band in (("k", lay.k), ("v", lay.v))]
        return list(dict.fromkeys(out))

    def compile_pack_kernels(self, pairs: list[tuple[str, str]], segment_tokens: int) -> int:
        """On CUDA with the pack kernel: compile its variant for every layout of `pairs` now
        (start-up), not when the first page of a layout is sealed inside a live step. Returns
        variants compiled (0 where the kernel does not write blocks)."""
        if self.device_type != "cuda" or not self.pack_kernel:
            return 0
        return compile_variants(self.pack_variants(pairs, segment_tokens), self.heads,
                                segment_tokens, self.head_dim)

    def compile_chooser_kernels(self, pairs: list[tuple[str, str]], segment_tokens: int,
                                chooser: str, encode_kernel: str = "torch") -> int:
        """On CUDA, unless the chooser is the cascade: compile `band_errors` (the errors-first
        chooser's kernel), and `band_encode` where `encode_kernel` is "triton", for every band
        width of `pairs` now (start-up). Returns variants compiled."""
        if self.device_type != "cuda" or chooser == "cascade":
            return 0
        widths = [w for _, w in self.pack_variants(pairs, segment_tokens)]
        n = compile_errors_variants(widths, segment_tokens, self.head_dim)
        if encode_kernel == "triton":
            n += compile_encode_variants(widths, segment_tokens, self.head_dim)
        return n

    def freeze_layouts(self, pairs: list[tuple[str, str]], segment_tokens: int) -> None:
        """Register the layout of every (K spec, V spec) band pair up front and allow no other:
        the plans tensor, the min group and the kernel's width classes stay what a CUDA graph
        captured (a layout added later would need a launch the graph does not hold)."""
        for k, v in pairs:
            self._layout_id(layout_of(k, v, segment_tokens, self.head_dim))
        self.frozen = True

    def _layout_id(self, lay: BlockLayout) -> int:
        """The plans row of a layout, added (with its kernel width class) when first seen."""
        if lay.key() not in self.layouts and self.frozen:
            raise RuntimeError(f"MosaicKV: layout (K {lay.k.spec}, V {lay.v.spec}) is not one "
                               f"the decode CUDA graph was captured with")
        if lay.key() not in self.layouts:
            self.layouts[lay.key()] = len(self._plans)
            self._plans.append(lay.channel_plan())
            self.plans = torch.stack(self._plans).to(self.device)
            known = set(self.width_classes)
            self.width_classes = band_width_classes(torch.stack(self._plans))  # host copy
            for widths in set(self.width_classes) - known:
                # each class is its own compile-time variant of the band decode kernel: the
                # first decode step after this line compiles it (a stall of seconds on a GPU
                # server seen only once per class: logged, so it can be told apart)
                logger.info("MosaicKV: layout %d (K %s, V %s) adds decode width class %s "
                            "(K b8/b4/b2, V b8/b4/b2 channels; %d classes): the Triton band "
                            "decode kernel compiles it at its next launch", self.layouts[lay.key()],
                            lay.k.spec, lay.v.spec, widths, len(self.width_classes))
            self.min_group = min(self.min_group, lay.k.group, lay.v.group)
            self._header_rows.append(lay.header(0, self.layouts[lay.key()]))
            self._header_table = torch.stack(self._header_rows).numpy()
        return self.layouts[lay.key()]

    def adopt(self, page: int, ap: ArenaPage) -> "StoredSegments | None":
        """One arena-ready page in (`adopt_pages`)."""
        return self.adopt_pages([page], [ap])[0]

    def adopt_pages(self, pages: list[int], aps: list[ArenaPage]) -> list["StoredSegments | None"]:
        """Arena-ready pages (daemon results, all layers each) in: a block per layer, and with
        the pack kernel one `copy_rows` launch for every page's blocks, headers and page-metadata
        rows (a launch's fixed host cost paid once a batch, not once a page). Returns each page's
        lazily made Segments, or None for a page some layer's arena has no room for (nothing of
        it stored: `store_pages` then installs `ap.segments()` per segment)."""
        bad = [p for p in pages if not 0 <= p < self._headers.shape[1]]
        if bad:  # the kernel writes rows by address: nothing may land outside the tables
            raise IndexError(f"SegmentStore: pages {bad} outside the store's "
                             f"{self._headers.shape[1]} page rows")
        if self.meta is not None and any(ap.pages is None for ap in aps):
            raise ValueError("SegmentStore: selection is on but an arena-ready page came without "
                             "page metadata")
        placed = []  # (index, page, ap, layout ids, bases, sizes)
        for i, (page, ap) in enumerate(zip(pages, aps)):
            sizes, layout_ids = self._layouts_of(ap)
            bases = self._alloc_page(sizes)
            if bases is not None:
                placed.append((i, page, ap, layout_ids, bases, sizes))
        if self.pack_kernel and placed:  # every write as a row of one `copy_rows` launch
            if self._adopt_rows is None:
                self.prepare_adoption()
            self._adopt_rows.launch([p[1:] for p in placed])
        elif placed:
            for _, page, ap, layout_ids, bases, sizes in placed:
                self._adopt_by_torch(page, ap, layout_ids, bases, sizes)
        out: list[StoredSegments | None] = [None] * len(pages)
        for i, page, ap, _, bases, sizes in placed:
            self._packed_np[:, page] = True
            self.blocks.update(zip([(layer, page) for layer in range(len(sizes))],
                                   zip(bases, sizes)))
            self.live_bytes += sum(sizes)
            self.layer_live += sizes
            out[i] = StoredSegments(self, page, ap)
        return out

    def _alloc_page(self, sizes: list[int]) -> list[int] | None:
        """A block of `sizes[layer]` bytes in every layer's arena, or None (the allocator as it
        was) when one has no room."""
        bases = []
        for layer, size in enumerate(sizes):
            base = self._alloc(layer, size)
            if base is None:  # undo this page's blocks
                for lyr, (b, n) in enumerate(zip(bases, sizes)):
                    self._free_block(lyr, b, n)
                return None
            bases.append(base)
        return bases

    def _adopt_by_torch(self, page: int, ap: ArenaPage, layout_ids: list[int], bases: list[int],
                        sizes: list[int]) -> None:
        """`adopt_pages`'s writes for one page without the pack kernel."""
        rows = torch.stack([self._header_rows[i] for i in layout_ids])
        rows[:, HDR["base16"]] = torch.tensor([b // ALIGN for b in bases], dtype=torch.int32)
        self._headers[:, page].copy_(to_device_async(rows, self.device), non_blocking=True)
        # One contiguous slice per layer (an index_copy_ over ALIGN-byte rows took 4.5 ms a
        # Llama-8B page on a CPU, plain slice copies 0.4 ms).
        src = ap.blocks.to(self.device, non_blocking=True)[:sum(sizes)].split(sizes)
        torch._foreach_copy_([data.narrow(0, base, size) for data, base, size
                              in zip(self.data, bases, sizes)], src)
        if self._meta is not None:
            tables = [getattr(self._meta, f)[:, page] for f in META_FIELDS]
            torch._foreach_copy_(tables, [getattr(ap.pages, f).to(
                self.device, t.dtype, non_blocking=True) for f, t in zip(META_FIELDS, tables)])

    def reads_host(self, scratch: torch.Tensor) -> bool:
        """Can the adoption kernel read registered host memory (`scratch`: uint8, >= 16 bytes of
        it) in place? On CUDA with the pack kernel: when the driver maps it at its host address
        (asked first: a kernel reading an unmapped address would break the context) and a copy
        of 16 bytes out of it comes back equal. Sets `host_sources` on success, and `host_rows`
        when the kernel also reads its row table from pinned host memory (checked the same way;
        a launch Triton refuses is caught and logged)."""
        if self.device_type != "cuda" or not self.pack_kernel:
            return self.host_sources
        self.prepare_adoption()
        addr = scratch.data_ptr()
        mapped = _device_address(addr)
        if mapped != addr:
            logger.warning("SegmentStore: the driver maps host address %#x at %s, not at itself: "
                           "no in-place reads of host memory", addr,
                           "nothing" if mapped is None else hex(mapped))
            return False
        pattern = torch.arange(1, 17, dtype=torch.uint8)
        scratch[:16].copy_(pattern)
        out = torch.zeros(16, dtype=torch.uint8, device=self.device)
        copy_rows(torch.tensor([[out.data_ptr(), addr, 8, COPY]], dtype=torch.int64,
                               device=self.device), 8)
        self.host_sources = torch.equal(out.cpu(), pattern)
        if not self.host_sources:
            logger.warning("SegmentStore: a copy out of mapped host memory came back different: "
                           "no in-place reads of host memory")
            return False
        out.zero_()
        table = torch.tensor([[out.data_ptr(), addr, 8, COPY]], dtype=torch.int64).pin_memory()
        try:
            copy_rows(table, 8)
            self.host_rows = torch.equal(out.cpu(), pattern)
        except Exception as exc:  # noqa: BLE001 - e.g. Triton refusing a host pointer
            logger.warning("SegmentStore: the copy kernel cannot take its row table from pinned "
                           "host memory (%s): it goes up to the device per page", exc)
        if self.host_rows:
            self._adopt_rows = AdoptRows(self)  # its staging buffers without a device copy
        return True

    def prepare_adoption(self) -> None:
        """Make the adoption's staging buffers and compile its copy kernel with one harmless
        launch (one element between two scratch slots), before serving: done at the first
        adopted page, the Triton compile cost the step it landed in ~0.3 s (a 328 ms boundary in
        a GPU server, benchmarks/RESULTS_ARCHIVE.md). Without the pack kernel, nothing to
        prepare."""
        if not self.pack_kernel or self._adopt_rows is not None:
            return
        self._adopt_rows = AdoptRows(self)
        scratch = torch.tensor([1, 0], dtype=torch.int16, device=self.device)
        copy_rows(torch.tensor([[scratch[1:].data_ptr(), scratch.data_ptr(), 1, COPY]],
                               dtype=torch.int64, device=self.device), 1)
        if scratch[1].item() != 1:  # a launch that did nothing would only show at the first page
            raise RuntimeError("SegmentStore: the adoption copy kernel's warm-up launch did not "
                               "copy its element")

    def _layouts_of(self, ap: ArenaPage) -> tuple[list[int], list[int]]:
        """(block size, layout id) of every layer of an arena-ready page, registering layouts
        the store has not seen."""
        specs = (ap.tokens, *ap.specs)
        known = self._page_layouts.get(specs)
        if known is None:
            lays = ap.layouts()
            ids = {}  # layouts are shared objects (`layout_of`): look each one up once
            for lay in lays:
                if id(lay) not in ids:
                    ids[id(lay)] = self._layout_id(lay)
            known = ([self.heads * lay.head_bytes for lay in lays],
                     [ids[id(lay)] for lay in lays])
            if len(self._page_layouts) >= 256:
                del self._page_layouts[next(iter(self._page_layouts))]
            self._page_layouts[specs] = known
        return known

    def release(self, page: int) -> None:
        for layer in range(len(self.data)):
            self.outside_bytes[layer] -= self.outside.pop((layer, page), 0)
        blocks = [self.blocks.pop((layer, page), None) for layer in range(len(self.data))]
        for layer, block in enumerate(blocks):
            if block is not None:
                self._free_block(layer, *block)
                self.live_bytes -= block[1]
                self.layer_live[layer] -= block[1]
        self._packed_np[:, page] = False  # one write for all layers
        self.unreadable.discard(page)

    def clear(self) -> None:
        self.blocks.clear()
        for allocator in self.allocators:
            allocator.clear()
        self.layer_live[:] = 0
        self.outside.clear()
        self.outside_bytes[:] = 0
        self.packed.zero_()
        self.unreadable.clear()
        self.live_bytes = 0

    @property
    def top(self) -> list[int]:
        """Each layer's bump pointer, its group's (bytes of its view below it were handed out
        at some point)."""
        return [self.allocators[g].top for g in self.group_of.tolist()]

    def page_fits(self, extra_outside: int = 0) -> "np.ndarray":
        """Per arena group, the pages (a block in each of its layers) at the largest layout
        that its free bytes hold for sure, less what the segments kept outside the arena take
        (the memory was planned for the arena) and `extra_outside` bytes taken from the plan
        elsewhere (the pool's bases past their reserve), shared by the groups as their layers:
        placing a block lowers `fits` by at most one, so a group of n layers backs fits // n
        pages."""
        fits = np.array([a.fits() for a in self.allocators], dtype=np.int64)
        outside = self.by_group(self.outside_bytes)
        if extra_outside:
            outside = outside + extra_outside * self.group_layers / self.group_layers.sum()
        fits -= -(-outside.astype(np.int64) // self.allocators[0].unit)
        return fits // self.group_layers

    def by_group(self, per_layer: np.ndarray) -> np.ndarray:
        """A per-layer quantity summed over each arena group's layers (float64)."""
        return np.bincount(self.group_of, per_layer, len(self.group_layers))

    def _free_block(self, layer: int, base: int, size: int) -> None:
        self.allocators[self.group_of[layer]].free(base, size)

    def _alloc(self, layer: int, size: int) -> int | None:
        return self.allocators[self.group_of[layer]].alloc(size)

    # ---- accounting ---------------------------------------------------------------------
    def reserved_bytes(self) -> int:
        """Physical bytes this store allocated (arenas, header tables, layout plans)."""
        meta = sum(m.nbytes() for m in self.meta) if self.meta is not None else 0
        return self._data.numel() + sum(t.numel() * t.element_size() for t in self.headers) + \
            self.plans.numel() * self.plans.element_size() + meta


class AdoptRows:
    """The `copy_rows` table that adopts arena-ready pages: per page and layer its block, its
    header row and a row per page-metadata table. Everything that does not depend on the page
    (table base pointers, row sizes, the header rows' source) is written once into a ring of
    staging buffers of up to PAGES pages each (pinned host, + device on CUDA unless the kernel
    reads the pinned one: `host_rows`); an adoption fills in its pages' addresses with a dozen
    numpy writes a page (the metadata tables' rows all at once), sends the buffer up in one copy
    (none with `host_rows`) and launches once for all its pages. A staging buffer whose last
    launch has not finished (many adoptions in one boundary) is replaced by a new one, never
    waited for: the current stream may still be running a forward."""
    RING = 4
    PAGES = 8  # pages one launch adopts (a larger batch takes several launches)

    def __init__(self, store: SegmentStore):
        self.store = store
        layers = len(store.data)
        self.layers = np.arange(layers, dtype=np.int64)
        self.arena_ptrs = np.array([d.data_ptr() for d in store.data], dtype=np.int64)
        at = self.layers * store._headers.shape[1]  # (layer, page 0) row of every page table
        self.header_dst = store._headers.data_ptr() + at * HEADER_WIDTH * 4
        tables = [] if store._meta is None else [getattr(store._meta, f) for f in META_FIELDS]
        # per metadata table: its rows' shape and dtype (what an arriving part must match), the
        # (layer, page 0) address of each layer's row [T, L] and the bytes from page to page [T]
        self.table_rows = [(tuple(t.shape[2:]), t.dtype) for t in tables]
        self.page_stride = np.array([t[0, 0].numel() * t.element_size() for t in tables],
                                    dtype=np.int64)  # a row's bytes
        self.table_dst = np.array([t.data_ptr() for t in tables], dtype=np.int64)[:, None] + \
            at[None, :] * self.page_stride[:, None]
        self.parts_seen = None  # the (dtype, shape) of the parts the staging buffers were set for
        self.kinds = 2 + len(tables)
        self.n_rows = layers * self.kinds  # a page's rows
        self.cuda = store.device_type == "cuda"
        self.host_rows = self.cuda and store.host_rows
        self.stream_device = store.data[0].device  # with its index (a fast stream lookup)
        self.ring = [self._staging() for _ in range(self.RING)]
        self.turn = 0

    def _staging(self):
        """(host int64 tensor, its device copy, rows [PAGES, kinds, L, 4] and headers
        [PAGES, L, W] as numpy views of the host tensor, the event after its last launch, the
        device rows [PAGES * R, 4])."""
        width, layers, n = HEADER_WIDTH, len(self.layers), self.PAGES
        host = torch.empty(n * (self.n_rows * 4 + layers * width // 2), dtype=torch.int64,
                           pin_memory=self.cuda)
        up = torch.empty_like(host, device=self.store.device) if self.cuda and not \
            self.host_rows else host
        rows = host[:n * self.n_rows * 4].numpy().reshape(n, self.kinds, layers, 4)
        headers = host[n * self.n_rows * 4:].view(torch.int32).numpy().reshape(n, layers, width)
        rows[..., 3] = COPY
        header_src = up.data_ptr() + n * self.n_rows * 32 + \
            (np.arange(n)[:, None] * layers + self.layers[None, :]) * width * 4
        rows[:, 1, :, 1] = header_src
        rows[:, 1, :, 2] = width * 2
        if self.parts_seen is not None:
            rows[:, 2:, :, 2:] = self.part_counts
        return [host, up, rows, headers, None, up[:n * self.n_rows * 4].view(-1, 4)]

    def _set_parts(self, parts: list[torch.Tensor]) -> None:
        """Check the metadata parts against the tables (on a new dtype/shape only: a daemon's
        results all have the same) and set what follows from them: each table's element count
        and copy kind per row, and where each layer's row starts in a part."""
        seen = [(p.dtype, tuple(p.shape)) for p in parts]
        if seen == self.parts_seen:
            return
        counts, src_offsets = [], []
        for f, part, (shape, dtype) in zip(META_FIELDS, parts, self.table_rows):
            widen = part.dtype == torch.uint8 and dtype == torch.int32
            if tuple(part.shape[1:]) != shape or not (widen or part.dtype == dtype):
                raise ValueError(f"SegmentStore: page metadata {f} {tuple(part.shape)} "
                                 f"{part.dtype} does not fit the table rows {shape} {dtype}")
            row = part[0].numel()
            counts.append((row, WIDEN) if widen else (row * part.element_size() // 2, COPY))
            src_offsets.append(self.layers * row * part.element_size())
        self.part_counts = np.array(counts, dtype=np.int64)[:, None, :]
        self.part_offsets = np.array(src_offsets, dtype=np.int64)  # [T, L]
        self.parts_seen = seen
        for stage in self.ring:
            stage[2][:, 2:, :, 2:] = self.part_counts

    def launch(self, placed: list[tuple[int, ArenaPage, list[int], list[int], list[int]]]) -> None:
        """Adopt `placed` pages, each (page, its ArenaPage, layout ids, block bases, block
        sizes), PAGES a launch."""
        for at in range(0, len(placed), self.PAGES):
            self._launch(placed[at:at + self.PAGES])

    def _launch(self, placed) -> None:
        self.turn = (self.turn + 1) % self.RING
        stage = self.ring[self.turn]
        if stage[4] is not None and not stage[4].query():
            stage = self.ring[self.turn] = self._staging()
        host, up, rows, headers, _, table = stage
        longest = 0
        for b, (page, ap, layout_ids, bases, sizes) in enumerate(placed):
            base = np.array(bases, dtype=np.int64)
            size = np.array(sizes, dtype=np.int64)
            longest = max(longest, int(size.max()))
            np.take(self.store._header_table, layout_ids, axis=0, out=headers[b])
            headers[b, :, HDR["base16"]] = base // ALIGN
            src = ap.blocks  # alive until the launch below; freed memory is reused in stream order
            self._on_device("blocks", src)
            rows[b, 0, :, 0] = self.arena_ptrs + base
            rows[b, 0, :, 1] = src.data_ptr() + np.cumsum(size) - size
            rows[b, 0, :, 2] = size // 2
            rows[b, 1, :, 0] = self.header_dst + page * HEADER_WIDTH * 4
            if self.table_rows:
                parts = [getattr(ap.pages, f) for f in META_FIELDS]
                for f, part in zip(META_FIELDS, parts):
                    self._on_device(f, part)
                self._set_parts(parts)
                rows[b, 2:, :, 0] = self.table_dst + page * self.page_stride[:, None]
                rows[b, 2:, :, 1] = np.array([p.data_ptr() for p in parts],
                                             dtype=np.int64)[:, None] + self.part_offsets
        if up is not host:
            up.copy_(host, non_blocking=True)
        copy_rows(table[:len(placed) * self.n_rows], longest // 2)
        if self.cuda:  # after the launch: reusable once the kernel read `up`, on any stream
            stage[4] = torch.cuda.Event()
            stage[4].record(torch.cuda.current_stream(self.stream_device))

    def _on_device(self, what: str, t: torch.Tensor) -> None:
        """A result's tensor must be contiguous where the kernel can read it by address: on the
        store's device, or in host memory it reads in place (`reads_host`)."""
        if not t.is_contiguous() or (t.is_cuda != self.cuda and not (
                self.store.host_sources and not t.is_cuda)):
            raise ValueError(f"SegmentStore: an arena-ready page's {what} is on {t.device} "
                             f"(contiguous: {t.is_contiguous()}); adopting by kernel needs it "
                             f"contiguous on the store's {self.store.device_type} device"
                             + ("" if self.store.host_sources else
                                " (host memory is not read in place here)"))


class StoredSegments(Sequence):
    """A stored page's Segments, one per layer, each made on first read as views of its block
    and metadata rows in the store: the decode kernels read the store directly, so only the
    reference path, prefill decompression and stats() ever make them. `source` says what the
    arena does not: an adopted `ArenaPage` (its bytes dropped), or a `SealedRecord` of a page
    installed from its sealing batches; `made`: layers given as Segments (kept outside the
    arena)."""

    def __init__(self, store: SegmentStore, page: int, source: "ArenaPage | SealedRecord",
                 made: dict[int, Segment] | None = None):
        self.store, self.page = store, page
        if isinstance(source, ArenaPage):
            # everything but the page's bytes, which now live in the store; headers (byte
            # accounting only) copied: off a daemon slot they may be views of
            source = replace(source, blocks=None, headers=source.headers.clone(), pages=None)
        self.source = source
        self.made: list[Segment | None] = [None] * len(self.store.data)
        for layer, seg in (made or {}).items():
            self.made[layer] = seg

    def __len__(self) -> int:
        return len(self.made)

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[i] for i in range(len(self))[layer]]
        if self.made[layer] is None:
            store = self.store
            pages = None if store.meta is None else PageMeta(
                store.meta[layer].channels[self.page].to(torch.uint8),
                *(getattr(store.meta[layer], f)[self.page] for f in META_FIELDS[1:]))
            base, _ = store.blocks[(layer, self.page)]
            self.made[layer] = self.source.segment(layer, store.data[layer], base, pages)
        return self.made[layer]


@dataclass(eq=False)
class _Group:
    """Segments of one install batch with the same (K try, V try) of one SegmentBatch."""
    batch: int  # index of the batch in the install
    k: Tried
    v: Tried
    layout: BlockLayout | None  # None: the kernel cannot read it (kept outside the arena)
    size: int  # block bytes (heads x head_bytes)
    layout_id: int  # the store's plans row (-1 until a segment of it is stored)
    parts: list  # `tensor_parts` of its segments


@dataclass(eq=False)
class SealedRecord:
    """What a page installed from its sealing batches keeps beside the arena, per layer: its
    install group (strategies, reasons, layout, tensor parts: shared by the install), its K
    and V errors and its codec header. `segment` makes a layer's Segment as views of its block
    (`StoredSegments`), as `ArenaPage.segment` does for adopted pages."""
    position: int
    tokens: int
    basis: int
    groups: list[_Group]
    gid: np.ndarray  # int64 [L]
    errors: np.ndarray  # float64 [L, 2] (K, V)
    headers: torch.Tensor  # int32 [L, len(HEADER_FIELDS)]

    def segment(self, layer: int, arena: torch.Tensor, base: int,
                pages: PageMeta | None) -> Segment:
        g = self.groups[self.gid[layer]]
        return block_segment(arena, base, g.layout, g.parts,
                             [(tried.strategy, float(self.errors[layer, j]), tried.reason)
                              for j, tried in enumerate((g.k, g.v))],
                             self.position, self.tokens, g.parts[0][3][0], self.basis, pages,
                             self.headers[layer])


def _device_address(addr: int) -> int | None:
    """The device address the CUDA driver gives host address `addr` (registered, mapped
    memory), or None where it gives none."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    out = ctypes.c_uint64()
    rc = cuda.cuPointerGetAttribute(ctypes.byref(out), ctypes.c_int(3),  # DEVICE_POINTER
                                    ctypes.c_uint64(addr))
    return int(out.value) if rc == 0 else None
