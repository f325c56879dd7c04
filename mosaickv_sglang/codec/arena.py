"""Packed, kernel-friendly layout of one layer for a batch: the bytes a GPU decode kernel reads.

One uint8 arena holds every sealed segment's K and V band data, exactly the tensors `Band.encode`
produced, laid out per segment and per KV head so that one kernel program reads one
(segment, head) block contiguously:

    arena (uint8)
    ├─ segment s0 ─ head 0: [K codes8|codes4|codes2|scale8|zero8|scale4|zero4|scale2|zero2]
    │                       [V codes8|...]
    │             ─ head 1: [...]            (every part starts on a 16-byte boundary)
    ├─ segment s1 ─ ...                      (any mix of band layouts, one per segment)

An int32 header row per segment (`HEADER_FIELDS`) says how to read it: tokens, where its block
starts (in 16-byte units), the per-head stride, its layout id, and per kind (K, V) the band widths
b8/b4/b2, the token group and the byte offset of each part inside a head block. Each distinct
layout also gets a per-channel read plan (`BlockLayout.channel_plan`: byte offset, shift and mask
of every channel's code, offsets of its scale and zero), so a kernel loads the plan rather than
re-deriving it per block. Per-request segment lists are CSR (`seg_indptr` [B+1], `seg_ids`).
The request's bases (one basis block per request in this version, as float32 copies of the
stored read transforms, transposed) and its dense hot buffer (padded bf16) ride along. Band widths in headers and plans are
channel counts at the layer's head_dim (a spec's widths are per 64 channels).

Only `band` strategies in the SVD basis are packed: a sink segment stored with `lowbit` or `dense`
(the default sink candidate is lowbit in the raw basis) is rejected with the config change that
makes it packable.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from .basis import kernel_transform
from .layer import Choice, CompressedLayer, Segment
from .pages import PageMeta
from .quant import SCALE_DTYPE
from .strategies import Encoded, Strategy, parse_strategy
from .strategies.band import BAND_BITS, Band

# The layout the kernels read is defined beside them (triton_kernels/layout.py), re-exported.
from mosaickv_kernels.layout import (  # noqa: F401
    ALIGN, HDR, HEADER_FIELDS, HEADER_WIDTH, KIND_FIELDS, MAX_ARENA_BYTES, PLAN_FIELDS,
    PackedArena, _nbytes)

if TYPE_CHECKING:
    from .seal import BasisPair, SealedPage

def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def packable(seg: Segment, page_tokens: int) -> bool:
    """The kernel reads K and V as rotated bands whose token groups hold whole pages."""
    return all(isinstance(c.strategy, Band) and c.strategy.rot and c.strategy.group % page_tokens == 0
               for c in (seg.k, seg.v))


def band_channels(band: Band, head_dim: int) -> dict[int, int]:
    """bits -> channels of each band at `head_dim` (0 for an empty band)."""
    band.validate_dims(head_dim)
    out = dict.fromkeys(BAND_BITS, 0)
    out.update({bits: n for _, n, bits in band.bands(head_dim)})
    return out


def band_parts(band: Band, tokens: int, head_dim: int) -> list[tuple[str, int]]:
    """(part name, bytes) per head for one kind, in arena order; empty bands have no parts."""
    if tokens % band.group:
        raise ValueError(f"segment of {tokens} tokens is not a multiple of {band.spec} group")
    codes, scales = [], []
    for bits, n in band_channels(band, head_dim).items():
        if n:
            codes.append((f"codes{bits}", tokens * n * bits // 8))
            scales += [(f"scale{bits}", tokens // band.group * n * 2),
                       (f"zero{bits}", tokens // band.group * n * 2)]
    return codes + scales


@dataclass(frozen=True)
class BlockLayout:
    """Byte layout of one (segment, head) block for a (K band, V band, tokens, head_dim)."""
    k: Band
    v: Band
    tokens: int
    head_dim: int
    offsets: dict[str, int]  # 'k.codes8' -> byte offset inside the head block
    sizes: dict[str, int]  # 'k.codes8' -> bytes
    head_bytes: int  # aligned size of one head block (the per-head stride)

    @classmethod
    def of(cls, k: Band, v: Band, tokens: int, head_dim: int) -> "BlockLayout":
        offsets, sizes, pos = {}, {}, 0
        for kind, band in (("k", k), ("v", v)):
            for name, nbytes in band_parts(band, tokens, head_dim):
                offsets[f"{kind}.{name}"], sizes[f"{kind}.{name}"] = pos, nbytes
                pos = _align(pos + nbytes)
        return cls(k, v, tokens, head_dim, offsets, sizes, max(pos, ALIGN))

    def payload_bytes(self) -> tuple[int, int]:
        """(code bytes, scale bytes) per head, without alignment padding."""
        codes = sum(n for name, n in self.sizes.items() if ".codes" in name)
        return codes, sum(self.sizes.values()) - codes

    def key(self) -> tuple[str, str, int, int]:
        return self.k.spec, self.v.spec, self.tokens, self.head_dim

    def channel_plan(self) -> torch.Tensor:
        """int32 [2 (K, V), len(PLAN_FIELDS), head_dim]: for each channel of the rotated basis,
        where its code of token 0 lives (byte offset in the head block), the row stride in bytes,
        the bit shift and mask inside the byte (mask 0: channel dropped), the byte offsets of its
        group-0 scale and zero, and the bytes per token group of its band. The kernel loads
        this instead of re-deriving it from the band widths on every block."""
        plan = torch.zeros(2, len(PLAN_FIELDS), self.head_dim, dtype=torch.int32)
        for k, (kind, band) in enumerate((("k", self.k), ("v", self.v))):
            for start, n, bits in band.bands(self.head_dim):
                per_byte = 8 // bits
                j = torch.arange(n)
                c = slice(start, start + n)
                plan[k, 0, c] = self.offsets[f"{kind}.codes{bits}"] + j // per_byte
                plan[k, 1, c] = n * bits // 8
                plan[k, 2, c] = (j % per_byte) * bits
                plan[k, 3, c] = (1 << bits) - 1
                plan[k, 4, c] = self.offsets[f"{kind}.scale{bits}"] + 2 * j
                plan[k, 5, c] = self.offsets[f"{kind}.zero{bits}"] + 2 * j
                plan[k, 6, c] = 2 * n
        return plan

    def header(self, base: int, layout_id: int = 0) -> torch.Tensor:
        """int32 [HEADER_WIDTH] for a segment whose block starts at byte `base`."""
        return self.headers([base], layout_id)[0]

    def headers(self, bases: list[int], layout_id: int = 0) -> torch.Tensor:
        """int32 [len(bases), HEADER_WIDTH]: `header` of each base, built from one row."""
        for base in bases:
            if base % ALIGN or base > MAX_ARENA_BYTES:
                raise ValueError(f"segment base {base} must be a multiple of {ALIGN} below "
                                 f"{MAX_ARENA_BYTES} (int32 header in {ALIGN}-byte units)")
        row = [0] * HEADER_WIDTH  # built in Python: one tensor op for all rows, not one per field
        row[HDR["tokens"]] = self.tokens
        row[HDR["head_stride"]], row[HDR["layout"]] = self.head_bytes, layout_id
        for kind, band in (("k", self.k), ("v", self.v)):
            for bits, n in band_channels(band, self.head_dim).items():
                row[HDR[f"{kind}_b{bits}"]] = n
            row[HDR[f"{kind}_group"]] = band.group
            for part in KIND_FIELDS[4:]:
                row[HDR[f"{kind}_{part}"]] = self.offsets.get(f"{kind}.{part}", 0)
        rows = [list(row) for _ in bases]
        for r, base in zip(rows, bases):
            r[HDR["base16"]] = base // ALIGN
        return torch.tensor(rows, dtype=torch.int32).reshape(len(bases), HEADER_WIDTH)


def write_blocks(blocks: torch.Tensor, lay: BlockLayout, segs: list) -> None:
    """Copy M segments' K and V band tensors into their (segment, head) blocks (`blocks` uint8
    [M, H, lay.head_bytes]) at the layout's offsets: one copy per part for all M. Shared by
    `pack_layer` and the serving store."""
    m, h = blocks.shape[:2]
    if m != len(segs):
        raise ValueError(f"write_blocks: {m} blocks for {len(segs)} segments")
    for kind in ("k", "v"):
        for name in getattr(segs[0], kind).encoded.tensors:
            key = f"{kind}.{name}"
            parts = [getattr(seg, kind).encoded.tensors[name] for seg in segs]
            for t in parts:
                check_part(lay, key, t, h)
            write_part(blocks, lay, key, parts[0][None] if m == 1 else torch.stack(parts))


def check_part(lay: BlockLayout, key: str, t: torch.Tensor, heads: int) -> None:
    """One segment's K/V tensor `key` ("k.codes8", ...; [H, ...]) as `lay` stores it: codes
    uint8, scales and zeros SCALE_DTYPE, and the layout's bytes per head."""
    want = torch.uint8 if key.split(".", 1)[1].startswith("codes") else SCALE_DTYPE
    if t.dtype != want:
        raise ValueError(f"pack_layer: {key} is {t.dtype}, expected {want}")
    if t.numel() * t.element_size() != heads * lay.sizes[key]:
        raise ValueError(f"pack_layer: {key} holds {t.numel() * t.element_size() / heads:g}"
                         f" bytes per head, layout expects {lay.sizes[key]}")


def write_part(blocks: torch.Tensor, lay: BlockLayout, key: str, src: torch.Tensor) -> None:
    """Tensor `key` of M segments (`src` [M, H, ...], checked by `check_part`) into their
    (segment, head) blocks (`blocks` uint8 [M, H, lay.head_bytes]) at the layout's offset."""
    m, h = blocks.shape[:2]
    blocks[:, :, lay.offsets[key]:lay.offsets[key] + lay.sizes[key]].copy_(
        src.contiguous().view(torch.uint8).reshape(m, h, -1))


def block_segment(arena: torch.Tensor, base: int, lay: BlockLayout, parts: list,
                  kinds: list[tuple[Strategy, float, str]], position: int, tokens: int,
                  heads: int, basis: int, pages: PageMeta | None, header: torch.Tensor) -> Segment:
    """A Segment whose K and V tensors are views of the block at byte `base` of `arena` (its
    `tensor_parts` `parts`; `kinds`: K's and V's (strategy, error, reason)): how a stored page's
    segments are made on read (`ArenaPage.segment`, the serving store's `SealedRecord`)."""
    views = block_views(arena, [base], lay, parts)[0]
    choices = [Choice(strat, Encoded(kind, (heads, tokens, lay.head_dim),
                                     {name: t for (kd, name), t in views.items() if kd == kind}),
                      err, reason)
               for kind, (strat, err, reason) in zip(("k", "v"), kinds)]
    return Segment(position, tokens, choices[0], choices[1], basis, pages, pages is not None,
                   header)


def tensor_parts(seg) -> list[tuple[str, str, torch.dtype, tuple[int, ...]]]:
    """(kind, name, dtype, shape) of a segment's K and V tensors: what `block_views` rebuilds."""
    return [(kind, name, t.dtype, tuple(t.shape)) for kind, choice in (("k", seg.k), ("v", seg.v))
            for name, t in choice.encoded.tensors.items()]


def block_views(arena: torch.Tensor, bases: list[int], lay: BlockLayout,
                parts: list) -> list[dict[tuple[str, str], torch.Tensor]]:
    """Per segment (of one layout, its block at byte `bases[i]` of the 1-D uint8 `arena`), per
    (kind, name) of `parts` (`tensor_parts`), a view of where `write_blocks` put that tensor (its
    first dim the heads), with the tensor's dtype and shape: one `as_strided` each, as this runs
    for every part of every sealed segment."""
    typed = {torch.uint8: arena}
    plan = []  # (kind, name, typed arena, shape, strides, byte offset, element size)
    for kind, name, dtype, shape in parts:
        if dtype not in typed:
            typed[dtype] = arena.view(dtype)
        size = dtype.itemsize
        plan.append((kind, name, typed[dtype], shape,
                     _contiguous_strides(shape[1:], lay.head_bytes // size),
                     lay.offsets[f"{kind}.{name}"], size))
    # as_strided's offset counts from the storage's start: `arena` may be a view (one layer of
    # the store's [layers, bytes] arena), so its own offset is added
    return [{(kind, name): typed_arena.as_strided(
        shape, strides, typed_arena.storage_offset() + (base + off) // size)
        for kind, name, typed_arena, shape, strides, off, size in plan} for base in bases]


def _contiguous_strides(shape, outer: int) -> tuple[int, ...]:
    """Strides of [outer-strided dim, *shape] with `shape` contiguous."""
    strides, n = [], 1
    for dim in reversed(shape):
        strides.append(n)
        n *= dim
    return (outer, *reversed(strides))


@lru_cache(maxsize=None)
def layout_of(k_spec: str, v_spec: str, tokens: int, head_dim: int) -> BlockLayout:
    """The BlockLayout of two band specs (parsed once: adopting a page looks up every layer's)."""
    return BlockLayout.of(parse_strategy(k_spec), parse_strategy(v_spec), tokens, head_dim)


META_FIELDS = ("channels", "lo", "hi", "rest_norm")


@dataclass
class ArenaPage:
    """A sealed page in the bytes the serving store keeps (what a daemon worker sends back):
    every layer's (segment, head) blocks back to back in `blocks`, exactly as `write_blocks`
    lays them into the arena (padding zeroed), and the per-layer tables stacked over layers. So
    the scheduler adopts it with one arena copy and one write per table
    (`SegmentStore.adopt`), not ~400 per-tensor objects; Segments are made only when read."""
    position: int
    heads: int
    tokens: int
    head_dim: int
    nbytes: int  # SealedPage.nbytes of the page
    bases: BasisPair
    specs: list[tuple[str, str]]  # per layer: K and V band spec
    choices: list[tuple[float, float, str, str]]  # per layer: K, V error; K, V reason
    parts: dict[tuple[str, str], list]  # (K spec, V spec) -> its `tensor_parts`
    blocks: torch.Tensor  # uint8 [sum over layers of heads * head_bytes]
    headers: torch.Tensor  # int32 [L, len(layer.HEADER_FIELDS)]: the segments' codec headers
    pages: PageMeta | None  # page metadata, every field stacked over layers ([L, ...])

    def copy_to(self, device) -> "ArenaPage":
        """This page with its bytes and tables copied onto `device` (its bases as they are): a
        page read in place from a daemon slot that must outlive the slot."""
        move = lambda t: t.to(device, non_blocking=True, copy=True)  # noqa: E731
        pages = None if self.pages is None else PageMeta(
            *(move(getattr(self.pages, f)) for f in META_FIELDS))
        return replace(self, blocks=move(self.blocks), headers=move(self.headers), pages=pages)

    def layouts(self) -> list[BlockLayout]:
        return [layout_of(k, v, self.tokens, self.head_dim) for k, v in self.specs]

    def kinds(self) -> list[tuple[str, str, str]]:
        """(kind, strategy spec, chooser reason) of every layer's K and V (pool counters)."""
        return [(kind, spec, reason) for (k, v), (_, _, kr, vr) in zip(self.specs, self.choices)
                for kind, spec, reason in (("k", k, kr), ("v", v, vr))]

    def segment(self, layer: int, arena: torch.Tensor, base: int,
                pages: PageMeta | None) -> Segment:
        """Layer `layer`'s Segment, its tensors views of the block at byte `base` of `arena`."""
        lay = layout_of(*self.specs[layer], self.tokens, self.head_dim)
        k_err, v_err, k_reason, v_reason = self.choices[layer]
        return block_segment(arena, base, lay, self.parts[self.specs[layer]],
                             [(lay.k, k_err, k_reason), (lay.v, v_err, v_reason)],
                             self.position, self.tokens, self.heads, 0, pages,
                             self.headers[layer])

    def segments(self) -> list[Segment]:
        """Every layer's Segment as views of this page's own bytes (a page the arena has no room
        for keeps them; `SegmentStore.install_pages` then gives them their own storage)."""
        out, base = [], 0
        for layer, lay in enumerate(self.layouts()):
            pages = None if self.pages is None else PageMeta(
                *(getattr(self.pages, f)[layer] for f in META_FIELDS))
            out.append(self.segment(layer, self.blocks, base, pages))
            base += self.heads * lay.head_bytes
        return out


def pack_page(page: SealedPage, page_tokens: int) -> ArenaPage | None:
    """A sealed page as an ArenaPage (`write_blocks` per layer into one zeroed buffer), or None
    when a segment is not one the arena holds (`packable`: e.g. a dense fallback)."""
    segs = page.segments
    if not all(packable(seg, page_tokens) for seg in segs):
        return None
    heads, tokens, head_dim = segs[0].k.encoded.shape
    lays = [layout_of(seg.k.strategy.spec, seg.v.strategy.spec, seg.tokens, head_dim)
            for seg in segs]
    blocks = torch.zeros(sum(heads * lay.head_bytes for lay in lays), dtype=torch.uint8)
    base, parts = 0, {}
    for seg, lay in zip(segs, lays):
        n = heads * lay.head_bytes
        write_blocks(blocks[base:base + n].view(1, heads, lay.head_bytes), lay, [seg])
        parts.setdefault((seg.k.strategy.spec, seg.v.strategy.spec), tensor_parts(seg))
        base += n
    meta = None if segs[0].pages is None else PageMeta(
        *(torch.stack([getattr(seg.pages, f) for seg in segs]) for f in META_FIELDS))
    return ArenaPage(page.position, heads, tokens, head_dim, page.nbytes, page.bases,
                     [(seg.k.strategy.spec, seg.v.strategy.spec) for seg in segs],
                     [(seg.k.error, seg.v.error, seg.k.reason, seg.v.reason) for seg in segs],
                     parts, blocks, torch.stack([seg.header for seg in segs]), meta)


def _check_segment(i: int, b: int, seg, page_tokens: int, basis: int) -> tuple[Band, Band]:
    where = f"request {b}, segment {i} (tokens {seg.start}..{seg.start + seg.tokens})"
    bands = []
    for kind, choice in (("K", seg.k), ("V", seg.v)):
        strat = choice.strategy
        if not isinstance(strat, Band):
            hint = ("use a band sink, e.g. sink_candidates=['band:b8=64,b4=0,b2=0,group=32'] "
                    "(8 bits on every channel), or sink_segments=0" if choice.reason == "sink" else
                    "keep only band specs in k_candidates/v_candidates and raise the error "
                    "budget so no segment falls back to dense")
            raise ValueError(f"pack_layer: {where}: {kind} is stored as '{strat.spec}' "
                             f"({choice.reason}); the packed kernel reads only 'band' segments: "
                             f"{hint}")
        if not strat.rot:
            raise ValueError(f"pack_layer: {where}: {kind} band '{strat.spec}' has rot=0; the "
                             f"kernel reads every segment in its request's basis (use rot=1)")
        if strat.group % page_tokens:
            raise ValueError(f"pack_layer: {where}: {kind} band group={strat.group} is not a "
                             f"multiple of page_tokens={page_tokens} (a page must sit in one "
                             f"token group)")
        bands.append(strat)
    if seg.basis != basis:
        raise ValueError(f"pack_layer: {where} uses basis block {seg.basis}, but this version "
                         f"supports one basis block per request (block {basis}); keep the "
                         f"context within basis_block_tokens")
    return bands[0], bands[1]


def pack_layer(layers: list[CompressedLayer], page_tokens: int = 32) -> PackedArena:
    """One CompressedLayer per request (same KV heads and head_dim) -> PackedArena (on CPU).

    Every sealed segment must store K and V with `band` strategies in the SVD basis (any mix of
    band layouts), of one segment size, with token groups that are multiples of `page_tokens`,
    and each request must use a single basis block. Errors name the request, the segment and
    the fix. Move the result with `.to(device)`.
    """
    if not layers:
        raise ValueError("pack_layer: need at least one CompressedLayer (one per request)")
    h, _, d = layers[0].hot_k.shape
    seg_tokens = None
    plan = []  # (request, segment, BlockLayout)
    for b, layer in enumerate(layers):
        if layer.hot_k is None or layer.hot_k.shape[0] != h or layer.hot_k.shape[2] != d:
            raise ValueError(f"pack_layer: request {b} has hot buffer "
                             f"{None if layer.hot_k is None else tuple(layer.hot_k.shape)}; "
                             f"expected [{h}, T, {d}] like request 0")
        basis = layer.segments[0].basis if layer.segments else 0
        for i, seg in enumerate(layer.segments):
            kb, vb = _check_segment(i, b, seg, page_tokens, basis)
            seg_tokens = seg.tokens if seg_tokens is None else seg_tokens
            if seg.tokens != seg_tokens or seg.tokens % page_tokens:
                raise ValueError(f"pack_layer: request {b}, segment {i} has {seg.tokens} tokens; "
                                 f"all segments must have the same size ({seg_tokens}), a "
                                 f"multiple of page_tokens={page_tokens}")
            if seg.k.encoded.shape != (h, seg.tokens, d):
                raise ValueError(f"pack_layer: request {b}, segment {i} K shape "
                                 f"{seg.k.encoded.shape} != {(h, seg.tokens, d)}")
            plan.append((b, seg, BlockLayout.of(kb, vb, seg.tokens, d)))

    # Offsets first (exact size), then one allocation and the copies.
    bases, pos = [], 0
    for _, _, lay in plan:
        bases.append(pos)
        pos += h * lay.head_bytes
    data = torch.zeros(_align(max(pos, 1)), dtype=torch.uint8)
    headers = torch.zeros(len(plan), HEADER_WIDTH, dtype=torch.int32)
    layout_ids: dict[tuple, int] = {}
    plans = []
    payload = {"codes": 0, "scales": 0}
    for n, ((_, seg, lay), base) in enumerate(zip(plan, bases)):
        if lay.key() not in layout_ids:
            layout_ids[lay.key()] = len(plans)
            plans.append(lay.channel_plan())
        headers[n] = lay.header(base, layout_ids[lay.key()])
        codes, scales = lay.payload_bytes()
        payload["codes"] += h * codes
        payload["scales"] += h * scales
        write_blocks(data[base:base + h * lay.head_bytes].view(1, h, lay.head_bytes), lay, [seg])

    counts = torch.tensor([len(layer.segments) for layer in layers], dtype=torch.int32)
    seg_indptr = torch.zeros(len(layers) + 1, dtype=torch.int32)
    seg_indptr[1:] = counts.cumsum(0)
    k_basis = torch.empty(len(layers), h, d, d)
    v_basis = torch.empty(len(layers), h, d, d)
    for b, layer in enumerate(layers):
        blk = layer.segments[0].basis if layer.segments else None
        eye = torch.eye(d).expand(h, d, d)
        # The wrapper reads q @ k_basis and o_rot @ v_basis^T, i.e. q R^T and o_rot R.
        k_basis[b] = eye if blk is None else kernel_transform(layer.k_bases[blk])
        v_basis[b] = eye if blk is None else kernel_transform(layer.v_bases[blk])
    hot_lens = torch.tensor([layer.hot_k.shape[1] for layer in layers], dtype=torch.int32)
    t_max = max(int(hot_lens.max()), 1)
    hot_k = torch.zeros(len(layers), h, t_max, d, dtype=torch.bfloat16)
    hot_v = torch.zeros_like(hot_k)
    for b, layer in enumerate(layers):
        hot_k[b, :, :layer.hot_k.shape[1]] = layer.hot_k
        hot_v[b, :, :layer.hot_v.shape[1]] = layer.hot_v
    return PackedArena(data, headers, seg_indptr, torch.arange(len(plan), dtype=torch.int32),
                       k_basis, v_basis, hot_k, hot_v, hot_lens,
                       torch.stack(plans) if plans else
                       torch.zeros(1, 2, len(PLAN_FIELDS), d, dtype=torch.int32),
                       segment_tokens=seg_tokens or page_tokens, page_tokens=page_tokens,
                       payload=payload,
                       min_group=min([min(lay.k.group, lay.v.group) for _, _, lay in plan],
                                     default=page_tokens))
