"""Band-encode segments on the GPU straight into their arena blocks: the `Band.encode` of
`codec/strategies/band.py` (asymmetric min/max per channel and token group, fp16 zero rounded
down and scale rounded up, codes packed along channels as `quant.pack_codes` does), written at
the offsets of each segment's header, byte for byte what `pack_layer` would store.

One launch per (layout, kind) with the band widths and token group compile-time; one program
per (segment, KV head), a token group at a time. The input is the segment already rotated into
its basis (x_rot = x @ R^-1, one batched matmul on the caller's side, as `basis.rotate`):

    pack_segments(arena, seg_list, k_rot, v_rot)    # k_rot/v_rot float32 [n, H, T, D]
    pack_layout(data, headers, seg_list, k_rot, v_rot, k_widths, v_widths)  # one layout

The serving store (`mosaickv_sglang/serving/segment_store.py`, `pack_kernel`) calls `pack_layout` per
layout of an install batch on CUDA, with the chooser's own rotated K/V.

Byte-exact with the codec on the CPU interpreter (IEEE division `div_rn`, round-half-even,
outward fp16 rounding on the bits) and on the H200 (tests/test_band_pack_kernel.py, RESULTS.md
2026-11-29). Torch on CUDA divides by a Python scalar as a multiply by its reciprocal, so
`quant.quantize_asym` divides by a device tensor: the codec's bits are the same on both devices.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import HDR, HEADER_WIDTH, PackedArena


@triton.jit
def _round_fp16(v, DOWN: tl.constexpr):
    """float32 -> fp16 never above v (DOWN) or never below v, like quant.round_fp16."""
    y = v.to(tl.float16)
    bad = (y.to(tl.float32) > v) if DOWN else (y.to(tl.float32) < v)
    bits = y.to(tl.int16, bitcast=True).to(tl.int32)
    neg = bits < 0  # sign bit (covers -0.0)
    mag = bits & 0x7FFF
    if DOWN:  # one step toward -inf
        step = tl.where(mag == 0, 0x8001, tl.where(neg, bits + 1, bits - 1))
    else:  # one step toward +inf
        step = tl.where(mag == 0, 0x0001, tl.where(neg, bits - 1, bits + 1))
    out = tl.where(bad, step, bits)
    return out.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _round_half_even(v):
    """torch.round for 0 <= v < 2^22 (float32, exact there)."""
    r = tl.floor(v + 0.5)
    tie = (r - v) == 0.5
    odd = (r.to(tl.int32) & 1) == 1
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _quantize_group(x, mw, LEVELS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr):
    """One token group's [GROUP, W] values (channels past the band masked off by `mw`) ->
    (zero fp16 [W] rounded down, scale fp16 [W] rounded up, codes float32 [GROUP, W]): the
    codec's `quantize_in_range` (IEEE division, round half to even, clamped)."""
    lo = tl.min(tl.where(mw[None, :], x, float("inf")), 0)
    hi = tl.max(tl.where(mw[None, :], x, float("-inf")), 0)
    zero = _round_fp16(tl.where(mw, lo, 0.0), True)
    span = tl.math.div_rn(tl.where(mw, hi, 0.0) - zero.to(tl.float32),
                          tl.full([W], LEVELS, tl.float32))
    scale = _round_fp16(tl.maximum(span, 1e-8), False)
    q = tl.math.div_rn(x - zero.to(tl.float32)[None, :],
                       tl.broadcast_to(scale.to(tl.float32)[None, :], [GROUP, W]))
    return zero, scale, tl.minimum(tl.maximum(_round_half_even(q), 0.0), LEVELS * 1.0)


@triton.jit
def _pack_group(c, BITS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr):
    """int32 codes [GROUP, W] -> [GROUP, W * BITS / 8] bytes (as int32), little end first along
    the channels: `quant.pack_codes`."""
    if BITS == 8:
        packed = c
    elif BITS == 4:
        a, b = tl.split(tl.reshape(c, [GROUP, W // 2, 2]))
        packed = a | (b << 4)
    else:
        ev, od = tl.split(tl.reshape(c, [GROUP, W // 4, 2, 2]))  # (k0, k2), (k1, k3)
        k0, k2 = tl.split(ev)
        k1, k3 = tl.split(od)
        packed = k0 | (k1 << 2) | (k2 << 4) | (k3 << 6)
    return packed


@triton.jit
def _encode_band(X, CODES, SCALE, ZERO, DEC, START: tl.constexpr, NB: tl.constexpr,
                 BITS: tl.constexpr, W: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr,
                 D: tl.constexpr, HAS_DEC: tl.constexpr):
    """Quantize channels [START, START + NB) of one (segment, head) [T, D] slab X, group by
    group: codes at CODES [T, NB * BITS / 8], scale and zero at SCALE / ZERO [T / GROUP, NB]
    (fp16), and (HAS_DEC) their reconstruction code * scale + zero into DEC [T, D]."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    ROW: tl.constexpr = NB * BITS // 8
    PER: tl.constexpr = 8 // BITS
    offs_w = tl.arange(0, W)
    offs_t = tl.arange(0, GROUP)
    mw = offs_w < NB
    for g in tl.static_range(T // GROUP):
        tok = g * GROUP + offs_t
        x = tl.load(X + tok[:, None] * D + START + offs_w[None, :], mask=mw[None, :], other=0.0)
        zero, scale, c = _quantize_group(x, mw, LEVELS, GROUP, W)
        if HAS_DEC:
            dec = c * scale.to(tl.float32)[None, :] + zero.to(tl.float32)[None, :]
            tl.store(DEC + tok[:, None] * D + START + offs_w[None, :], dec, mask=mw[None, :])
        packed = _pack_group(c.to(tl.int32), BITS, GROUP, W)
        offs_b = tl.arange(0, W // PER)
        tl.store(CODES + tok[:, None] * ROW + offs_b[None, :], packed.to(tl.uint8),
                 mask=(offs_b < ROW)[None, :])
        tl.store(SCALE + g * NB + offs_w, scale, mask=mw)
        tl.store(ZERO + g * NB + offs_w, zero, mask=mw)


@triton.jit
def _pack_band(X, U8, F16, hdr, CODES_COL: tl.constexpr, SCALE_COL: tl.constexpr,
               ZERO_COL: tl.constexpr, START: tl.constexpr, NB: tl.constexpr,
               BITS: tl.constexpr, W: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr,
               D: tl.constexpr):
    """`_encode_band` into the header's offsets of the head block (U8/F16), no reconstruction."""
    _encode_band(X, U8 + tl.load(hdr + CODES_COL), F16 + tl.load(hdr + SCALE_COL) // 2,
                 F16 + tl.load(hdr + ZERO_COL) // 2, X, START, NB, BITS, W, GROUP, T, D, False)


@triton.jit
def _pack_kind(
    X,  # float32 [n, H, T, D]: the kind's rotated values, segment i of SEG_LIST at row i
    ARENA_U8, ARENA_F16, HEADERS, SEG_LIST,
    SEG_OFF,  # int64 [n]: bytes added to segment i's header base (HAS_OFF), else unused
    H,
    T: tl.constexpr, D: tl.constexpr, HDR_W: tl.constexpr, BASE_COL: tl.constexpr,
    STRIDE_COL: tl.constexpr, KC: tl.constexpr, GROUP: tl.constexpr,
    N8: tl.constexpr, N4: tl.constexpr, N2: tl.constexpr,
    W8: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr, HAS_OFF: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hdr = HEADERS + tl.load(SEG_LIST + i).to(tl.int64) * HDR_W
    base = tl.load(hdr + BASE_COL).to(tl.int64) * 16 + h * tl.load(hdr + STRIDE_COL)
    if HAS_OFF:
        base += tl.load(SEG_OFF + i)
    x = X + (i * H + h) * T * D
    u8 = ARENA_U8 + base
    f16 = ARENA_F16 + base // 2
    # Header fields of a kind from its first column: b8 b4 b2 group codes8 codes4 codes2
    # scale8 zero8 scale4 zero4 scale2 zero2 (arena.KIND_FIELDS).
    if N8 > 0:
        _pack_band(x, u8, f16, hdr, KC + 4, KC + 7, KC + 8, 0, N8, 8, W8, GROUP, T, D)
    if N4 > 0:
        _pack_band(x, u8, f16, hdr, KC + 5, KC + 9, KC + 10, N8, N4, 4, W4, GROUP, T, D)
    if N2 > 0:
        _pack_band(x, u8, f16, hdr, KC + 6, KC + 11, KC + 12, N8 + N4, N2, 2, W2, GROUP, T, D)


def pack_segments(arena: PackedArena, seg_list: torch.Tensor, k_rot: torch.Tensor,
                  v_rot: torch.Tensor) -> None:
    """Encode k_rot / v_rot (float32 [n, H, T, D], in each segment's basis) into the arena
    blocks of segments `seg_list` (int32 [n]); their header rows must already hold the layout
    (`BlockLayout.header`). Band widths and groups are read from the headers on the host (one
    device sync): callers that know the layouts call `pack_layout` per layout instead."""
    n = seg_list.numel()
    _check("pack_segments", k_rot, v_rot, seg_list, arena.data,
           (n, arena.num_kv_heads, arena.segment_tokens, arena.head_dim))
    if n == 0:
        return
    hdr = arena.headers[seg_list.long()].cpu()
    classes: dict[tuple, list[int]] = {}
    for row, r in enumerate(hdr.tolist()):
        for kind in ("k", "v"):
            key = (kind,) + tuple(r[HDR[f"{kind}_{f}"]] for f in ("b8", "b4", "b2", "group"))
            classes.setdefault(key, []).append(row)
    for (kind, *widths), rows in classes.items():
        x = k_rot if kind == "k" else v_rot
        idx = torch.tensor(rows, device=arena.device)
        _launch(kind, tuple(widths), x[idx].contiguous(), arena.data, arena.headers,
                seg_list[idx].contiguous())


def pack_layout(data: torch.Tensor, headers: torch.Tensor, seg_list: torch.Tensor,
                k_rot: torch.Tensor, v_rot: torch.Tensor, k_widths: tuple[int, int, int, int],
                v_widths: tuple[int, int, int, int],
                seg_offset: torch.Tensor | None = None) -> None:
    """`pack_segments` for segments of one layout whose widths the caller knows (the serving
    store: it groups an install batch by layout on the host anyway): two launches (K, V), no
    read-back of the headers. data: the uint8 arena; headers: its int32 [rows, HEADER_WIDTH]
    table, rows `seg_list` already written; widths: (b8, b4, b2 channels, token group).
    `seg_offset` (int64 [n], optional): bytes added to each segment's header base, so one
    launch pair can fill several arenas laid end to end in `data` (the store's layers: header
    rows of every layer in one table, each segment offset by its layer's start)."""
    _check("pack_layout", k_rot, v_rot, seg_list, data, (seg_list.numel(), *k_rot.shape[1:]))
    if headers.dtype != torch.int32 or headers.dim() != 2 or headers.shape[1] != HEADER_WIDTH:
        raise ValueError(f"pack_layout: headers must be int32 [rows, {HEADER_WIDTH}], got "
                         f"{headers.dtype} {tuple(headers.shape)}")
    if seg_offset is not None and (seg_offset.dtype != torch.int64 or
                                   tuple(seg_offset.shape) != (seg_list.numel(),) or
                                   seg_offset.device != data.device):
        raise ValueError(f"pack_layout: seg_offset must be int64 [{seg_list.numel()}] on "
                         f"{data.device}, got {seg_offset.dtype} {tuple(seg_offset.shape)}")
    if seg_list.numel():
        _launch("k", k_widths, k_rot, data, headers, seg_list, seg_offset)
        _launch("v", v_widths, v_rot, data, headers, seg_list, seg_offset)


def _check(who: str, k_rot: torch.Tensor, v_rot: torch.Tensor, seg_list: torch.Tensor,
           data: torch.Tensor, shape: tuple) -> None:
    for name, t in (("k_rot", k_rot), ("v_rot", v_rot)):
        if t.dtype != torch.float32 or tuple(t.shape) != tuple(shape) or not t.is_contiguous() \
                or t.device != data.device:
            raise ValueError(f"{who}: {name} must be contiguous float32 {list(shape)} on "
                             f"{data.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if seg_list.dtype != torch.int32 or seg_list.dim() != 1 or seg_list.device != data.device:
        raise ValueError(f"{who}: seg_list must be int32 [n] on {data.device}")
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() % 2:
        raise ValueError(f"{who}: the arena must be 1-D uint8 of even size")


def _constants(kind: str, widths: tuple, t: int, d: int, has_off: bool = False) -> dict:
    """`_pack_kind`'s compile-time arguments for one (kind, widths) at T tokens and head_dim D:
    what a launch passes and what `compile_variants` compiles ahead."""
    n8, n4, n2, group = widths
    if t % group:
        raise ValueError(f"band_pack: token group {group} does not divide {t}")
    return dict(T=t, D=d, HDR_W=HEADER_WIDTH, BASE_COL=HDR["base16"],
                STRIDE_COL=HDR["head_stride"], KC=HDR[f"{kind}_b8"], GROUP=group, N8=n8, N4=n4,
                N2=n2, W8=max(16, triton.next_power_of_2(max(n8, 1))),
                W4=max(16, triton.next_power_of_2(max(n4, 1))),
                W2=max(16, triton.next_power_of_2(max(n2, 1))), HAS_OFF=has_off, num_warps=4)


def _launch(kind: str, widths: tuple, x: torch.Tensor, data: torch.Tensor, headers: torch.Tensor,
            seg_list: torch.Tensor, seg_offset: torch.Tensor | None = None) -> None:
    """One `_pack_kind` launch: x [n, H, T, D] float32 contiguous, row i for segment seg_list[i],
    all of band widths `widths` = (b8, b4, b2, group)."""
    n, h, t, d = x.shape
    _pack_kind[(n, h)](x, data, data.view(torch.float16), headers, seg_list,
                       seg_list if seg_offset is None else seg_offset, h,
                       **_constants(kind, widths, t, d, seg_offset is not None))


def compile_variants(variants, heads: int, tokens: int, head_dim: int) -> int:
    """Compile `_pack_kind` for every (kind, (b8, b4, b2, group)) in `variants` now, with the
    argument types and specializations the serving store's launches have (per-segment offsets:
    `SegmentStore._pack`) (Triton's `warmup`: nothing runs, nothing
    is allocated), so that the first page sealed in a layout does not stall a live step on a
    compile (seconds each on the H200). CUDA only. Returns how many were asked for."""
    variants = list(dict.fromkeys(variants))
    for kind, widths in variants:
        _pack_kind.warmup(torch.float32, torch.uint8, torch.float16, torch.int32, torch.int32,
                          torch.int64, heads, grid=(1, heads),
                          **_constants(kind, widths, tokens, head_dim, has_off=True))
    return len(variants)
