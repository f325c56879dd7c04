"""Decode attention per request over its position-block rows, in few launches: the decode CUDA
graph's attention.

A request of the serving pool is read as W *rows*, one per basis block of `row_pages` 32-token
pages (row w holds the request's pages [w * row_pages, (w + 1) * row_pages)), plus its hot tokens
(bf16, raw basis, read in place through a row table). Each row has its own K and V bases (bf16
[D, D] read transforms, by address: `basis_rotate.BasisTable`). Three launches per layer, plus
the selection's two (`page_select.page_bounds` over the rows, written request-major, and
`select_page_list` per request):

1. `queries`: per (row, KV head) q scaled by sm_scale, rotated into the row's K basis
   (q_rot = q_s @ R_k^T), and q_s itself (for the hot tokens); rows a request does not reach are
   skipped (their bases are never read).
2. `run` stage 1, one program per (request, KV head, split) over a contiguous share of the
   request's selected pages (ascending, so rows come in order), all G query heads at once: each
   page read one token at a time through the layout's per-channel plan (a channel per thread:
   every layout in one compiled variant, no width classes), dequantized in place, scores
   against the page's row's q_rot, an online softmax whose accumulator is in the row's V basis
   and is rotated back (acc @ R_v) into a raw-basis accumulator when the row changes. The extra
   splits `num_splits`.. read the hot tokens (raw basis). Every part is in the raw basis.
3. stage 2, one program per (request, KV head): log-sum-exp merge of the parts, written to the
   output in its dtype. Pages read are counted on the device (one atomic add per program).

Products are bf16 MMAs on hi/lo halves (~2^-16 relative per product; q's rotation too: two
MMAs of q's bf16 halves against the bf16 bases, ~2^-17, was a tf32x3 dot). `request_decode_reference` is the torch version of 1-3 on the same inputs.

    dec = RequestDecode()
    dec.plan(batch=4, rows_per_request=W, row_pages=128, pages_per_seg=4, num_kv_heads=8,
             num_qo_heads=32, head_dim=128, max_selected=138, sm_scale=0.088, device="cuda")
    q_rot, q_s = dec.queries(q, basis_ptrs, k_offset, req_pages)       # per layer
    dec.run(q_rot, q_s, tables, basis_ptrs, v_offset, out, page_ids=ids, page_counts=counts)
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .band_decode import MIN_PAGES_PER_SPLIT, _num_sms
from .band_unpack import PLAN_ROW
from .common import (_round_bf16, channel_plan as _channel_plan, dot_bf16, dot_exact,
                     interpreting, rounds_bf16_stores, store_rounded)
from .layout import HDR, HEADER_WIDTH, PLAN_FIELDS

PAGE_TOKENS = 32
HOT_TOKENS = 64  # hot tokens per stage-1 iteration
HOT_SPLIT_TOKENS = 128  # hot tokens per hot split at most (graph_hot_tokens / this splits)
# Stage 1's splits (`stage1_splits`): the count whose programs, scheduled in launch order on
# the SMs' slots (two CTAs of 128 threads at ~250 registers per SM), finish first under a cost
# model fitted on the H100 (2026-12-06, `request_decode_sweep.py --splits`, 1 / 8 / 17 x 32K,
# 26 split counts, within ~5% of each): a page program costs STAGE1_PROGRAM_US plus
# STAGE1_PAGE_US per page, a hot-token program STAGE1_HOT_US. It picks the measured best at
# each point (32-33 splits at 1 x 32K: 36.7 us; 4 at 8 x 32K: 177.9 us; 12 at 17 x 32K: 371.6
# us), where "fill the slots once, rounded up" took 5 (248.4 us) and 2 (575.5 us): a second
# wave of a few long programs nearly doubles the run.
STAGE1_PROGRAMS_PER_SM = 2
STAGE1_PROGRAM_US, STAGE1_PAGE_US, STAGE1_HOT_US = 8.0, 4.5, 8.0
# How stage 1 reads a page (`plan(gather=...)`, this by default): "tokens" = one [D] vector per
# token, a channel per thread (plan fields, scales and zeros one value per thread), dequantized
# in place, products as three bf16 MMAs of hi/lo halves; "pairs" = the same with two adjacent
# channels per thread ([2, D/2, 2] loads: tokens t and t + 16), so K's transpose for the MMA
# stores channel pairs; "channels" = a [32, D] tile of codes through the per-channel plan
# broadcast to every token, scales applied to q and to p @ codes. sm_90 SASS per page
# (scripts/sass_loops.py): 1,581 / 1,682 / ~2,461 instructions, 10 / 10 / 43 barriers.
GATHER = "pairs"
# Stage 1's products (`plan(products=...)`): "exact" = three bf16 MMAs on hi/lo halves of both
# operands (~2^-16 relative per product, what the torch reference computes to ~1e-5); "bf16" =
# one bf16 MMA per product, q (or p) and the dequantized page rounded to bf16 (2^-9 relative,
# what FlashInfer's dense decode does with a bf16 cache): the lo halves, their joins and K's
# second transpose are never computed.
PRODUCTS = "exact"
# Stage 1 issues a page's V loads before its K products (`plan(early_v=...)`, this by default),
# so their latency overlaps the scores and softmax instead of following them.
EARLY_V = True


@triton.jit
def _request_queries(
    Q,  # [B, Hq, D] any float dtype, rows stride_b apart (heads and channels contiguous)
    PTRS,  # int64 [B * W]: each row's bf16 bases tensor (0: the identity)
    REQ_PAGES,  # int32 [B]: the request's compressed pages
    Q_ROT, Q_S,  # fp32 [B * W, H, G, D], [B, H, G, D]
    k_offset, H, G, W, row_pages, sm_scale, stride_b,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
):
    """One program per (row, KV head, BLOCK_N output channels)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = r // W
    w = r % W
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_g < G)[:, None]
    src = Q + b * stride_b + (h * G + offs_g)[:, None] * D
    out = ((r * H + h) * G + offs_g)[:, None] * D
    if w == 0:
        q_n = tl.load(src + offs_n[None, :], mask=mask, other=0.0).to(tl.float32) * sm_scale
        tl.store(Q_S + ((b * H + h) * G + offs_g)[:, None] * D + offs_n[None, :], q_n, mask=mask)
    if w * row_pages < tl.load(REQ_PAGES + b):  # a row the request reaches
        addr = tl.load(PTRS + r)
        if addr == 0:
            y = tl.load(src + offs_n[None, :], mask=mask, other=0.0).to(tl.float32) * sm_scale
        else:
            x = tl.load(src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32) * sm_scale
            mat = addr.to(tl.pointer_type(tl.bfloat16)) + (k_offset + h) * D * D
            rt = tl.load(mat + offs_n[None, :] * D + offs_d[:, None])  # R^T[j, n] = R[n, j]
            y = dot_exact(x, rt, EMULATE)  # R is bf16: q's two bf16 halves, two MMAs
        tl.store(Q_ROT + out + offs_n[None, :], y, mask=mask)


@triton.jit
def _kind_codes(U8, F16, plan, base, group, tok0, tok, offs_d, D: tl.constexpr,
                R_CODE: tl.constexpr, R_ROW: tl.constexpr, R_SHIFT: tl.constexpr,
                R_MASK: tl.constexpr, R_SCALE: tl.constexpr, R_ZERO: tl.constexpr,
                R_GROUP: tl.constexpr):
    """One kind (K or V) of one unit of tokens `tok` (all in the token group of `tok0`): its
    codes [N, D] as bf16 (integers <= 255: exact) read through the layout's per-channel plan,
    and the group's scale and zero per channel [D] (float32; 0 for dropped channels), so that
    x[n, c] = codes[n, c] * scale[c] + zero[c]."""
    code, row, shift, bits, keep, scale, zero = _channel_plan(
        plan, F16, base, group, tok0, offs_d, D, R_CODE, R_ROW, R_SHIFT, R_MASK, R_SCALE,
        R_ZERO, R_GROUP)
    raw = tl.load(U8 + base + code[None, :] + tok[:, None] * row[None, :], mask=keep[None, :],
                  other=0)
    # through float32: the interpreter casts an int straight to bf16 wrongly; exact on a GPU
    codes = ((raw.to(tl.int32) >> shift[None, :]) & bits[None, :]).to(tl.float32).to(tl.bfloat16)
    return codes, scale, zero


@triton.jit
def _tokens(ptr0, row, shift, bits, keep, T: tl.constexpr, N: tl.constexpr):
    """Codes (int32) of tokens T .. T + N - 1 of a page, one byte per channel at
    ptr0 + t * row, joined along log2(N) new last axes: token T + i1 + 2 i2 + ... sits at
    [..., i1, i2, ...]."""
    if N == 1:
        raw = tl.load(ptr0 + T * row, mask=keep, other=0)
        out = (raw.to(tl.int32) >> shift) & bits
    else:
        out = tl.join(_tokens(ptr0, row, shift, bits, keep, T, N // 2),
                      _tokens(ptr0, row, shift, bits, keep, T + N // 2, N // 2))
    return out


@triton.jit
def _split_bf16(x, EMULATE: tl.constexpr):
    """x (float32) = hi + lo + O(2^-16 |x|), hi and lo bf16 values (as float32 under EMULATE:
    the interpreter's bf16 casts truncate)."""
    if EMULATE:
        hi = _round_bf16(x)
        lo = _round_bf16(x - hi)
    else:
        hi = x.to(tl.bfloat16)
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def _dot3(a_hi, a_lo, b_hi, b_lo):
    """a @ b from bf16 halves (hi*hi + hi*lo + lo*hi, float32 accumulation): ~2^-16 relative
    per product."""
    return tl.dot(a_hi, b_hi) + tl.dot(a_hi, b_lo) + tl.dot(a_lo, b_hi)


@triton.jit
def _mma(a_hi, a_lo, b_hi, b_lo, ONE: tl.constexpr):
    """`_dot3`, or (ONE) the single bf16 MMA a_hi @ b_hi (float32 accumulation)."""
    if ONE:
        out = tl.dot(a_hi, b_hi)
    else:
        out = _dot3(a_hi, a_lo, b_hi, b_lo)
    return out


@triton.jit
def _kind_page(U8, F16, plan, base, group, tok0, D: tl.constexpr,
               R_CODE: tl.constexpr, R_ROW: tl.constexpr, R_SHIFT: tl.constexpr,
               R_MASK: tl.constexpr, R_SCALE: tl.constexpr, R_ZERO: tl.constexpr,
               R_GROUP: tl.constexpr, PAIRS: tl.constexpr, EMULATE: tl.constexpr):
    """One kind of a whole 32-token page, dequantized and transposed: x^T [D, 32] as bf16
    halves (hi, lo), x[t, c] = code * scale[c] + zero[c] (0 for dropped channels). Gathered
    one token at a time as [D] vectors, a channel per thread (PAIRS: [2, D/2, 2] vectors, tokens
    t and t + 16 and two adjacent channels per thread, so the MMA operands' channel pairs need
    no 16-bit shuffles): every plan field, scale and zero is one value per thread, read once,
    and the dequantization is thread-local. The tokens are joined along new last axes in
    bit-reversed order (t = i1 + 2 i2 + ... + 16 i5 sits at column 16 i1 + 8 i2 + ... + i5;
    PAIRS: 16 (t // 16) + bit-reversed (t % 16)), the same for every page and both kinds, so
    scores, softmax and p @ v agree; a page's tokens share their token group."""
    codes, scale, zero = _kind_page_load(U8, F16, plan, base, group, tok0, D, R_CODE, R_ROW,
                                         R_SHIFT, R_MASK, R_SCALE, R_ZERO, R_GROUP, PAIRS)
    return _kind_page_dequant(codes, scale, zero, D, PAIRS, EMULATE)


@triton.jit
def _kind_page_load(U8, F16, plan, base, group, tok0, D: tl.constexpr,
                    R_CODE: tl.constexpr, R_ROW: tl.constexpr, R_SHIFT: tl.constexpr,
                    R_MASK: tl.constexpr, R_SCALE: tl.constexpr, R_ZERO: tl.constexpr,
                    R_GROUP: tl.constexpr, PAIRS: tl.constexpr):
    """`_kind_page`'s loads: the page's codes (int32, [2, D, 16] under PAIRS, else [D, 32],
    in `_kind_page`'s token order) and its scales and zeros (float32, the codes' channel
    layout), not yet combined: a caller can issue them early and dequantize later."""
    if PAIRS:
        half = tl.arange(0, 2)[:, None, None]
        ch = (2 * tl.arange(0, D // 2))[None, :, None] + tl.arange(0, 2)[None, None, :] + 0 * half
    else:
        half = 0
        ch = tl.arange(0, D)
    code, row, shift, bits, keep, scale, zero = _channel_plan(
        plan, F16, base, group, tok0, ch, D, R_CODE, R_ROW, R_SHIFT, R_MASK, R_SCALE, R_ZERO,
        R_GROUP)
    ptr0 = U8 + base + (code + (tok0 + 16 * half) * row)
    if PAIRS:
        codes = tl.reshape(_tokens(ptr0, row, shift, bits, keep, 0, 16), [2, D, 16])
        return codes, tl.reshape(scale, [2, D]), tl.reshape(zero, [2, D])
    else:
        return tl.reshape(_tokens(ptr0, row, shift, bits, keep, 0, 32), [D, 32]), scale, zero


@triton.jit
def _kind_page_dequant(codes, scale, zero, D: tl.constexpr, PAIRS: tl.constexpr,
                       EMULATE: tl.constexpr):
    """`_kind_page_load`'s codes, scales and zeros -> x^T [D, 32] as bf16 halves."""
    if PAIRS:
        x = codes.to(tl.float32) * scale[:, :, None] + zero[:, :, None]
        x = tl.reshape(tl.permute(x, (1, 0, 2)), [D, 32])
    else:
        x = codes.to(tl.float32) * scale[:, None] + zero[:, None]
    return _split_bf16(x, EMULATE)


@triton.jit
def _unit(PAGE_IDS, SEG_IDS, HEADERS, bh, max_sel, seg0, pps, h, i, ok, HDR_W: tl.constexpr,
          BASE_COL: tl.constexpr, STRIDE_COL: tl.constexpr, LAYOUT_COL: tl.constexpr,
          K_GROUP_COL: tl.constexpr, V_GROUP_COL: tl.constexpr, HAS_SELECT: tl.constexpr):
    """(page, byte base of the head's block, layout, K group, V group) of the i-th listed page;
    nothing is read unless `ok` (stage 1 reads these one page ahead: four dependent loads off
    the critical path)."""
    if HAS_SELECT:
        page = tl.load(PAGE_IDS + bh * max_sel + i, mask=ok, other=0)
    else:
        page = i
    seg = tl.load(SEG_IDS + seg0 + page // pps, mask=ok, other=0).to(tl.int64)
    hdr = HEADERS + seg * HDR_W
    base = tl.load(hdr + BASE_COL, mask=ok, other=0).to(tl.int64) * 16 + \
        h * tl.load(hdr + STRIDE_COL, mask=ok, other=0)
    return (page, base, tl.load(hdr + LAYOUT_COL, mask=ok, other=0).to(tl.int64),
            tl.load(hdr + K_GROUP_COL, mask=ok, other=1),
            tl.load(hdr + V_GROUP_COL, mask=ok, other=1))


@triton.jit
def _flush(acc_rot, m_flushed, m, addr, v_offset, h, ACC, rows, mask_g, offs_d,
           D: tl.constexpr, BLOCK_J: tl.constexpr, EMULATE: tl.constexpr):
    """ACC[rows] = ACC[rows] * exp(m_flushed - m) + acc_rot @ R_v (just acc_rot @ R_v at the
    first flush, m_flushed = -inf), R_v the row's V read transform (bf16 [D, D] at `addr`; 0:
    the identity), BLOCK_J output channels at a time: the raw-basis accumulator lives in the
    split's workspace slot, not in registers (stage 1 sits at the register limit without it).
    The caller orders these stores before the next flush's reads (a CTA barrier)."""
    keep = (m_flushed > float("-inf"))[:, None]
    scale = tl.exp(m_flushed - m)[:, None]
    mat = addr.to(tl.pointer_type(tl.bfloat16)) + (v_offset + h) * D * D
    for j0 in tl.static_range(0, D, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        if addr == 0:
            r = (offs_d[:, None] == offs_j[None, :]).to(tl.bfloat16)
        else:
            r = tl.load(mat + offs_d[:, None] * D + offs_j[None, :])
        part = dot_exact(acc_rot, r, EMULATE)
        at = ACC + rows[:, None] * D + offs_j[None, :]
        part += tl.where(keep, tl.load(at, mask=mask_g[:, None], other=0.0) * scale, 0.0)
        tl.store(at, part, mask=mask_g[:, None])


@triton.jit
def _request_decode_stage1(
    Q_ROT, Q_S,  # fp32 [B * W, H, G, D] (row's K basis), [B, H, G, D] (raw); pre-scaled
    ARENA_U8, ARENA_F16, HEADERS, PLANS,  # the layer's arena, headers, layout plans
    SEG_INDPTR, SEG_IDS,  # int32 [B * W + 1], [S]: each row's segments in position order
    PAGE_IDS, PAGE_COUNTS,  # int32 [B, H, K] ascending, [B, H] (HAS_SELECT), else unused
    REQ_PAGES,  # int32 [B]
    PTRS,  # int64 [B * W]: each row's bases tensor
    HOT_K, HOT_V, HOT_ROWS, HOT_LENS,  # bf16 [N, H, D] x2, int64 [B, T], int32 [B]
    PART_M, PART_L, PART_ACC,  # fp32 [B, H, NP, G], [B, H, NP, G], [B, H, NP, G, D]
    v_offset, H, G, W, row_pages, pps, max_sel, num_splits, hot_splits, hot_t,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr,
    HDR_W: tl.constexpr, PLAN_W: tl.constexpr, BASE_COL: tl.constexpr, STRIDE_COL: tl.constexpr,
    LAYOUT_COL: tl.constexpr, K_GROUP_COL: tl.constexpr, V_GROUP_COL: tl.constexpr,
    R_CODE: tl.constexpr, R_ROW: tl.constexpr, R_SHIFT: tl.constexpr, R_MASK: tl.constexpr,
    R_SCALE: tl.constexpr, R_ZERO: tl.constexpr, R_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, SUB: tl.constexpr, HOT_N: tl.constexpr, HAS_SELECT: tl.constexpr,
    EMULATE: tl.constexpr, TOKEN_GATHER: tl.constexpr, PAIRS: tl.constexpr,
    EARLY_V: tl.constexpr, ONE_MMA: tl.constexpr,
):
    """Programs (request, KV head, split): splits [0, num_splits) share the request's selected
    pages, [num_splits, num_splits + hot_splits) its hot tokens. Products: q (or p) split in two
    bf16 halves against exact bf16 operands (codes, cache entries, bases): `dot_exact`; ONE_MMA:
    the hot tokens' and the pages' products are single bf16 MMAs (`dot_bf16`, `_mma`)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    bh = b * H + h
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    mask_g = offs_g < G
    rows = (bh * (num_splits + hot_splits) + split) * G + offs_g  # this program's part
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    if split >= num_splits:  # a share of the hot tokens, raw basis, read in place
        offs_t = tl.arange(0, HOT_N)
        q = tl.load(Q_S + (bh * G + offs_g)[:, None] * D + offs_d[None, :],
                    mask=mask_g[:, None], other=0.0)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        n = tl.load(HOT_LENS + b)
        per = tl.cdiv(tl.cdiv(n, hot_splits), HOT_N) * HOT_N
        lo = (split - num_splits) * per
        hi = tl.minimum(lo + per, n)
        for start in range(lo, hi, HOT_N):
            tok = start + offs_t
            ok = tok < hi
            row = tl.load(HOT_ROWS + b * hot_t + tok, mask=ok, other=0)
            at = row[:, None] * (H * D) + h * D + offs_d[None, :]
            k = tl.load(HOT_K + at, mask=ok[:, None], other=0.0)
            if ONE_MMA:
                s = dot_bf16(q, tl.trans(k), EMULATE)
            else:
                s = dot_exact(q, tl.trans(k), EMULATE)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(HOT_V + at, mask=ok[:, None], other=0.0)
            if ONE_MMA:
                acc = acc * alpha[:, None] + dot_bf16(p, v, EMULATE)
            else:
                acc = acc * alpha[:, None] + dot_exact(p, v, EMULATE)
            m = m_new
        tl.store(PART_ACC + rows[:, None] * D + offs_d[None, :], acc, mask=mask_g[:, None])
    else:
        if HAS_SELECT:
            count = tl.load(PAGE_COUNTS + bh)
        else:
            count = tl.load(REQ_PAGES + b)
        per_split = tl.cdiv(count, num_splits)
        start = split * per_split
        end = tl.minimum(start + per_split, count)
        seg0 = tl.load(SEG_INDPTR + b * W)
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.zeros([BLOCK_G, D], tl.float32)
        q_hi, q_lo = _split_bf16(q, EMULATE)  # TOKEN_GATHER: q's bf16 halves, per row
        acc = tl.zeros([BLOCK_G, D], tl.float32)  # the current row's V basis
        cur = -1  # the current row
        m_flushed = tl.full([BLOCK_G], float("-inf"), tl.float32)  # m at the last flush
        page_n, base_n, lay_n, kg_n, vg_n = _unit(
            PAGE_IDS, SEG_IDS, HEADERS, bh, max_sel, seg0, pps, h, start, start < end, HDR_W,
            BASE_COL, STRIDE_COL, LAYOUT_COL, K_GROUP_COL, V_GROUP_COL, HAS_SELECT)
        for unit in range(start * SUB, end * SUB):  # SUB units of BLOCK_N tokens per page
            page, base, lay, kg, vg = page_n, base_n, lay_n, kg_n, vg_n
            nxt = (unit + 1) // SUB
            page_n, base_n, lay_n, kg_n, vg_n = _unit(
                PAGE_IDS, SEG_IDS, HEADERS, bh, max_sel, seg0, pps, h, nxt, nxt < end, HDR_W,
                BASE_COL, STRIDE_COL, LAYOUT_COL, K_GROUP_COL, V_GROUP_COL, HAS_SELECT)
            w = page // row_pages
            if w != cur:
                if cur >= 0:
                    _flush(acc, m_flushed, m, tl.load(PTRS + b * W + cur), v_offset, h,
                           PART_ACC, rows, mask_g, offs_d, D, BLOCK_J, EMULATE)
                    tl.debug_barrier()
                    m_flushed = m
                    acc = tl.zeros([BLOCK_G, D], tl.float32)
                q = tl.load(Q_ROT + ((b * W + w) * H * G + h * G + offs_g)[:, None] * D +
                            offs_d[None, :], mask=mask_g[:, None], other=0.0)
                if TOKEN_GATHER:
                    q_hi, q_lo = _split_bf16(q, EMULATE)
                cur = w
            plan = PLANS + lay * (2 * PLAN_W * D)
            tok0 = (page % pps) * (SUB * BLOCK_N) + (unit % SUB) * BLOCK_N
            if TOKEN_GATHER:  # whole pages (SUB == 1), dequantized: x^T [D, 32] halves
                k_codes, k_scale, k_zero = _kind_page_load(
                    ARENA_U8, ARENA_F16, plan, base, kg, tok0, D, R_CODE, R_ROW, R_SHIFT, R_MASK,
                    R_SCALE, R_ZERO, R_GROUP, PAIRS)
                if EARLY_V:  # V's loads issued with K's (their latencies overlap)
                    v_codes, v_scale, v_zero = _kind_page_load(
                        ARENA_U8, ARENA_F16, plan + PLAN_W * D, base, vg, tok0, D, R_CODE,
                        R_ROW, R_SHIFT, R_MASK, R_SCALE, R_ZERO, R_GROUP, PAIRS)
                k_hi, k_lo = _kind_page_dequant(k_codes, k_scale, k_zero, D, PAIRS, EMULATE)
                s = _mma(q_hi, q_lo, k_hi, k_lo, ONE_MMA)
            else:
                tok = tok0 + offs_n
                kc, ks, kz = _kind_codes(ARENA_U8, ARENA_F16, plan, base, kg, tok0, tok, offs_d,
                                         D, R_CODE, R_ROW, R_SHIFT, R_MASK, R_SCALE, R_ZERO,
                                         R_GROUP)
                # q . k = (q * scale) . codes + q . zero
                s = dot_exact(q * ks[None, :], tl.trans(kc), EMULATE) + \
                    tl.sum(q * kz[None, :], 1)[:, None]
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            if TOKEN_GATHER:
                if EARLY_V:
                    v_hi, v_lo = _kind_page_dequant(v_codes, v_scale, v_zero, D, PAIRS, EMULATE)
                else:
                    v_hi, v_lo = _kind_page(ARENA_U8, ARENA_F16, plan + PLAN_W * D, base, vg,
                                            tok0, D, R_CODE, R_ROW, R_SHIFT, R_MASK, R_SCALE,
                                            R_ZERO, R_GROUP, PAIRS, EMULATE)
                p_hi, p_lo = _split_bf16(p, EMULATE)
                pv = _mma(p_hi, p_lo, tl.trans(v_hi), tl.trans(v_lo), ONE_MMA)
            else:
                vc, vs, vz = _kind_codes(ARENA_U8, ARENA_F16, plan + PLAN_W * D, base, vg, tok0,
                                         tok, offs_d, D, R_CODE, R_ROW, R_SHIFT, R_MASK, R_SCALE,
                                         R_ZERO, R_GROUP)
                # p . v = (p . codes) * scale + sum(p) * zero
                pv = dot_exact(p, vc, EMULATE) * vs[None, :] + \
                    tl.sum(p, 1)[:, None] * vz[None, :]
            acc = acc * alpha[:, None] + pv
            m = m_new
        if cur >= 0:
            _flush(acc, m_flushed, m, tl.load(PTRS + b * W + cur), v_offset, h, PART_ACC, rows,
                   mask_g, offs_d, D, BLOCK_J, EMULATE)
        else:  # no pages: an empty part (weight 0 in the merge, but finite)
            tl.store(PART_ACC + rows[:, None] * D + offs_d[None, :],
                     tl.zeros([BLOCK_G, D], tl.float32), mask=mask_g[:, None])
    tl.store(PART_M + rows, m, mask=mask_g)
    tl.store(PART_L + rows, l, mask=mask_g)


@triton.jit
def _request_decode_stage2(
    PART_M, PART_L, PART_ACC,  # stage 1's parts (raw basis)
    OUT,  # [B, Hq, D] (any float dtype)
    PAGE_COUNTS, READ,  # int32 [B, H], int64 [1]: pages read, summed here (HAS_SELECT)
    H, G, num_parts,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_SELECT: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """One program per (request, KV head, BLOCK_C channels): the parts as one tile dimension
    (their maxima and sums in one load, their accumulators BLOCK_P parts at a time)."""
    bh = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_g = tl.arange(0, BLOCK_G)
    offs_p = tl.arange(0, BLOCK_P)
    mask_g = offs_g < G
    m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        pg = (bh * num_parts + p0 + offs_p[:, None]) * G + offs_g[None, :]
        ok = ((p0 + offs_p) < num_parts)[:, None] & mask_g[None, :]
        m_all = tl.maximum(m_all, tl.max(tl.load(PART_M + pg, mask=ok, other=float("-inf")), 0))
    m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_tot = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        pg = (bh * num_parts + p0 + offs_p[:, None]) * G + offs_g[None, :]
        ok = ((p0 + offs_p) < num_parts)[:, None] & mask_g[None, :]
        wgt = tl.exp(tl.load(PART_M + pg, mask=ok, other=float("-inf")) - m_ref[None, :])
        l_tot += tl.sum(wgt * tl.load(PART_L + pg, mask=ok, other=0.0), 0)
        tile = tl.load(PART_ACC + pg[:, :, None] * D + offs_c[None, None, :],
                       mask=ok[:, :, None], other=0.0)
        acc += tl.sum(wgt[:, :, None] * tile, 0)
    l_tot = tl.where(mask_g & (l_tot > 0), l_tot, 1.0)
    res = store_rounded(acc / l_tot[:, None], ROUND_BF16)
    tl.store(OUT + (bh * G + offs_g)[:, None] * D + offs_c[None, :],
             res.to(OUT.dtype.element_ty), mask=mask_g[:, None])
    if HAS_SELECT:
        if tl.program_id(1) == 0:
            tl.atomic_add(READ, tl.load(PAGE_COUNTS + bh).to(tl.int64))


def stage1_makespan(pairs: int, pages: int, splits: int, hot_splits: int, slots: int) -> float:
    """Modelled time (us) of stage 1: `pairs` (request, KV head) x (`splits` page programs of
    ceil(pages / splits) pages each, then `hot_splits` hot-token programs), started in launch
    order (split-major, as the grid's last axis) on `slots` equal slots, each program on the
    first slot free."""
    per = -(-pages // splits)
    slot = [0.0] * slots
    for part in range(splits + hot_splits):
        if part < splits:
            n = max(0, min(per, pages - part * per))
            cost = STAGE1_PROGRAM_US + n * STAGE1_PAGE_US
        else:
            cost = STAGE1_HOT_US
        # `pairs` programs of equal cost: each takes the earliest free slot
        for _ in range(pairs):
            heapq.heapreplace(slot, slot[0] + cost)
    return max(slot)


def stage1_splits(pairs: int, pages: int, hot_splits: int, slots: int,
                  max_splits: int = 64) -> int:
    """Stage 1's page splits for `pairs` (request, KV head) pairs of up to `pages` selected
    pages: the count in [1, max_splits] (each split >= MIN_PAGES_PER_SPLIT pages) with the
    least `stage1_makespan`, the fewest splits on a tie."""
    cap = max(1, min(max_splits, pages // MIN_PAGES_PER_SPLIT))
    return min(range(1, cap + 1),
               key=lambda s: (stage1_makespan(pairs, pages, s, hot_splits, slots), s))


@dataclass
class DecodeTables:
    """What a step reads besides q: the layer's arena and the step's tables (device tensors)."""
    data: torch.Tensor  # uint8 [N]: the layer's arena
    headers: torch.Tensor  # int32 [S, HEADER_WIDTH]
    plans: torch.Tensor  # int32 [layouts, 2, PLAN_W, D]
    seg_indptr: torch.Tensor  # int32 [B * W + 1]
    seg_ids: torch.Tensor  # int32 [>= seg_indptr[-1]]
    req_pages: torch.Tensor  # int32 [B]: compressed 32-token pages of each request
    hot_k: torch.Tensor  # bf16 [N, H, D]: the layer's hot buffer
    hot_v: torch.Tensor
    hot_rows: torch.Tensor  # int64 [B, T]: request b's hot token t is row hot_rows[b, t]
    hot_lens: torch.Tensor  # int32 [B]


class RequestDecode:
    """plan (host: shapes, splits, workspace; once per batch size) then, per layer, `queries`
    and `run` (launches only, no host sync: what a CUDA graph records)."""

    def __init__(self):
        self._planned = False
        self.read = None  # int64 [1] on the device: (page, KV head) pairs the runs read

    def plan(self, *, batch: int, rows_per_request: int, row_pages: int, pages_per_seg: int,
             num_kv_heads: int, num_qo_heads: int, head_dim: int, max_selected: int | None,
             sm_scale: float, device, num_splits: int | None = None, hot_tokens: int = 1024,
             workspace: dict | None = None, num_warps: int = 4, block_tokens: int = 32,
             maxnreg: int | None = None, gather: str | None = None,
             early_v: bool | None = None, products: str | None = None) -> None:
        """`max_selected`: pages per (request, KV head) a run's selection lists at most (None:
        runs read every page, `run` without a selection); `hot_tokens`: hot tokens a request
        may have (the hot rows' table width), read by cdiv(hot_tokens, 128) splits;
        `workspace`: float32 buffers shared by plans that never run at once (the decode graphs
        of several batch sizes)."""
        h, d = num_kv_heads, head_dim
        if num_qo_heads % h:
            raise ValueError(f"plan: {num_qo_heads} query heads do not group evenly over {h} KV "
                             f"heads")
        if d < 32 or d & (d - 1):
            raise ValueError(f"plan: head_dim {d} must be a power of two >= 32")
        if row_pages % pages_per_seg:
            raise ValueError(f"plan: a row's {row_pages} pages are not whole segments of "
                             f"{pages_per_seg} pages")
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" names the current device
            dev = torch.device("cuda", torch.cuda.current_device())
        g = num_qo_heads // h
        most = max_selected if max_selected is not None else rows_per_request * row_pages
        hot_splits = max(1, -(-hot_tokens // HOT_SPLIT_TOKENS))
        if num_splits is None:
            num_splits = stage1_splits(batch * h, most, hot_splits,
                                       STAGE1_PROGRAMS_PER_SM * _num_sms(dev))
        if not 1 <= num_splits <= 1024:
            raise ValueError(f"plan: num_splits={num_splits} must be in [1, 1024]")
        self.batch, self.width, self.row_pages, self.pps = batch, rows_per_request, row_pages, \
            pages_per_seg
        self.kv_heads, self.num_qo_heads, self.group, self.head_dim = h, num_qo_heads, g, d
        self.max_selected, self.sm_scale, self.device = max_selected, float(sm_scale), dev
        self.num_splits, self.num_warps = num_splits, num_warps
        if block_tokens not in (16, 32):
            raise ValueError(f"plan: block_tokens={block_tokens} must be 16 or 32")
        self.block_n = block_tokens
        gather = GATHER if gather is None else gather
        if gather not in ("channels", "tokens", "pairs"):
            raise ValueError(f"plan: gather={gather!r} must be 'channels', 'tokens' or 'pairs'")
        if gather != "channels" and block_tokens != PAGE_TOKENS:
            raise ValueError(f"plan: gather={gather!r} reads whole {PAGE_TOKENS}-token pages "
                             f"(block_tokens={block_tokens})")
        self.gather = gather
        self.early_v = EARLY_V if early_v is None else bool(early_v)
        products = PRODUCTS if products is None else products
        if products not in ("exact", "bf16"):
            raise ValueError(f"plan: products={products!r} must be 'exact' or 'bf16'")
        if products == "bf16" and gather == "channels":
            raise ValueError("plan: products='bf16' is for the token gathers ('tokens', 'pairs')")
        self.products = products
        self.launch = {} if maxnreg is None else {"maxnreg": maxnreg}  # stage 1's register cap
        self.hot_splits = hot_splits
        parts = num_splits + self.hot_splits

        def buf(name: str, *shape: int) -> torch.Tensor:
            n = 1
            for x in shape:
                n *= x
            if workspace is None:
                return torch.empty(n, dtype=torch.float32, device=dev).view(*shape)
            have = workspace.get(name)
            if have is None or have.numel() < n:
                have = workspace[name] = torch.empty(n, dtype=torch.float32, device=dev)
            return have[:n].view(*shape)

        self.q_rot = buf("q_rot", batch * rows_per_request, h, g, d)
        self.q_s = buf("q_s", batch, h, g, d)
        self.part_m = buf("part_m", batch, h, parts, g)
        self.part_l = buf("part_l", batch, h, parts, g)
        self.part_acc = buf("part_acc", batch, h, parts, g, d)
        if self.read is None or self.read.device != dev:
            self.read = torch.zeros(1, dtype=torch.int64, device=dev)
        self._planned = True

    def queries(self, q: torch.Tensor, basis_ptrs: torch.Tensor, k_offset: int,
                req_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Hq, D] -> (q_rot fp32 [B * W, H, G, D]: sm_scale q in each reached row's K
        basis, q_s fp32 [B, H, G, D]: sm_scale q). One launch."""
        self._check_q(q)
        b, h, g, d, w = self.batch, self.kv_heads, self.group, self.head_dim, self.width
        if basis_ptrs.dtype != torch.int64 or tuple(basis_ptrs.shape) != (b * w,):
            raise ValueError(f"queries: basis_ptrs must be int64 [{b * w}], got "
                             f"{basis_ptrs.dtype} {tuple(basis_ptrs.shape)}")
        block_n = min(d, 64)
        _request_queries[(b * w, h, d // block_n)](
            q, basis_ptrs, req_pages, self.q_rot, self.q_s, k_offset, h, g, w, self.row_pages,
            self.sm_scale, q.stride(0), D=d, BLOCK_G=max(16, triton.next_power_of_2(g)),
            BLOCK_N=block_n, EMULATE=interpreting(), num_warps=4)
        return self.q_rot, self.q_s

    def run(self, q_rot: torch.Tensor, q_s: torch.Tensor, tables: DecodeTables,
            basis_ptrs: torch.Tensor, v_offset: int, out: torch.Tensor, *,
            page_ids: torch.Tensor | None = None,
            page_counts: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of every request over its selected pages (`page_ids` int32 [B, H, K]
        ascending, the first `page_counts` [B, H] valid; none: every compressed page) and its
        hot tokens, written into `out` [B, Hq, D]. Two launches."""
        if not self._planned:
            raise RuntimeError("run: call plan() first")
        b, h, g, d = self.batch, self.kv_heads, self.group, self.head_dim
        if (page_ids is None) != (page_counts is None):
            raise ValueError("run: page_ids and page_counts go together")
        has_select = page_ids is not None
        if has_select and (page_ids.dtype != torch.int32 or page_ids.dim() != 3 or
                           tuple(page_ids.shape[:2]) != (b, h) or not page_ids.is_contiguous()):
            raise ValueError(f"run: page_ids must be contiguous int32 [{b}, {h}, K], got "
                             f"{page_ids.dtype} {tuple(page_ids.shape)}")
        if tuple(out.shape) != (b, self.num_qo_heads, d) or not out.is_contiguous():
            raise ValueError(f"run: out must be contiguous [{b}, {self.num_qo_heads}, {d}], got "
                             f"{tuple(out.shape)}")
        if tables.seg_indptr.numel() != b * self.width + 1:
            raise ValueError(f"run: seg_indptr has {tables.seg_indptr.numel()} entries for "
                             f"{b} x {self.width} rows")
        dummy = tables.req_pages
        parts = self.num_splits + self.hot_splits
        _request_decode_stage1[(b, h, parts)](
            q_rot, q_s, tables.data, tables.data.view(torch.float16), tables.headers,
            tables.plans, tables.seg_indptr, tables.seg_ids,
            page_ids if has_select else dummy, page_counts if has_select else dummy,
            tables.req_pages, basis_ptrs, tables.hot_k, tables.hot_v, tables.hot_rows,
            tables.hot_lens, self.part_m, self.part_l, self.part_acc,
            v_offset, h, g, self.width, self.row_pages, self.pps,
            page_ids.shape[2] if has_select else 0, self.num_splits, self.hot_splits,
            tables.hot_rows.shape[1],
            D=d, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_J=32,
            HDR_W=HEADER_WIDTH, PLAN_W=len(PLAN_FIELDS), BASE_COL=HDR["base16"],
            STRIDE_COL=HDR["head_stride"], LAYOUT_COL=HDR["layout"],
            K_GROUP_COL=HDR["k_group"], V_GROUP_COL=HDR["v_group"], R_CODE=PLAN_ROW["code"],
            R_ROW=PLAN_ROW["row"], R_SHIFT=PLAN_ROW["shift"], R_MASK=PLAN_ROW["mask"],
            R_SCALE=PLAN_ROW["scale"], R_ZERO=PLAN_ROW["zero"], R_GROUP=PLAN_ROW["group_bytes"],
            BLOCK_N=self.block_n, SUB=PAGE_TOKENS // self.block_n, HOT_N=HOT_TOKENS,
            HAS_SELECT=has_select, EMULATE=interpreting(),
            TOKEN_GATHER=self.gather in ("tokens", "pairs"), PAIRS=self.gather == "pairs",
            EARLY_V=self.early_v, ONE_MMA=self.products == "bf16",
            num_warps=self.num_warps,
            **self.launch)
        block_c = min(d, 32)
        _request_decode_stage2[(b * h, d // block_c)](
            self.part_m, self.part_l, self.part_acc, out,
            page_counts if has_select else dummy, self.read, h, g, parts, D=d,
            BLOCK_G=triton.next_power_of_2(g), BLOCK_C=block_c,
            BLOCK_P=min(32, triton.next_power_of_2(parts)), HAS_SELECT=has_select,
            ROUND_BF16=rounds_bf16_stores(out.dtype), num_warps=4)
        return out

    def _check_q(self, q: torch.Tensor) -> None:
        if not self._planned:
            raise RuntimeError("queries: call plan() first")
        want = (self.batch, self.num_qo_heads, self.head_dim)
        if tuple(q.shape) != want or q.stride()[1:] != (self.head_dim, 1) or \
                not q.is_floating_point() or q.device != self.device:
            raise ValueError(f"queries: q must be a float tensor {list(want)} on {self.device} "
                             f"with heads and channels contiguous, got {q.dtype} "
                             f"{tuple(q.shape)} strides {q.stride()} on {q.device}")


def request_decode_reference(q: torch.Tensor, tables: DecodeTables, wholes: list,
                             layer: int, layers: int, rows_per_request: int, row_pages: int,
                             pages_per_seg: int, sm_scale: float, page_ids=None,
                             page_counts=None, products: str = "exact") -> torch.Tensor:
    """Torch oracle of queries + run (float32 [B, Hq, D]), request by request on the host:
    each selected page decoded from the arena bytes through its layout plan
    (`band_unpack.decode_rotated_reference`), scored against q in its row's K basis, its V
    rotated back through the row's V basis, one softmax with the hot tokens. `wholes[r]`: row
    r's bf16 bases tensor [2 * layers, H, D, D] (None: the identity). `products="bf16"` rounds
    the operands stage 1's single MMAs take to bf16 (q in each basis, the dequantized pages;
    not the softmax weights, whose rounding is left to the caller's tolerance)."""
    from .band_unpack import decode_rotated_reference

    if products not in ("exact", "bf16"):
        raise ValueError(f"products={products!r} must be 'exact' or 'bf16'")

    def rnd(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).float() if products == "bf16" else x

    b_n, hq, d = q.shape
    h = tables.hot_k.shape[1]
    g = hq // h
    out = torch.zeros(b_n, hq, d)
    segs = tables.seg_ids.long()
    indptr = tables.seg_indptr.cpu().long()
    arena = _arena_view(tables, pages_per_seg * PAGE_TOKENS)
    for b in range(b_n):
        n_pages = int(tables.req_pages[b])
        seg0 = int(indptr[b * rows_per_request])
        qs = q[b].float().cpu().view(h, g, d) * sm_scale
        n_hot = int(tables.hot_lens[b])
        hot = tables.hot_rows[b, :n_hot].long()
        for hh in range(h):
            if page_ids is None:
                pages = list(range(n_pages))
            else:
                pages = page_ids[b, hh, :int(page_counts[b, hh])].tolist()
            scores, values = [], []
            for p in pages:
                w = p // row_pages
                whole = wholes[b * rows_per_request + w]
                k_rot, v_rot = decode_rotated_reference(arena, segs[seg0 + p // pages_per_seg]
                                                        .view(1).int())
                t0 = (p % pages_per_seg) * PAGE_TOKENS
                kr = k_rot[0, hh, t0:t0 + PAGE_TOKENS].float().cpu()
                vr = v_rot[0, hh, t0:t0 + PAGE_TOKENS].float().cpu()
                if whole is None:
                    rk = rv = torch.eye(d)
                else:
                    mats = whole.reshape(-1, d, d).float().cpu()
                    rk, rv = mats[layer * h + hh], mats[(layers + layer) * h + hh]
                scores.append(rnd(qs[hh] @ rk.T) @ rnd(kr).T)
                values.append(rnd(vr) @ rv)
            kh = tables.hot_k[hot, hh].float().cpu()
            vh = tables.hot_v[hot, hh].float().cpu()
            s = torch.cat(scores + [rnd(qs[hh]) @ kh.T], 1)
            v = torch.cat(values + [vh], 0)
            out[b, hh * g:(hh + 1) * g] = torch.softmax(s, 1) @ v
    return out


def _arena_view(tables: DecodeTables, segment_tokens: int):
    """The tables as a PackedArena, for `decode_rotated_reference` (which reads data, headers,
    plans and the segment size only)."""
    from .layout import PackedArena
    dev = tables.data.device
    return PackedArena(tables.data, tables.headers, torch.zeros(2, dtype=torch.int32, device=dev),
                       tables.seg_ids, None, None, tables.hot_k[:1, :, None],
                       tables.hot_v[:1, :, None], torch.zeros(1, dtype=torch.int32, device=dev),
                       tables.plans, segment_tokens=segment_tokens, page_tokens=PAGE_TOKENS,
                       payload={})
