"""Split-KV decode attention read straight from the packed band arena (`codec/arena.py`).

Stage 1, one program per (request, KV head, split), all G query heads of the KV head together:
walk the split's share of the request's tokens (blocks of 64/128 tokens, or the selected
32-token pages), read the codes and the fp16 scale/zero of each band, score on the codes,
    q.k = sum_bands (q * scale) . codes + q . zero          (lowbit.channel_groups_qk)
and accumulate p.v in the V basis the same way (p . codes) * scale + sum(p) * zero, never
building a dense K or V tile. Band widths are compile-time constants of a launch: one launch per
distinct (K, V) width set of the arena's layouts (`band_width_classes`), each skipping the
segments of other widths, so every band of a unit is one contiguous [tokens, row bytes] tile
(vector loads) unpacked in registers; offsets and token groups come from the segment header.
With plan(exact=True) products run on bf16 tensor cores with q*scale and p split in two bf16
halves (`common.dot_exact`): scores match the float32 reference to ~1e-5. With exact=False each
tile is dequantized to fp16 in its load layout and each product is one fp16 MMA (~1e-3 vs the
reference, fewer registers: 147 vs 255+spills per thread for a 32-token page, ptxas sm_90).
Stage 2, one program per (request, KV head): log-sum-exp merge of all launches' splits and of
the dense hot-buffer partial; it writes the two normalized parts (rotated, raw), and the wrapper's
out = o_hot + o_rot @ V_basis^T puts them in one basis. q's rotation into the K basis is one
batched matmul in the wrapper. This version supports one basis block per request.

    wrapper = BandDecodeWrapper()
    wrapper.plan(arena, num_qo_heads=32)          # once per batch step: splits, workspace
    ids, counts = wrapper.select(q, arena, meta, budget_pages=128, sink_pages=2, recent_pages=8)
    out = wrapper.run(q, arena, page_ids=ids, page_counts=counts)   # per layer
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import HDR, HEADER_WIDTH, KIND_FIELDS, PLAN_FIELDS, PackedArena

from .common import dot_exact, dot_fp16, interpreting
from .basis_rotate import rotate_rows
from .class_partition import class_partition
from .dense_decode import dense_decode_partial
from .page_rescore import page_rescore
from .page_select import PackedPageMeta, RowSelection, page_bounds, select_page_list

PAGE_TOKENS = 32
MIN_PAGES_PER_SPLIT = 4
MAX_SPLITS = 64
PROGRAMS_PER_SM = 8  # target (request, head, split) programs per SM when choosing splits
# Stage 1 reads a kind's header fields at fixed offsets from its first column (KC / VC).
assert KIND_FIELDS[:13] == ("b8", "b4", "b2", "group", "codes8", "codes4", "codes2", "scale8",
                            "zero8", "scale4", "zero4", "scale2", "zero2")


@triton.jit
def _band_codes(U8, tok, BITS: tl.constexpr, ROW: tl.constexpr, RB: tl.constexpr):
    """Codes [N, RB * 8 // BITS] (int32) of one band for the tokens `tok`: the band's rows are
    ROW contiguous bytes per token, loaded as [N, RB] (RB >= ROW, a power of two, padding 0)
    and unpacked in channel order (code j of a row sits in byte j*BITS//8 at shift
    (j % (8//BITS))*BITS, as quant.pack_codes writes it)."""
    offs_b = tl.arange(0, RB)
    VEC: tl.constexpr = min(ROW & -ROW, 16)  # the mask is constant over VEC-byte vectors
    raw = tl.load(U8 + tok[:, None] * ROW + offs_b[None, :],
                  mask=(offs_b // VEC * VEC)[None, :] < ROW, other=0).to(tl.int32)
    if BITS == 8:
        codes = raw
    elif BITS == 4:
        codes = tl.interleave(raw & 15, raw >> 4)
    else:
        codes = tl.interleave(tl.interleave(raw & 3, (raw >> 4) & 3),
                              tl.interleave((raw >> 2) & 3, raw >> 6))
    return codes


@triton.jit
def _band_scales(F16, off, grp, NB: tl.constexpr, W: tl.constexpr):
    """fp16 scale (or zero) row [W] of token group `grp` of a band of NB channels whose group-0
    row starts at byte `off` of the head block (F16 points at the head block)."""
    offs_w = tl.arange(0, W)
    return tl.load(F16 + off // 2 + grp * NB + offs_w, mask=offs_w < NB, other=0.0).to(tl.float32)


@triton.jit
def _band_load(U8, F16, hdr, tok, grp, CODES_COL: tl.constexpr, SCALE_COL: tl.constexpr,
               ZERO_COL: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
               EXACT: tl.constexpr):
    """Codes [N, W] of one band of one unit (int32 if EXACT, else dequantized to fp16), and its
    scale [W], zero [W] (float32); zeros for an empty band. The byte offsets of its parts come
    from the segment header row `hdr`."""
    if NB > 0:
        codes = _band_codes(U8 + tl.multiple_of(tl.load(hdr + CODES_COL), 16), tok, BITS,
                            NB * BITS // 8, W * BITS // 8)
        sc = _band_scales(F16, tl.load(hdr + SCALE_COL), grp, NB, W)
        zr = _band_scales(F16, tl.load(hdr + ZERO_COL), grp, NB, W)
        if not EXACT:  # dequantized here, in the tile's own layout: no scale vectors later
            codes = (codes.to(tl.float32) * sc[None, :] + zr[None, :]).to(tl.float16)
    else:
        codes = tl.zeros([tok.shape[0], W], tl.int32 if EXACT else tl.float16)
        sc = tl.zeros([W], tl.float32)
        zr = tl.zeros([W], tl.float32)
    return codes, sc, zr


@triton.jit
def _kind_load(U8, F16, hdr, tok, grp, COL: tl.constexpr, B8: tl.constexpr, B4: tl.constexpr,
               B2: tl.constexpr, W8: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr,
               EXACT: tl.constexpr):
    """The 8-, 4- and 2-bit bands of one kind (K or V; its header fields start at COL, in
    arena.KIND_FIELDS order): (codes, scale, zero) of each, via `_band_load`."""
    c8, s8, z8 = _band_load(U8, F16, hdr, tok, grp, COL + 4, COL + 7, COL + 8, B8, 8, W8, EXACT)
    c4, s4, z4 = _band_load(U8, F16, hdr, tok, grp, COL + 5, COL + 9, COL + 10, B4, 4, W4, EXACT)
    c2, s2, z2 = _band_load(U8, F16, hdr, tok, grp, COL + 6, COL + 11, COL + 12, B2, 2, W2, EXACT)
    return c8, s8, z8, c4, s4, z4, c2, s2, z2


@triton.jit
def _score_band(q_band, codes, sc, zr, EXACT: tl.constexpr, EMULATE: tl.constexpr):
    """q . k over one K band -> [G, N]: exact, (q * scale) . codes + q . zero on the integer
    codes; else one fp16 MMA on the dequantized tile (`_band_load`)."""
    if EXACT:
        s = dot_exact(q_band * sc[None, :], tl.trans(codes), EMULATE)
        s += tl.sum(q_band * zr[None, :], 1)[:, None]
    else:
        s = dot_fp16(q_band, tl.trans(codes), EMULATE)
    return s


@triton.jit
def _pv_band(p, codes, sc, zr, EXACT: tl.constexpr, EMULATE: tl.constexpr):
    """p . v over one V band -> [G, W]: exact, (p . codes) * scale + sum(p) * zero; else one
    fp16 MMA on the dequantized tile."""
    if EXACT:
        out = dot_exact(p, codes, EMULATE) * sc[None, :] + tl.sum(p, 1)[:, None] * zr[None, :]
    else:
        out = dot_fp16(p, codes, EMULATE)
    return out


@triton.jit
def _unit(PAGE_IDS, SEG_IDS, HEADERS, row_sel, seg0, i, ok, units_per_seg,
          BLOCK_N: tl.constexpr, HDR_W: tl.constexpr, HAS_SELECT: tl.constexpr):
    """(header row pointer, first token) of the i-th unit; nothing is read unless `ok`."""
    if HAS_SELECT:
        unit = tl.load(PAGE_IDS + row_sel + i, mask=ok, other=0)
    else:
        unit = i
    seg_local = unit // units_per_seg
    hdr = HEADERS + tl.load(SEG_IDS + seg0 + seg_local, mask=ok, other=0).to(tl.int64) * HDR_W
    return hdr, (unit - seg_local * units_per_seg) * BLOCK_N


@triton.jit
def _store_band(PART_ACC, rows, mask_g, acc, START: tl.constexpr, NB: tl.constexpr,
                W: tl.constexpr, D: tl.constexpr):
    offs_w = tl.arange(0, W)
    tl.store(PART_ACC + rows[:, None] * D + START + offs_w[None, :], acc,
             mask=mask_g[:, None] & (offs_w[None, :] < NB))


@triton.jit(do_not_specialize=["cls"])  # the class index: one variant whatever its value
def _band_decode_stage1(
    Q,  # fp32 [B, H, G, D]: rotated into the request's K basis, pre-scaled by sm_scale
    ARENA_U8, ARENA_F16,  # the same bytes, as uint8 and as fp16
    HEADERS, SEG_INDPTR, SEG_IDS,  # int32 [S, HDR_W], [B+1], [S]
    PAGE_IDS, PAGE_COUNTS,  # int32 [B, H, max_sel], [B, H] (read only with HAS_SELECT)
    CLASS_OFFS,  # int32 [B, H, C+1] (PARTITIONED: PAGE_IDS grouped by class, `class_partition`)
    PART_M, PART_L, PART_ACC,  # fp32 [B, H, NP, G], [B, H, NP, G], [B, H, NP, G, D]
    H, num_splits, num_parts, part0, units_per_seg, max_sel, cls, num_cls,
    G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, HDR_W: tl.constexpr,
    BASE_COL: tl.constexpr, STRIDE_COL: tl.constexpr,  # header columns; KC, VC: first
    KC: tl.constexpr, VC: tl.constexpr,  # column of K's / V's fields (arena.KIND_FIELDS order)
    K8: tl.constexpr, K4: tl.constexpr, K2: tl.constexpr,  # band widths (channels) this launch
    V8: tl.constexpr, V4: tl.constexpr, V2: tl.constexpr,  # reads; other segments are skipped
    WK8: tl.constexpr, WK4: tl.constexpr, WK2: tl.constexpr,  # tile widths: max(16, pow2 >= band)
    WV8: tl.constexpr, WV4: tl.constexpr, WV2: tl.constexpr,  # (host-computed: Triton 3.6 jit
    # cannot call triton.next_power_of_2)
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SELECT: tl.constexpr,
    PARTITIONED: tl.constexpr, EXACT: tl.constexpr, EMULATE: tl.constexpr,
):
    """One program per (request, KV head, split): the split's units (BLOCK_N-token blocks, or
    selected 32-token pages) of the segments whose band widths are this launch's (K8..V2, all
    compile-time, so each band is a contiguous [N, row] byte tile), all G query heads at once.
    Writes the split's softmax partial (max, sum, acc in the V basis) to part `part0 + split`."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < G
    bh = b * H + h
    # q of each K band (channels [start, start + width) of the K basis).
    q_rows = Q + (bh * G + offs_g[:, None]) * D
    q8 = tl.load(q_rows + tl.arange(0, WK8)[None, :],
                 mask=mask_g[:, None] & (tl.arange(0, WK8)[None, :] < K8), other=0.0)
    q4 = tl.load(q_rows + K8 + tl.arange(0, WK4)[None, :],
                 mask=mask_g[:, None] & (tl.arange(0, WK4)[None, :] < K4), other=0.0)
    q2 = tl.load(q_rows + K8 + K4 + tl.arange(0, WK2)[None, :],
                 mask=mask_g[:, None] & (tl.arange(0, WK2)[None, :] < K2), other=0.0)
    if not EXACT:  # rounded once, not per unit
        q8, q4, q2 = q8.to(tl.float16), q4.to(tl.float16), q2.to(tl.float16)

    seg0 = tl.load(SEG_INDPTR + b)
    row_sel = bh * max_sel
    if PARTITIONED:  # this launch's class: entries [offs[cls], offs[cls + 1]) of the list
        first = tl.load(CLASS_OFFS + bh * (num_cls + 1) + cls)
        count = tl.load(CLASS_OFFS + bh * (num_cls + 1) + cls + 1) - first
        row_sel += first
    elif HAS_SELECT:
        count = tl.load(PAGE_COUNTS + bh)
    else:
        count = (tl.load(SEG_INDPTR + b + 1) - seg0) * units_per_seg
    per_split = tl.cdiv(count, num_splits)
    start = split * per_split
    end = tl.minimum(start + per_split, count)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc8 = tl.zeros([BLOCK_G, WV8], tl.float32)
    acc4 = tl.zeros([BLOCK_G, WV4], tl.float32)
    acc2 = tl.zeros([BLOCK_G, WV2], tl.float32)
    # The next unit's header is located one iteration ahead (two dependent loads off the
    # critical path). Where V's tiles are loaded (before the scores or after p) is set by
    # register use (ptxas, sm_90): early for 32-token pages, late for larger blocks.
    hdr_n, tok0_n = _unit(PAGE_IDS, SEG_IDS, HEADERS, row_sel, seg0, start, start < end,
                          units_per_seg, BLOCK_N, HDR_W, HAS_SELECT)
    for i in range(start, end):
        hdr, tok0 = hdr_n, tok0_n
        hdr_n, tok0_n = _unit(PAGE_IDS, SEG_IDS, HEADERS, row_sel, seg0, i + 1, i + 1 < end,
                              units_per_seg, BLOCK_N, HDR_W, HAS_SELECT)
        if PARTITIONED:  # every unit of the list is this launch's class
            mine = True
        else:
            mine = (tl.load(hdr + KC) == K8) & (tl.load(hdr + KC + 1) == K4) & \
                (tl.load(hdr + KC + 2) == K2) & (tl.load(hdr + VC) == V8) & \
                (tl.load(hdr + VC + 1) == V4) & (tl.load(hdr + VC + 2) == V2)
        if mine:
            base = tl.multiple_of(tl.load(hdr + BASE_COL).to(tl.int64) * 16 +
                                  h * tl.load(hdr + STRIDE_COL), 16)
            u8 = ARENA_U8 + base
            f16 = ARENA_F16 + base // 2
            tok = tok0 + offs_n
            kgrp = tok0 // tl.load(hdr + KC + 3)
            vgrp = tok0 // tl.load(hdr + VC + 3)
            kc8, ks8, kz8, kc4, ks4, kz4, kc2, ks2, kz2 = _kind_load(
                u8, f16, hdr, tok, kgrp, KC, K8, K4, K2, WK8, WK4, WK2, EXACT)
            if HAS_SELECT:  # V tiles in flight during the scores (fewer registers here)
                vc8, vs8, vz8, vc4, vs4, vz4, vc2, vs2, vz2 = _kind_load(
                    u8, f16, hdr, tok, vgrp, VC, V8, V4, V2, WV8, WV4, WV2, EXACT)
            s = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
            if K8 > 0:
                s += _score_band(q8, kc8, ks8, kz8, EXACT, EMULATE)
            if K4 > 0:
                s += _score_band(q4, kc4, ks4, kz4, EXACT, EMULATE)
            if K2 > 0:
                s += _score_band(q2, kc2, ks2, kz2, EXACT, EMULATE)
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            if not HAS_SELECT:  # blocks of 64/128 tokens: V after p (fewer registers)
                vc8, vs8, vz8, vc4, vs4, vz4, vc2, vs2, vz2 = _kind_load(
                    u8, f16, hdr, tok, vgrp, VC, V8, V4, V2, WV8, WV4, WV2, EXACT)
            if V8 > 0:
                acc8 = acc8 * alpha[:, None] + _pv_band(p, vc8, vs8, vz8, EXACT, EMULATE)
            if V4 > 0:
                acc4 = acc4 * alpha[:, None] + _pv_band(p, vc4, vs4, vz4, EXACT, EMULATE)
            if V2 > 0:
                acc2 = acc2 * alpha[:, None] + _pv_band(p, vc2, vs2, vz2, EXACT, EMULATE)
            m = m_new

    rows = (bh * num_parts + part0 + split) * G + offs_g
    tl.store(PART_M + rows, m, mask=mask_g)
    tl.store(PART_L + rows, l, mask=mask_g)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(PART_ACC + rows[:, None] * D + offs_d[None, :],
             tl.zeros([BLOCK_G, BLOCK_D], tl.float32),
             mask=mask_g[:, None] & (offs_d[None, :] >= V8 + V4 + V2) & (offs_d[None, :] < D))
    _store_band(PART_ACC, rows, mask_g, acc8, 0, V8, WV8, D)
    _store_band(PART_ACC, rows, mask_g, acc4, V8, V4, WV4, D)
    _store_band(PART_ACC, rows, mask_g, acc2, V8 + V4, V2, WV2, D)


@triton.jit
def _band_decode_stage2(
    PART_M, PART_L, PART_ACC,  # stage 1 partials (rotated V basis)
    HOT_M, HOT_L, HOT_ACC,  # fp32 [B, H, G], [B, H, G], [B, H, G, D] (raw basis)
    O_ROT, O_HOT, LSE,  # fp32 [B, H, G, D] x2, [B, H, G]
    num_splits,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g, mask_d = offs_g < G, offs_d < D
    mask_gd = mask_g[:, None] & mask_d[None, :]
    row = bh * G + offs_g

    # Common max over the splits and the hot partial.
    m_hot = tl.load(HOT_M + row, mask=mask_g, other=float("-inf"))
    m_all = m_hot
    for s in range(num_splits):
        part = (bh * num_splits + s) * G + offs_g
        m_all = tl.maximum(m_all, tl.load(PART_M + part, mask=mask_g, other=float("-inf")))
    m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)  # all empty: weights exp(-inf) = 0

    # Log-sum-exp merge of the splits (rotated basis).
    l_tot = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(num_splits):
        part = (bh * num_splits + s) * G + offs_g
        w = tl.exp(tl.load(PART_M + part, mask=mask_g, other=float("-inf")) - m_ref)
        l_tot += w * tl.load(PART_L + part, mask=mask_g, other=0.0)
        acc += w[:, None] * tl.load(PART_ACC + part[:, None] * D + offs_d[None, :],
                                    mask=mask_gd, other=0.0)
    # ... and the hot buffer (raw basis, kept apart until the wrapper rotates o_rot back).
    w_hot = tl.exp(m_hot - m_ref)
    l_tot += w_hot * tl.load(HOT_L + row, mask=mask_g, other=0.0)
    hot = tl.load(HOT_ACC + row[:, None] * D + offs_d[None, :], mask=mask_gd, other=0.0)
    l_tot = tl.where(mask_g, l_tot, 1.0)  # padding rows of the GQA tile
    inv = 1.0 / l_tot
    tl.store(O_ROT + row[:, None] * D + offs_d[None, :], acc * inv[:, None], mask=mask_gd)
    tl.store(O_HOT + row[:, None] * D + offs_d[None, :], hot * (w_hot * inv)[:, None],
             mask=mask_gd)
    tl.store(LSE + row, m_ref + tl.log(l_tot), mask=mask_g)


def _tile_width(channels: int, bits: int) -> int:
    """Columns of a band's register tile: a power of two, at least the 16 a tl.dot needs, and
    for a 2-bit band at least 32 (8 bytes a row): with 4-byte rows ([N, 4] -> interleaved to
    [N, 16]) the compiled kernel unpacked wrong codes on the H200 (Triton 3.6; every layout with
    a 16-channel 2-bit band at head_dim 64 was off by ~60%, while the interpreter was exact)."""
    return max(32 if bits == 2 else 16, triton.next_power_of_2(channels))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(batch: int, kv_heads: int, max_pages: int, device: torch.device,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Enough (request, head, split) programs to fill the GPU `programs_per_sm` times, each
    split >= 4 pages (128 tokens)."""
    want = -(-programs_per_sm * _num_sms(device) // max(batch * kv_heads, 1))
    cap = max(1, max_pages // MIN_PAGES_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))


def band_width_classes(plans: torch.Tensor) -> list[tuple[int, ...]]:
    """Distinct (K b8, b4, b2, V b8, b4, b2) channel counts of an arena's layout plans
    (int32 [L, 2, PLAN_W, D]): one stage-1 launch each, the widths compile-time there."""
    mask = plans[:, :, PLAN_FIELDS.index("mask")].cpu()  # [L, 2, D]
    counts = torch.stack([(mask == (1 << bits) - 1).sum(-1) for bits in (8, 4, 2)], -1)
    return sorted({tuple(row) for row in counts.reshape(-1, 6).tolist()})


def keep_to_page_list(page_keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B, H, P] keep mask -> (page ids int32 [B, H, P], counts int32 [B, H]); the kept
    pages come first in ascending order."""
    order = torch.argsort((~page_keep).to(torch.int8), dim=-1, stable=True)
    return order.to(torch.int32).contiguous(), page_keep.sum(-1, dtype=torch.int32)


class BandDecodeWrapper:
    """Decode attention over a `PackedArena`, FlashInfer style: `plan` (host side: shapes,
    splits, workspace; once per batch step, shared by every layer) then `run` (launches; per
    layer). Outputs match `codec.attention.decode_attention` on the same CompressedLayers."""

    def __init__(self):
        self._planned = False
        # Pages over every `run` so far, counted as (32-token page, KV head) pairs of the arenas'
        # compressed pages: all of them (host int, known at plan time), and those read (all of
        # them in a run without selection; with selection the sum of `page_counts`, added on the
        # device so that no run waits on the host). `page_reads()` reads both.
        self.pages_available = 0
        self._pages_read = 0
        self._pages_selected: torch.Tensor | None = None  # int64 [] on the device

    def plan(self, arena: PackedArena, num_qo_heads: int, *, sm_scale: float | None = None,
             num_kv_splits: int | None = None, max_selected_pages: int | None = None,
             block_tokens: int | None = None, num_warps: int = 4, num_stages: int = 2,
             exact: bool = True, width_classes: list[tuple[int, ...]] | None = None,
             static_pages: int | None = None, workspace: dict | None = None) -> None:
        """Read the batch structure of `arena` (any layer of the batch: they share it).

        Without selection stage 1 reads blocks of up to `block_tokens` tokens (default 128, the
        fastest on an H200 for head_dim 64 and 128; the largest of 128/64/32 dividing the
        segment and every token group is used); with selection, 32-token pages. `exact`:
        products as two bf16 MMAs (float32-accurate scores, ~1e-5 vs the reference); False:
        tiles dequantized to fp16, one fp16 MMA per product (~5e-4 vs the reference) and
        1.0-2.2x faster on an H200 (benchmarks/RESULTS.md). 4 warps beat 8 everywhere there.
        `width_classes`: `band_width_classes(arena.plans)`, when the caller has them already.
        `static_pages`: plan for up to that many pages per row without reading the arena's
        lists (a CUDA graph's plan: the lists change in place between replays, rows may be
        empty, and `run` counts no pages on the host; the caller counts them).
        `workspace`: a dict of float32 buffers shared by wrappers that never run at once (the
        CUDA graphs of several batch sizes, replayed one at a time): each takes views of the
        buffers, grown to the largest plan, instead of its own.
        """
        if not isinstance(arena, PackedArena):
            raise TypeError(f"plan: arena must be a PackedArena, got {type(arena).__name__}")
        if arena.page_tokens != PAGE_TOKENS:
            raise ValueError(f"plan: the kernel reads {PAGE_TOKENS}-token pages, arena has "
                             f"page_tokens={arena.page_tokens}; repack with page_tokens=32")
        bsz, h, d = arena.batch, arena.num_kv_heads, arena.head_dim
        if num_qo_heads % h:
            raise ValueError(f"plan: {num_qo_heads} query heads do not group evenly over {h} KV "
                             f"heads")
        if d < 16:
            raise ValueError(f"plan: head_dim={d} is below the 16 a tl.dot tile needs")
        g = num_qo_heads // h
        if static_pages is None:
            pages = arena.pages_per_request()
            empty = [b for b, (n, t) in enumerate(zip(pages, arena.hot_lens.tolist()))
                     if not n + t]
            if empty:
                raise ValueError(f"plan: requests {empty} have neither sealed segments nor hot "
                                 f"tokens (nothing to attend to)")
        else:
            pages = [static_pages] * bsz
        max_pages = max(pages + [0])
        if max_selected_pages is not None:
            max_pages = min(max_pages, max_selected_pages)
        splits = num_kv_splits or choose_num_splits(bsz, h, max_pages, arena.device)
        if not 1 <= splits <= 1024:
            raise ValueError(f"plan: num_kv_splits={splits} must be in [1, 1024]")
        dev = arena.device
        f32 = dict(dtype=torch.float32, device=dev)
        self.batch, self.kv_heads, self.group, self.head_dim = bsz, h, g, d
        self.num_qo_heads, self.num_splits = num_qo_heads, splits
        self.max_pages = max(pages + [0])
        # compressed pages of the batch, per KV head (a static plan's run counts none)
        self.arena_pages = 0 if static_pages is not None else sum(pages)
        self.valid_pages = (torch.arange(max(self.max_pages, 1))[None, :] <
                            torch.tensor(pages)[:, None]).to(dev)  # [B, P_max]
        self.pages_per_seg = arena.segment_tokens // arena.page_tokens
        self.num_warps, self.num_stages, self.exact = num_warps, num_stages, bool(exact)
        block_tokens = block_tokens or 128
        self.block_n = next(n for n in (128, 64, 32) if n <= max(block_tokens, 32) and
                            arena.segment_tokens % n == 0 and arena.min_group % n == 0)
        self.sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
        self.device = dev
        # From the caller when it keeps them on the host (the serving store does), else read
        # from the device plans (one host sync).
        self.widths = width_classes or band_width_classes(arena.plans)
        # with selection and several classes, the list is grouped by class first (one launch,
        # `class_partition`) so that each class's launch walks its own pages only
        self.partition = len(self.widths) > 1
        self.class_table = torch.tensor(self.widths, dtype=torch.int32, device=dev).view(-1, 6)
        parts = splits * len(self.widths)

        def buf(name: str, *shape: int) -> torch.Tensor:
            if workspace is None:
                return torch.empty(*shape, **f32)
            n = 1
            for x in shape:
                n *= x
            have = workspace.get(name)
            if have is None or have.numel() < n:
                have = workspace[name] = torch.empty(n, **f32)
            return have[:n].view(*shape)

        self.part_m = buf("part_m", bsz, h, parts, g)
        self.part_l = buf("part_l", bsz, h, parts, g)
        self.part_acc = buf("part_acc", bsz, h, parts, g, d)
        self.hot = (buf("hot_m", bsz, h, g), buf("hot_l", bsz, h, g), buf("hot_acc", bsz, h, g, d))
        self.o_rot = buf("o_rot", bsz, h, g, d)
        self.o_hot = buf("o_hot", bsz, h, g, d)
        self.lse = buf("lse", bsz, h, g)
        self._planned = True

    def _check_arena(self, arena: PackedArena) -> None:
        if not isinstance(arena, PackedArena):
            raise TypeError(f"run: arena must be a PackedArena, got {type(arena).__name__}")
        got = (arena.batch, arena.num_kv_heads, arena.head_dim, arena.segment_tokens // PAGE_TOKENS)
        want = (self.batch, self.kv_heads, self.head_dim, self.pages_per_seg)
        if got != want:
            raise ValueError(f"run: arena (batch, kv heads, head_dim, pages/segment) = {got} but "
                             f"plan() saw {want}; call plan() for this batch")
        if arena.device != self.device:
            raise ValueError(f"run: arena is on {arena.device}, plan() on {self.device}")

    def _selection(self, page_keep, page_ids, page_counts):
        bsz, h = self.batch, self.kv_heads
        if page_keep is not None:
            if page_ids is not None or page_counts is not None:
                raise ValueError("run: pass either page_keep or (page_ids, page_counts), not both")
            if page_keep.dtype != torch.bool or page_keep.dim() != 3 or \
                    tuple(page_keep.shape[:2]) != (bsz, h) or page_keep.device != self.device:
                raise ValueError(f"run: page_keep must be bool [{bsz}, {h}, P] on {self.device}, "
                                 f"got {page_keep.dtype} {tuple(page_keep.shape)} on "
                                 f"{page_keep.device}")
            page_ids, page_counts = keep_to_page_list(page_keep)
        if (page_ids is None) != (page_counts is None):
            raise ValueError("run: page_ids and page_counts go together")
        if page_ids is None:
            return None
        if page_ids.dtype != torch.int32 or page_ids.dim() != 3 or \
                tuple(page_ids.shape[:2]) != (bsz, h) or not page_ids.is_contiguous():
            raise ValueError(f"run: page_ids must be contiguous int32 [{bsz}, {h}, P], got "
                             f"{page_ids.dtype} {tuple(page_ids.shape)}")
        if page_counts.dtype != torch.int32 or tuple(page_counts.shape) != (bsz, h):
            raise ValueError(f"run: page_counts must be int32 [{bsz}, {h}], got "
                             f"{page_counts.dtype} {tuple(page_counts.shape)}")
        return page_ids, page_counts.contiguous()

    def run(self, q: torch.Tensor, arena: PackedArena, *, page_keep: torch.Tensor | None = None,
            page_ids: torch.Tensor | None = None, page_counts: torch.Tensor | None = None,
            hot_partial: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            out_dtype: torch.dtype | None = None,
            queries: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [B, Hq, D] (fp32/bf16/fp16) -> out [B, Hq, D] (out_dtype, default q.dtype).

        Selection (optional), per (request, KV head) over the request's compressed pages in
        token order: `page_keep` bool [B, H, P] (pages >= the request's page count must be
        False), or a list: `page_ids` int32 [B, H, P'] with the first `page_counts` [B, H]
        entries valid. `hot_partial` = (m [B, Hq], l [B, Hq], acc [B, Hq, D]) float32, scores
        scaled by sm_scale, replaces the hot-buffer kernel. `queries`: `self.queries(q, arena)`
        when the caller computed them already (for `select` of the same layer).
        """
        if not self._planned:
            raise RuntimeError("run: call plan() first")
        self._check_arena(arena)
        bsz, h, g, d = self.batch, self.kv_heads, self.group, self.head_dim
        if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or \
                tuple(q.shape) != (bsz, self.num_qo_heads, d) or q.device != self.device:
            raise ValueError(f"run: q must be float32/bf16/fp16 [{bsz}, {self.num_qo_heads}, {d}] "
                             f"on {self.device}, got {q.dtype} {tuple(q.shape)} on {q.device}")
        sel = self._selection(page_keep, page_ids, page_counts)
        if page_keep is not None:  # host sync: the page-list form skips this check
            p = min(page_keep.shape[2], self.valid_pages.shape[1])
            if bool(page_keep[:, :, p:].any()) or \
                    bool((page_keep[:, :, :p] & ~self.valid_pages[:, None, :p]).any()):
                raise ValueError("run: page_keep selects pages past a request's last compressed "
                                 f"page (pages per request: {self.valid_pages.sum(1).tolist()})")
        self._count_reads(sel)

        qs, q_rot = queries if queries is not None else self.queries(q, arena)
        if hot_partial is None:
            hot = dense_decode_partial(qs, arena.hot_k, arena.hot_v, arena.hot_lens, self.hot,
                                       rows=arena.hot_rows)
        else:
            hot = self._check_hot(hot_partial)

        emulate = interpreting()
        dummy = arena.seg_ids
        parts = self.num_splits * len(self.widths)
        partitioned = sel is not None and self.partition
        offs = dummy
        if partitioned:
            ids, offs = class_partition(sel[0], sel[1], arena.seg_indptr, arena.seg_ids,
                                        arena.headers, self.class_table, self.pages_per_seg)
            sel = (ids, sel[1])
        for i, (k8, k4, k2, v8, v4, v2) in enumerate(self.widths):
            _band_decode_stage1[(bsz, h, self.num_splits)](
                q_rot, arena.data, arena.data.view(torch.float16), arena.headers,
                arena.seg_indptr, arena.seg_ids, dummy if sel is None else sel[0],
                dummy if sel is None else sel[1], offs, self.part_m, self.part_l, self.part_acc,
                h, self.num_splits, parts, i * self.num_splits,
                self.pages_per_seg if sel is not None else arena.segment_tokens // self.block_n,
                0 if sel is None else sel[0].shape[2], i, len(self.widths),
                G=g, D=d, BLOCK_N=PAGE_TOKENS if sel is not None else self.block_n,
                HDR_W=HEADER_WIDTH, BASE_COL=HDR["base16"], STRIDE_COL=HDR["head_stride"],
                KC=HDR["k_b8"], VC=HDR["v_b8"], K8=k8, K4=k4, K2=k2, V8=v8, V4=v4, V2=v2,
                **{f"W{name}": _tile_width(n, int(name[1])) for name, n in
                   (("K8", k8), ("K4", k4), ("K2", k2), ("V8", v8), ("V4", v4), ("V2", v2))},
                BLOCK_G=max(16, triton.next_power_of_2(g)),
                BLOCK_D=max(16, triton.next_power_of_2(d)), HAS_SELECT=sel is not None,
                PARTITIONED=partitioned, EXACT=self.exact, EMULATE=emulate, num_warps=self.num_warps,
                num_stages=self.num_stages)
        _band_decode_stage2[(bsz * h,)](
            self.part_m, self.part_l, self.part_acc, *hot, self.o_rot, self.o_hot, self.lse,
            parts, G=g, D=d, BLOCK_G=triton.next_power_of_2(g),
            BLOCK_D=triton.next_power_of_2(d), num_warps=4)
        # Back from the V basis: out = o_hot + o_rot @ V^T, one batched matmul (or one launch
        # reading each row's bases by address).
        if arena.basis is not None:
            out = rotate_rows(self.o_rot, arena.basis.ptrs, arena.basis.v_offset, back=True,
                              add=self.o_hot)
        else:
            out = torch.baddbmm(self.o_hot.view(bsz * h, g, d), self.o_rot.view(bsz * h, g, d),
                                arena.v_basis.view(bsz * h, d, d).transpose(1, 2))
        return out.view(bsz, self.num_qo_heads, d).to(out_dtype or q.dtype)

    def _count_reads(self, sel) -> None:
        """Add one run's pages to the running counts (no host sync: with selection, two small
        launches adding `page_counts`' sum into a device scalar)."""
        pages = self.arena_pages * self.kv_heads
        self.pages_available += pages
        if sel is None:
            self._pages_read += pages
            return
        counts = sel[1]
        if self._pages_selected is None or self._pages_selected.device != counts.device:
            if self._pages_selected is not None:  # another device than before (not in serving)
                self._pages_read += int(self._pages_selected)
            self._pages_selected = torch.zeros((), dtype=torch.int64, device=counts.device)
        self._pages_selected += counts.sum(dtype=torch.int64)

    def page_reads(self) -> tuple[int, int]:
        """(pages available, pages read) over every `run` so far, as (32-token page, KV head)
        pairs: the arenas' compressed pages, and those the kernels read (the selected ones when a
        run had a selection). Reads the device counter: one host sync, for stats, not per step."""
        selected = 0 if self._pages_selected is None else int(self._pages_selected)
        return self.pages_available, self._pages_read + selected

    def select(self, q: torch.Tensor, arena: PackedArena, meta: PackedPageMeta, *,
               budget_pages: int, sink_pages: int, recent_pages: int,
               rows: RowSelection | None = None,
               queries: tuple[torch.Tensor, torch.Tensor] | None = None,
               rescore: tuple | None = None):
        """Query-aware page list on the device (`page_select`): bounds of every compressed page
        from `meta` (the arena's segments' page metadata, by segment id), then the top pages per
        (arena row, KV head) -> (page_ids, page_counts) for `run`. When a request spans several
        rows (basis blocks), pass `rows` so its budget covers all of them. `rescore` = (factor,
        channels[, layout]): the bound keeps factor x the budget's pages as candidates, and the
        budget's pages are the candidates with the best scores on `channels` leading channels
        of their compressed K (`page_rescore`, its `layout`, default "rows"). No host sync."""
        if not self._planned:
            raise RuntimeError("select: call plan() first")
        self._check_arena(arena)
        h = self.kv_heads
        if meta.pages_per_segment != self.pages_per_seg or meta.channels.shape[1] != h:
            raise ValueError(f"select: meta has {meta.pages_per_segment} pages/segment and "
                             f"{meta.channels.shape[1]} heads; the arena {self.pages_per_seg} "
                             f"and {h}")
        _, q_rot = queries if queries is not None else self.queries(q, arena)
        out = rows.bounds_out(h) if rows is not None and rows.row_pmax == self.max_pages \
            else None  # then RowSelection reads the bounds where they are written
        bounds = page_bounds(q_rot, meta, arena.seg_indptr, arena.seg_ids, self.max_pages, out)

        def top(scores, budget):
            if rows is not None:
                return rows.select(scores, budget, sink_pages, recent_pages)
            num_pages = (arena.seg_indptr[1:] - arena.seg_indptr[:-1]) * self.pages_per_seg
            return select_page_list(scores, num_pages, budget, sink_pages, recent_pages)

        if rescore is None:
            return top(bounds, budget_pages)
        factor, channels, layout = (*rescore, "rows")[:3]
        ids, counts = top(bounds, factor * budget_pages)  # candidates, per arena row
        # each arena row owns its list (one query row: page ids are row-local, < max_pages)
        scores = page_rescore(q_rot, arena.data, arena.headers, arena.plans, arena.seg_indptr,
                              arena.seg_ids, ids, counts, rows_per_owner=1,
                              row_pages=self.max_pages, pages_per_seg=self.pages_per_seg,
                              channels=channels, layout=layout,
                              out=rows.bounds_out(h) if rows is not None else bounds)
        return top(scores, budget_pages)

    def queries(self, q: torch.Tensor, arena: PackedArena) -> tuple[torch.Tensor, torch.Tensor]:
        """(q scaled by sm_scale in the raw basis, the same in the K basis), fp32 [B, H, G, D]:
        what `select` and `run` read; compute once per layer and pass both as `queries=`."""
        bsz, h, g, d = self.batch, self.kv_heads, self.group, self.head_dim
        qs = (q.float() * self.sm_scale).view(bsz, h, g, d).contiguous()
        if arena.basis is not None:
            return qs, rotate_rows(qs, arena.basis.ptrs, arena.basis.k_offset, back=False)
        return qs, torch.matmul(qs, arena.k_basis).contiguous()

    def _check_hot(self, hot_partial):
        bsz, h, g, d = self.batch, self.kv_heads, self.group, self.head_dim
        try:
            m, l, acc = hot_partial
        except (TypeError, ValueError):
            raise ValueError("run: hot_partial must be a tuple (m, l, acc)") from None
        shapes = ((bsz, self.num_qo_heads), (bsz, self.num_qo_heads),
                  (bsz, self.num_qo_heads, d))
        for name, t, shape in zip(("m", "l", "acc"), (m, l, acc), shapes):
            if t.dtype != torch.float32 or tuple(t.shape) != shape or t.device != self.device:
                raise ValueError(f"run: hot_partial {name} must be float32 {list(shape)} on "
                                 f"{self.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        return (m.reshape(bsz, h, g).contiguous(), l.reshape(bsz, h, g).contiguous(),
                acc.reshape(bsz, h, g, d).contiguous())

    def bytes_read(self, arena: PackedArena, page_keep: torch.Tensor | None = None) -> dict:
        """Bytes the kernels touch in DRAM for one run (each byte once), by kind."""
        return bytes_read(arena, self.num_qo_heads, self.num_splits, page_keep)


def bytes_read(arena: PackedArena, num_qo_heads: int, num_splits: int,
               page_keep: torch.Tensor | None = None) -> dict[str, int]:
    """Codes of the pages read, scales/zeros of the token groups they touch, headers of the
    segments touched, selection list, segment lists, bases, q, hot buffer and the split
    workspace (written and read once). Computed on the host from the arena's headers."""
    hdr = arena.headers.cpu().long()
    bsz, h, d = arena.batch, arena.num_kv_heads, arena.head_dim
    pps = arena.segment_tokens // PAGE_TOKENS
    counts = arena.segments_per_request()
    p_max = max(counts + [0]) * pps
    seg_of_page = torch.full((bsz, max(p_max, 1)), -1, dtype=torch.long)
    indptr = arena.seg_indptr.cpu().long()
    ids = arena.seg_ids.cpu().long()
    for b in range(bsz):
        segs = ids[indptr[b]:indptr[b + 1]]
        seg_of_page[b, :len(segs) * pps] = segs.repeat_interleave(pps)
    valid = (seg_of_page >= 0)[:, None, :].expand(bsz, h, -1)
    keep = valid if page_keep is None else valid & page_keep.cpu()[:, :, :valid.shape[2]]
    seg = seg_of_page.clamp_min(0)[:, None, :].expand(bsz, h, -1)
    page_in_seg = (torch.arange(seg.shape[2]) % pps)[None, None, :].expand(bsz, h, -1)
    out = {"codes": 0, "scales": 0}
    for kind in ("k", "v"):
        col = HDR[f"{kind}_b8"]
        b8, b4, b2, group = (hdr[:, col + i] for i in range(4))
        page_codes = PAGE_TOKENS * (b8 + b4 // 2 + b2 // 4)  # bytes per page per head
        out["codes"] += int(page_codes[seg][keep].sum())
        group_scales = 4 * (b8 + b4 + b2)  # scale + zero, fp16, per token group per head
        grp = page_in_seg * PAGE_TOKENS // group[seg]
        span = arena.segment_tokens  # > any group index
        key = ((seg * h + torch.arange(h)[None, :, None]) * span + grp)[keep]
        touched = torch.unique(key)
        out["scales"] += int(group_scales[touched // span // h].sum())
    segs_touched = torch.unique(seg[keep])
    out["headers"] = int(segs_touched.numel()) * HEADER_WIDTH * 4
    out["segment_lists"] = (arena.seg_indptr.numel() + arena.seg_ids.numel()) * 4
    out["selection"] = 0 if page_keep is None else int(keep.sum()) * 4 + bsz * h * 4
    out["bases"] = (arena.k_basis.numel() + arena.v_basis.numel()) * 4 if arena.basis is None \
        else 2 * int((arena.basis.ptrs != 0).sum()) * h * d * d * 2  # bf16, read in place
    out["q"] = bsz * num_qo_heads * d * 4
    out["hot"] = int(arena.hot_lens.sum()) * h * d * 2 * 2
    out["workspace"] = 2 * bsz * num_qo_heads * num_splits * (d + 2) * 4
    out["total"] = sum(out.values())
    return out
