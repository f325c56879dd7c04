"""Second stage of page selection on the GPU: the candidate pages the bound kept (`page_select`
at `select.rescore_factor` x the budget) scored on their compressed K itself, so that the
budget's pages are those with the highest real scores rather than the highest bounds.

    score(page) = max over the page's 32 tokens and the group's G query heads of
                  sum_{c < R} q_rot[c] * k_rot[t, c]

k_rot is the page's K in its block's SVD basis as the arena stores it (codes * scale + zero,
through the layout's per-channel plan), q_rot the query in the same basis (`queries`). R =
`select.rescore_channels` leading channels (where the basis puts K's energy), or every channel.
The codec's torch reference decode does the same (`codec.attention._rescore`,
`_leading_channel_scores`); measured there on real SmolLM2 KV at 8K and a 1/8 budget: attention
error 0.226 -> 0.142 with 4x candidates and R = 32 (docs/codec.md).

One program per (list owner, KV head, block of candidates); each candidate read once, R channels
of its 32 tokens. Writes only the candidates' entries of `out` ([B, H, P_out], a page id's
column); `page_rescore` fills the rest with -inf first, so the output is what `select_page_list`
(or `RowSelection.select`) takes to keep the budget's best. A list owner is a request whose
pages span W query rows of `row_pages` pages each (the decode graph: page p reads q row
b * W + p // row_pages), or one arena row (the eager path: W = 1, row_pages >= its pages).

    scores = page_rescore(q_rot, data, headers, plans, seg_indptr, seg_ids, ids, counts,
                          rows_per_owner=W, row_pages=row_pages, pages_per_seg=pps,
                          channels=32, out=bounds)
    ids, counts = select_page_list(scores, req_pages, budget, sink, recent)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .band_unpack import PLAN_ROW
from .common import channel_plan
from .layout import HDR, HEADER_WIDTH, PLAN_FIELDS

PAGE_TOKENS = 32
# Candidates per program by layout: the most programs (a candidate's loads are a dependent
# chain, page -> segment -> header -> codes, so more programs in flight hide more of its
# latency). Measured alone on an H100 (2026-12-08, benchmarks/page_rescore_bench.py, us at
# 1 x 128K / 8 x 128K / 17 x 32K): bands 2: 11.5 / 60.1 / 112.4, 4: 15.3 / 63.9 / 112.5, 16:
# 50.7 / 81.7 / 152.9; rows 4: 26.2 / 173.1 / 355.7, 16: 33.7 / 188.9 / 373.3; columns 4:
# 16.7 / 86.5 / 170.6, 16: 44.9 / 98.1 (h100_2026-12-08_rescore_layouts/).
BLOCK_CANDIDATES = {"rows": 4, "columns": 4, "bands": 2}
PREFETCH = True  # a program's candidate entries loaded as vectors first (`page_rescore`)


@triton.jit
def _scores_rows(Q_ROT, ARENA_U8, ARENA_F16, page, base, plan, group, qrow, h, H, G, pps,
                 D: tl.constexpr, R: tl.constexpr, BLOCK_G: tl.constexpr, R_CODE: tl.constexpr,
                 R_ROW: tl.constexpr, R_SHIFT: tl.constexpr, R_MASK: tl.constexpr,
                 R_SCALE: tl.constexpr, R_ZERO: tl.constexpr, R_GROUP: tl.constexpr):
    """A candidate's [BLOCK_G, 32] scores over a [G, 32, R] product reduced over R."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, R)
    offs_t = tl.arange(0, 32)
    tok0 = (page % pps) * 32
    # the leading R channels' per-channel plan (a dropped channel: mask 0, reads as 0)
    code, row, shift, bits, keep, scale, zero = channel_plan(
        plan, ARENA_F16, base, group, tok0, offs_c, D, R_CODE, R_ROW, R_SHIFT, R_MASK,
        R_SCALE, R_ZERO, R_GROUP)
    raw = tl.load(ARENA_U8 + base + code[None, :] + (tok0 + offs_t)[:, None] * row[None, :],
                  mask=keep[None, :], other=0)
    codes = ((raw.to(tl.int32) >> shift[None, :]) & bits[None, :]).to(tl.float32)
    k = codes * scale[None, :] + zero[None, :]  # [32, R]; 0 on a dropped channel
    q = tl.load(Q_ROT + ((qrow * H + h) * G + offs_g)[:, None] * D + offs_c[None, :],
                mask=(offs_g < G)[:, None], other=0.0)  # [BLOCK_G, R]
    return tl.sum(q[:, None, :] * k[None, :, :], 2)  # [BLOCK_G, 32], float32 products


@triton.jit
def _scores_columns(Q_ROT, ARENA_U8, ARENA_F16, page, base, plan, group, qrow, h, H, G, pps,
                    D: tl.constexpr, R: tl.constexpr, BLOCK_G: tl.constexpr,
                    R_CODE: tl.constexpr, R_ROW: tl.constexpr, R_SHIFT: tl.constexpr,
                    R_MASK: tl.constexpr, R_SCALE: tl.constexpr, R_ZERO: tl.constexpr,
                    R_GROUP: tl.constexpr):
    """The same scores channel by channel (one warp, a lane per token): each of the R channels
    read as one byte per token (its plan entries uniform loads) and accumulated into the
    [G, 32] scores in registers, so no reduction crosses lanes (the row layout's reduction
    takes 167 shuffles of its 681 sm_90 instructions per candidate, x4 warps)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, 32)
    tok = ((page % pps) * 32 + offs_t).to(tl.int32)
    gidx = ((page % pps) * 32) // group  # the page's token group
    u8 = ARENA_U8 + base  # the head block: per channel int32 offsets from here
    f16 = ARENA_F16 + base // 2
    q_ptr = Q_ROT + ((qrow * H + h) * G + offs_g) * D
    s = tl.zeros([BLOCK_G, 32], dtype=tl.float32)
    for c in tl.static_range(R):
        bits = tl.load(plan + R_MASK * D + c)
        keep = bits != 0  # a dropped channel reads as 0
        goff = gidx * tl.load(plan + R_GROUP * D + c)
        scale = tl.load(f16 + (tl.load(plan + R_SCALE * D + c) + goff) // 2, mask=keep,
                        other=0.0).to(tl.float32)
        zero = tl.load(f16 + (tl.load(plan + R_ZERO * D + c) + goff) // 2, mask=keep,
                       other=0.0).to(tl.float32)
        raw = tl.load(u8 + (tl.load(plan + R_CODE * D + c) + tok * tl.load(plan + R_ROW * D + c)),
                      mask=(offs_t < 32) & keep, other=0)
        k = ((raw.to(tl.int32) >> tl.load(plan + R_SHIFT * D + c)) & bits).to(tl.float32) \
            * scale + zero  # [32]
        q = tl.load(q_ptr + c, mask=offs_g < G, other=0.0)  # [BLOCK_G]
        s += q[:, None] * k[None, :]
    return s


@triton.jit
def _band_channels(s, raw, sc, ze, q_ptr, mask_g, c0, j, cnt, PER: tl.constexpr,
                   BITS: tl.constexpr, EVEN_G: tl.constexpr, MASKED: tl.constexpr):
    """`s` plus the products of the PER channels j .. j + PER - 1 of a band held by the code
    bytes `raw` [32] (channel j + u in bits u * BITS ..); MASKED: only those below `cnt`."""
    for u in tl.static_range(PER):
        if MASKED:
            live = j + u < cnt
            scale = tl.load(sc + j + u, mask=live, other=0.0).to(tl.float32)
            zero = tl.load(ze + j + u, mask=live, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + c0 + j + u, mask=mask_g & live, other=0.0)
        else:
            scale = tl.load(sc + j + u).to(tl.float32)
            zero = tl.load(ze + j + u).to(tl.float32)
            if EVEN_G:
                q = tl.load(q_ptr + c0 + j + u)  # [BLOCK_G]
            else:
                q = tl.load(q_ptr + c0 + j + u, mask=mask_g, other=0.0)
        k = ((raw >> (u * BITS)) & ((1 << BITS) - 1)).to(tl.float32) * scale + zero
        s += q[:, None] * k[None, :]
    return s


@triton.jit
def _band_part(s, ARENA_U8, ARENA_F16, hdr, base, tok, gidx, q_ptr, mask_g, c0, budget,
               N_COL: tl.constexpr, CODES_COL: tl.constexpr, SCALE_COL: tl.constexpr,
               ZERO_COL: tl.constexpr, BITS: tl.constexpr, EVEN_G: tl.constexpr):
    """`s` plus the products of one band's leading channels (at most `budget`, the leading
    channels the earlier bands left; channel j of the band is channel c0 + j of the basis):
    each code byte loaded once per token for its 8 // BITS channels, the band's scales and
    zeros at affine offsets (`BlockLayout.channel_plan`: scale + 2 j + group * 2 n). Whole
    bytes unmasked, then at most one partial byte."""
    n = tl.load(hdr + N_COL)
    cnt = tl.maximum(tl.minimum(n, budget), 0)
    PER: tl.constexpr = 8 // BITS
    codes = ARENA_U8 + base + tl.load(hdr + CODES_COL) + tok * (n * BITS // 8)  # [32]
    f16 = ARENA_F16 + base // 2 + gidx * n
    sc = f16 + tl.load(hdr + SCALE_COL) // 2
    ze = f16 + tl.load(hdr + ZERO_COL) // 2
    whole = cnt // PER
    for i in range(0, whole):
        raw = tl.load(codes + i).to(tl.int32)  # [32]: PER channels of each token
        s = _band_channels(s, raw, sc, ze, q_ptr, mask_g, c0, i * PER, cnt, PER, BITS, EVEN_G,
                           False)
    if whole * PER < cnt:
        raw = tl.load(codes + whole).to(tl.int32)
        s = _band_channels(s, raw, sc, ze, q_ptr, mask_g, c0, whole * PER, cnt, PER, BITS,
                           EVEN_G, True)
    return s, cnt


@triton.jit
def _scores_bands(Q_ROT, ARENA_U8, ARENA_F16, hdr, page, base, group, qrow, h, H, G, pps,
                  D: tl.constexpr, R: tl.constexpr, BLOCK_G: tl.constexpr,
                  K_B8: tl.constexpr, K_B4: tl.constexpr, K_B2: tl.constexpr,
                  K_CODES8: tl.constexpr, K_CODES4: tl.constexpr, K_CODES2: tl.constexpr,
                  K_SCALE8: tl.constexpr, K_ZERO8: tl.constexpr, K_SCALE4: tl.constexpr,
                  K_ZERO4: tl.constexpr, K_SCALE2: tl.constexpr, K_ZERO2: tl.constexpr,
                  EVEN_G: tl.constexpr):
    """The same scores from the segment's header alone (one warp, a lane per token): K's bands
    are the leading channels in order 8, 4, 2 bits, each at affine offsets, so no per-channel
    plan entry is loaded and a code byte serves its 2 or 4 channels (the column layout spends
    14 loads per channel, 7 of them plan entries)."""
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    tok = ((page % pps) * 32 + tl.arange(0, 32)).to(tl.int32)
    gidx = ((page % pps) * 32) // group
    q_ptr = Q_ROT + ((qrow * H + h) * G + offs_g) * D
    s = tl.zeros([BLOCK_G, 32], dtype=tl.float32)
    s, c8 = _band_part(s, ARENA_U8, ARENA_F16, hdr, base, tok, gidx, q_ptr, mask_g, 0, R,
                       K_B8, K_CODES8, K_SCALE8, K_ZERO8, 8, EVEN_G)
    s, c4 = _band_part(s, ARENA_U8, ARENA_F16, hdr, base, tok, gidx, q_ptr, mask_g, c8,
                       R - c8, K_B4, K_CODES4, K_SCALE4, K_ZERO4, 4, EVEN_G)
    s, _ = _band_part(s, ARENA_U8, ARENA_F16, hdr, base, tok, gidx, q_ptr, mask_g,
                       c8 + c4, R - c8 - c4, K_B2, K_CODES2, K_SCALE2, K_ZERO2, 2, EVEN_G)
    return s


@triton.jit
def _page_rescore(
    Q_ROT,  # fp32 [B * W, H, G, D]: each query row's q in its row's K basis
    ARENA_U8, ARENA_F16, HEADERS, PLANS,  # the layer's arena, headers, layout plans
    SEG_INDPTR, SEG_IDS,  # int32 [B * W + 1] (an owner's segments from SEG_INDPTR[b * W]), [S]
    PAGE_IDS, PAGE_COUNTS,  # int32 [B, H, K] candidates (owner-local page ids), [B, H]
    OUT,  # fp32 [B, H, P_out]
    H, G, W, row_pages, pps, max_sel, P_out,
    D: tl.constexpr, R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    HDR_W: tl.constexpr, PLAN_W: tl.constexpr, BASE_COL: tl.constexpr,
    STRIDE_COL: tl.constexpr, LAYOUT_COL: tl.constexpr, K_GROUP_COL: tl.constexpr,
    R_CODE: tl.constexpr, R_ROW: tl.constexpr, R_SHIFT: tl.constexpr, R_MASK: tl.constexpr,
    R_SCALE: tl.constexpr, R_ZERO: tl.constexpr, R_GROUP: tl.constexpr,
    COLUMNS: tl.constexpr,  # `_scores_columns` (one warp) instead of `_scores_rows`
    BANDS: tl.constexpr,  # `_scores_bands` (one warp, from the header) instead of either
    K_B8: tl.constexpr, K_B4: tl.constexpr, K_B2: tl.constexpr, K_CODES8: tl.constexpr,
    K_CODES4: tl.constexpr, K_CODES2: tl.constexpr, K_SCALE8: tl.constexpr,
    K_ZERO8: tl.constexpr, K_SCALE4: tl.constexpr, K_ZERO4: tl.constexpr,
    K_SCALE2: tl.constexpr, K_ZERO2: tl.constexpr, EVEN_G: tl.constexpr,
    PREFETCH: tl.constexpr,  # the candidates' page/segment/header loads as vectors up front
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bh = b * H + h
    mask_g = tl.arange(0, BLOCK_G) < G
    start = tl.program_id(2) * BLOCK_C
    end = tl.minimum(start + BLOCK_C, tl.load(PAGE_COUNTS + bh))
    seg0 = tl.load(SEG_INDPTR + b * W)
    if PREFETCH:  # the block's page -> segment -> header chain as vectors: three load
        # latencies per block instead of three per candidate
        offs = start + tl.arange(0, BLOCK_C)
        live = offs < end
        v_page = tl.load(PAGE_IDS + bh * max_sel + offs, mask=live, other=0)
        v_seg = tl.load(SEG_IDS + seg0 + v_page // pps, mask=live, other=0).to(tl.int64)
        v_hdr = v_seg * HDR_W
        v_base = tl.load(HEADERS + v_hdr + BASE_COL, mask=live, other=0).to(tl.int64) * 16 + \
            h * tl.load(HEADERS + v_hdr + STRIDE_COL, mask=live, other=0)
        v_layout = tl.load(HEADERS + v_hdr + LAYOUT_COL, mask=live, other=0).to(tl.int64)
        v_group = tl.load(HEADERS + v_hdr + K_GROUP_COL, mask=live, other=0)
    for i in range(start, end):
        if PREFETCH:  # candidate i's scalars out of the vectors (one lane each)
            one = offs == i
            page = tl.sum(tl.where(one, v_page, 0))
            hdr = HEADERS + tl.sum(tl.where(one, v_hdr, 0))
            base = tl.sum(tl.where(one, v_base, 0))
            plan = PLANS + tl.sum(tl.where(one, v_layout, 0)) * (2 * PLAN_W * D)  # K's plan
            group = tl.sum(tl.where(one, v_group, 0))
        else:
            page = tl.load(PAGE_IDS + bh * max_sel + i)
            seg = tl.load(SEG_IDS + seg0 + page // pps).to(tl.int64)
            hdr = HEADERS + seg * HDR_W
            base = tl.load(hdr + BASE_COL).to(tl.int64) * 16 + h * tl.load(hdr + STRIDE_COL)
            plan = PLANS + tl.load(hdr + LAYOUT_COL).to(tl.int64) * (2 * PLAN_W * D)  # K's plan
            group = tl.load(hdr + K_GROUP_COL)
        qrow = b * W + page // row_pages
        if BANDS:
            s = _scores_bands(Q_ROT, ARENA_U8, ARENA_F16, hdr, page, base, group, qrow, h, H, G,
                              pps, D, R, BLOCK_G, K_B8, K_B4, K_B2, K_CODES8, K_CODES4,
                              K_CODES2, K_SCALE8, K_ZERO8, K_SCALE4, K_ZERO4, K_SCALE2, K_ZERO2,
                              EVEN_G)
        elif COLUMNS:
            s = _scores_columns(Q_ROT, ARENA_U8, ARENA_F16, page, base, plan, group, qrow, h, H,
                                G, pps, D, R, BLOCK_G, R_CODE, R_ROW, R_SHIFT, R_MASK, R_SCALE,
                                R_ZERO, R_GROUP)
        else:
            s = _scores_rows(Q_ROT, ARENA_U8, ARENA_F16, page, base, plan, group, qrow, h, H, G,
                             pps, D, R, BLOCK_G, R_CODE, R_ROW, R_SHIFT, R_MASK, R_SCALE, R_ZERO,
                             R_GROUP)
        s = tl.where(mask_g[:, None], s, float("-inf"))
        tl.store(OUT + bh * P_out + page, tl.max(tl.max(s, 1), 0))


# `page_rescore(layout=)`: the kernel's layout of one candidate
LAYOUTS = ("rows", "columns", "bands")


def page_rescore(q_rot: torch.Tensor, data: torch.Tensor, headers: torch.Tensor,
                 plans: torch.Tensor, seg_indptr: torch.Tensor, seg_ids: torch.Tensor,
                 page_ids: torch.Tensor, page_counts: torch.Tensor, *, rows_per_owner: int,
                 row_pages: int, pages_per_seg: int, channels: int,
                 out: torch.Tensor, layout: str = "bands", block: int | None = None,
                 prefetch: bool = PREFETCH) -> torch.Tensor:
    """Candidates `page_ids` int32 [B, H, K] (the first `page_counts` [B, H] of each list) scored
    on the leading `channels` of their compressed K against `q_rot` fp32 [B * W, H, G, D]
    (W = `rows_per_owner`); `out` fp32 [B, H, P] (P > every candidate id) filled with -inf and
    the candidates' scores. Two launches (the fill, the scores), no host sync. `layout`: "rows"
    (`_scores_rows`, four warps over a [G, 32, R] product), "columns" (`_scores_columns`,
    one warp, channel by channel through the layout's plan) or "bands" (`_scores_bands`, one
    warp, band by band from the segment's header): the same scores up to the order of the
    R-term sums (config `select.rescore_layout`). `block`: candidates per program (a power of
    two; None: the layout's `BLOCK_CANDIDATES`); `prefetch`: each program loads its
    candidates' page, segment and header entries as vectors before the loop (else one
    dependent chain per candidate): the same scores either way
    (`benchmarks/page_rescore_bench.py` times them)."""
    if layout not in LAYOUTS:
        raise ValueError(f"page_rescore: layout {layout!r} must be one of {LAYOUTS}")
    if block is None:
        block = BLOCK_CANDIDATES[layout]
    if block < 2 or block & (block - 1) or block > 128:
        raise ValueError(f"page_rescore: block={block} must be a power of two in [2, 128]")
    b, h, k = page_ids.shape
    nq, hq, g, d = q_rot.shape
    if q_rot.dtype != torch.float32 or not q_rot.is_contiguous() or hq != h or \
            nq != b * rows_per_owner:
        raise ValueError(f"page_rescore: q_rot must be contiguous float32 "
                         f"[{b * rows_per_owner}, {h}, G, D], got {q_rot.dtype} "
                         f"{tuple(q_rot.shape)}")
    if page_ids.dtype != torch.int32 or not page_ids.is_contiguous() or \
            tuple(page_counts.shape) != (b, h) or page_counts.dtype != torch.int32:
        raise ValueError(f"page_rescore: page_ids must be contiguous int32 [B, H, K] and "
                         f"page_counts int32 [B, H], got {page_ids.dtype} "
                         f"{tuple(page_ids.shape)} and {page_counts.dtype} "
                         f"{tuple(page_counts.shape)}")
    if out.dtype != torch.float32 or out.dim() != 3 or tuple(out.shape[:2]) != (b, h) or \
            not out.is_contiguous():
        raise ValueError(f"page_rescore: out must be contiguous float32 [{b}, {h}, P], got "
                         f"{out.dtype} {tuple(out.shape)}")
    if channels < 16 or channels > d or channels & (channels - 1):
        raise ValueError(f"page_rescore: channels={channels} must be a power of two in "
                         f"[16, head_dim={d}]")
    if seg_indptr.numel() != nq + 1:
        raise ValueError(f"page_rescore: seg_indptr has {seg_indptr.numel()} entries for {nq} "
                         f"query rows")
    out.fill_(float("-inf"))
    if k == 0 or b == 0:
        return out
    _page_rescore[(b, h, triton.cdiv(k, block))](
        q_rot, data, data.view(torch.float16), headers, plans, seg_indptr, seg_ids, page_ids,
        page_counts, out, h, g, rows_per_owner, row_pages, pages_per_seg, k, out.shape[2],
        D=d, R=channels, BLOCK_G=max(2, triton.next_power_of_2(g)), BLOCK_C=block,
        HDR_W=HEADER_WIDTH, PLAN_W=len(PLAN_FIELDS), BASE_COL=HDR["base16"],
        STRIDE_COL=HDR["head_stride"], LAYOUT_COL=HDR["layout"], K_GROUP_COL=HDR["k_group"],
        R_CODE=PLAN_ROW["code"], R_ROW=PLAN_ROW["row"], R_SHIFT=PLAN_ROW["shift"],
        R_MASK=PLAN_ROW["mask"], R_SCALE=PLAN_ROW["scale"], R_ZERO=PLAN_ROW["zero"],
        R_GROUP=PLAN_ROW["group_bytes"], COLUMNS=layout == "columns", BANDS=layout == "bands",
        EVEN_G=g == max(2, triton.next_power_of_2(g)), PREFETCH=bool(prefetch),
        **{f"K_{f.upper()}": HDR[f"k_{f}"] for f in ("b8", "b4", "b2", "codes8", "codes4",
                                                      "codes2", "scale8", "zero8", "scale4",
                                                      "zero4", "scale2", "zero2")},
        num_warps=4 if layout == "rows" else 1)
    return out


def page_rescore_reference(q_rot: torch.Tensor, data: torch.Tensor, headers: torch.Tensor,
                           plans: torch.Tensor, seg_indptr: torch.Tensor, seg_ids: torch.Tensor,
                           page_ids: torch.Tensor, page_counts: torch.Tensor, *,
                           rows_per_owner: int, row_pages: int, pages_per_seg: int, channels: int,
                           pages_out: int) -> torch.Tensor:
    """Torch oracle of `page_rescore` (float32 [B, H, pages_out] on the CPU), candidate by
    candidate: the page's K decoded from the arena bytes (`band_unpack.decode_rotated_reference`),
    scored on its leading `channels` against its query row."""
    from types import SimpleNamespace

    from .band_unpack import decode_rotated_reference

    b_n, h, _ = page_ids.shape
    arena = SimpleNamespace(data=data, headers=headers, plans=plans, num_kv_heads=h,
                            segment_tokens=pages_per_seg * PAGE_TOKENS, device=data.device)
    out = torch.full((b_n, h, pages_out), float("-inf"))
    indptr = seg_indptr.cpu().long()
    segs = seg_ids.long()
    for b in range(b_n):
        seg0 = int(indptr[b * rows_per_owner])
        for hh in range(h):
            for p in page_ids[b, hh, :int(page_counts[b, hh])].tolist():
                k_rot, _ = decode_rotated_reference(arena, segs[seg0 + p // pages_per_seg].view(1))
                t0 = (p % pages_per_seg) * PAGE_TOKENS
                k = k_rot[0, hh, t0:t0 + PAGE_TOKENS, :channels].float().cpu()  # [32, R]
                q = q_rot[b * rows_per_owner + p // row_pages, hh, :, :channels].float().cpu()
                out[b, hh, p] = (q @ k.T).max()
    return out
