"""Query-aware page selection on the GPU: score every compressed page of a batch from its page
metadata (`codec/pages.py`: per 32-token page and KV head, fp16 min/max of m channels of the
segment's K basis plus a norm bound for the rest), then keep the best pages per (request, KV head).

    bound(q, page) = sum_c max(q_c lo_c, q_c hi_c) + ||q_rest|| * rest_norm     (>= every q.k)

Stage 1 (`page_bounds`, Triton): one program per (request, KV head, block of pages), max of the
bound over the G query heads of the group (they read the same pages, as in `select_pages`).
Stage 2 (`select_page_list`, Triton): sink and recent pages forced, a radix select of the
budget's threshold and a prefix-sum compaction (one program per row, no sort): ascending page
ids, the `(page_ids, page_counts)` list `BandDecodeWrapper.run` consumes.

    meta = pack_page_meta([seg.pages for seg in segments_in_arena_order]).to("cuda")
    bounds = page_bounds(q_rot, meta, arena.seg_indptr, arena.seg_ids, max_pages)
    ids, counts = select_page_list(bounds, page_counts_of_requests, budget_pages, sink, recent)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl



@dataclass
class PackedPageMeta:
    """Page metadata of every segment of an arena, indexed by the arena's segment id."""
    channels: torch.Tensor  # int32 [S, H, M]: K-basis channels with min/max
    lo: torch.Tensor  # fp16 [S, H, PPS, M]
    hi: torch.Tensor  # fp16 [S, H, PPS, M]
    rest_norm: torch.Tensor  # fp16 [S, H, PPS]

    @property
    def pages_per_segment(self) -> int:
        return self.lo.shape[2]

    def to(self, device) -> "PackedPageMeta":
        return PackedPageMeta(*(t.to(device) for t in
                                (self.channels, self.lo, self.hi, self.rest_norm)))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.channels, self.lo, self.hi, self.rest_norm))


def pack_page_meta(metas: list) -> PackedPageMeta:
    """One page metadata per segment (`codec.pages.PageMeta`: channels, lo, hi, rest_norm), in
    the arena's segment-id order (all of one shape)."""
    if not metas:
        raise ValueError("pack_page_meta: need at least one segment's PageMeta")
    shapes = {tuple(m.lo.shape) for m in metas}
    if len(shapes) != 1:
        raise ValueError(f"pack_page_meta: segments differ in [H, pages, channels]: {shapes}")
    return PackedPageMeta(torch.stack([m.channels.to(torch.int32) for m in metas]),
                          torch.stack([m.lo for m in metas]), torch.stack([m.hi for m in metas]),
                          torch.stack([m.rest_norm for m in metas]))


@triton.jit
def _page_bounds(
    Q,  # fp32 [B, H, G, D] in the K basis (any positive scale)
    CHANNELS, LO, HI, REST,  # PackedPageMeta tensors
    SEG_INDPTR, SEG_IDS,  # int32 [B+1], [S]
    OUT,  # fp32 [B / RPO, H, P_out]; -inf past the request's pages
    H, P_out, RPO, P_row,  # RPO rows per output line, row r at columns (r % RPO) * P_row
    G: tl.constexpr, D: tl.constexpr, M: tl.constexpr, PPS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_g = tl.arange(0, BLOCK_G)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g, mask_m = offs_g < G, offs_m < M
    seg0 = tl.load(SEG_INDPTR + b)
    n_pages = (tl.load(SEG_INDPTR + b + 1) - seg0) * PPS
    valid = offs_p < n_pages
    seg = tl.load(SEG_IDS + seg0 + offs_p // PPS, mask=valid, other=0).to(tl.int64)
    sh = seg * H + h  # [P] row of (segment, head)
    q_base = Q + (b * H + h) * G * D
    q = tl.load(q_base + offs_g[:, None] * D + offs_d[None, :],
                mask=mask_g[:, None] & (offs_d[None, :] < D), other=0.0)
    q_sq = tl.sum(q * q, 1)  # [G]

    pm = valid[:, None] & mask_m[None, :]
    chan = tl.load(CHANNELS + sh[:, None] * M + offs_m[None, :], mask=pm, other=0)  # [P, M]
    row = (sh * PPS + offs_p % PPS)[:, None] * M + offs_m[None, :]
    lo = tl.load(LO + row, mask=pm, other=0.0).to(tl.float32)
    hi = tl.load(HI + row, mask=pm, other=0.0).to(tl.float32)
    rest = tl.load(REST + sh * PPS + offs_p % PPS, mask=valid, other=0.0).to(tl.float32)
    # q at each page's channels: [G, P, M] (a gather from the L1-resident q row).
    qc = tl.load(q_base + offs_g[:, None, None] * D + chan[None, :, :],
                 mask=mask_g[:, None, None] & pm[None, :, :], other=0.0)
    head = tl.sum(tl.maximum(qc * lo[None], qc * hi[None]), 2)  # [G, P]
    q_rest = tl.sqrt(tl.maximum(q_sq[:, None] - tl.sum(qc * qc, 2), 0.0))  # [G, P]
    bound = head + q_rest * rest[None, :]
    bound = tl.where(mask_g[:, None], bound, float("-inf"))
    best = tl.max(bound, 0)
    best = tl.where(valid, best, float("-inf"))
    tl.store(OUT + ((b // RPO) * H + h) * P_out + (b % RPO) * P_row + offs_p, best,
             mask=offs_p < P_row)


def page_bounds(q_rot: torch.Tensor, meta: PackedPageMeta, seg_indptr: torch.Tensor,
                seg_ids: torch.Tensor, max_pages: int, out: torch.Tensor | None = None,
                block_pages: int = 64, rows_per_out: int = 1) -> torch.Tensor:
    """q_rot fp32 [B, H, G, D] (queries in the K basis) -> float32 [B, H, max_pages]: per page of
    each request (in token order, the arena's segment lists) the largest bound over the group's
    query heads; -inf past a request's pages. With `rows_per_out` = W > 1 the B rows are W
    consecutive rows per request (position blocks of `max_pages` pages each) and the output is
    request-major, [B / W, H, W * max_pages]: row w of request b at columns
    [w * max_pages, (w + 1) * max_pages)."""
    if q_rot.dtype != torch.float32 or q_rot.dim() != 4 or not q_rot.is_contiguous():
        raise ValueError(f"page_bounds: q_rot must be contiguous float32 [B, H, G, D], got "
                         f"{q_rot.dtype} {tuple(q_rot.shape)}")
    bsz, h, g, d = q_rot.shape
    s, mh, m = meta.channels.shape
    if mh != h or tuple(meta.lo.shape) != (s, h, meta.pages_per_segment, m):
        raise ValueError(f"page_bounds: meta is for [S, H, M] = {(s, mh, m)} with lo "
                         f"{tuple(meta.lo.shape)}; q_rot has H={h}")
    if seg_indptr.numel() != bsz + 1:
        raise ValueError(f"page_bounds: seg_indptr has {seg_indptr.numel()} entries for B={bsz}")
    rpo = rows_per_out
    if rpo < 1 or bsz % rpo:
        raise ValueError(f"page_bounds: {bsz} rows are not whole groups of rows_per_out={rpo}")
    shape = (bsz // rpo, h, max(rpo * max_pages, 1))
    if out is None:
        out = torch.empty(*shape, dtype=torch.float32, device=q_rot.device)
    elif rpo > 1 and (tuple(out.shape) != shape or not out.is_contiguous()):
        raise ValueError(f"page_bounds: out must be contiguous {list(shape)}, got "
                         f"{tuple(out.shape)}")
    if max_pages:
        grid = (bsz, h, triton.cdiv(max_pages, block_pages))
        _page_bounds[grid](q_rot, meta.channels, meta.lo, meta.hi, meta.rest_norm, seg_indptr,
                           seg_ids, out, h, out.shape[2], rpo,
                           max_pages if rpo > 1 else out.shape[2], G=g, D=d, M=m,
                           PPS=meta.pages_per_segment, BLOCK_G=triton.next_power_of_2(g),
                           BLOCK_P=block_pages, BLOCK_M=triton.next_power_of_2(m),
                           BLOCK_D=triton.next_power_of_2(d), num_warps=4)
    else:
        out.fill_(float("-inf"))
    return out


def _upper_bound(channels, lo, hi, rest_norm, q: torch.Tensor) -> torch.Tensor:
    """q [H, G, D] -> bound of q.k per page [H, G, P] from one segment's metadata (channels
    [H, m], lo/hi [H, P, m], rest_norm [H, P]): the covered channels at their min/max, the rest
    by Cauchy-Schwarz."""
    q = q.float()
    qc = torch.gather(q, 2, channels.long()[:, None, :].expand(-1, q.shape[1], -1))  # [H, G, m]
    lo, hi = lo.float()[:, None], hi.float()[:, None]  # [H, 1, P, m]
    head = torch.maximum(qc[:, :, None] * lo, qc[:, :, None] * hi).sum(-1)
    q_rest = (q.pow(2).sum(-1) - qc.pow(2).sum(-1)).clamp_min(0).sqrt()  # [H, G]
    return head + q_rest[..., None] * rest_norm.float()[:, None]


def page_bounds_reference(q_rot: torch.Tensor, meta: PackedPageMeta, seg_indptr: torch.Tensor,
                          seg_ids: torch.Tensor, max_pages: int) -> torch.Tensor:
    """Torch oracle of `page_bounds`, request by request: per page the bound of
    `codec.pages.page_upper_bound` (tests check the two agree), max over the group's heads."""
    bsz, h = q_rot.shape[:2]
    out = torch.full((bsz, h, max(max_pages, 1)), float("-inf"))
    indptr = seg_indptr.tolist()
    for b in range(bsz):
        ids = seg_ids[indptr[b]:indptr[b + 1]].long().cpu()
        if not len(ids):
            continue
        bounds = []
        for sid in ids.tolist():
            bounds.append(_upper_bound(meta.channels[sid].cpu(), meta.lo[sid].cpu(),
                                       meta.hi[sid].cpu(), meta.rest_norm[sid].cpu(),
                                       q_rot[b].cpu()).amax(1))  # [H, PPS]
        row = torch.cat(bounds, -1)
        out[b, :, :row.shape[1]] = row[:, :max_pages]
    return out


MAX_SELECT_PAGES = 32768  # pages per request the one-program-per-row top-k holds (1M tokens)


@triton.jit
def _select_top_pages(
    BOUNDS,  # fp32 [B, H, P]
    NUM_PAGES,  # int32 [B]
    IDS, COUNTS,  # int32 [B, H, K] (ascending, then P), [B, H]
    H, P, K, BUDGET, SINK, RECENT,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, EARLY_EXIT: tl.constexpr,
    DIGITS: tl.constexpr,
):
    """One program per (request, KV head): force sink/recent pages, find the count-th largest
    bound by a radix select on order-preserving uint32 keys (DIGITS: four 8-bit digits, most
    significant first, each from a 256-bin histogram of the keys that match the digits found so
    far; else one bit per step, a block reduction each, EARLY_EXIT: the steps after a threshold
    that keeps exactly `take` keys are skipped, the same kept set), then compact the kept page
    ids in ascending order with a prefix sum (no sort). Either way the threshold is the
    take-th largest key itself: the same kept pages. Ties at the threshold: lowest ids."""
    b = tl.program_id(0).to(tl.int64)
    row = b * H + tl.program_id(1)
    offs = tl.arange(0, BLOCK_P)
    n = tl.load(NUM_PAGES + b)
    x = tl.load(BOUNDS + row * P + offs, mask=offs < P, other=float("-inf"))
    valid = offs < n
    forced = valid & ((offs < SINK) | (offs >= n - RECENT))
    x = tl.where(forced, float("inf"), tl.where(valid, x, float("-inf")))
    take = tl.minimum(n, tl.maximum(tl.sum(forced.to(tl.int32), 0), BUDGET))
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    one = tl.full((), 1, tl.uint32)
    prefix = tl.full((), 0, tl.uint32)
    if DIGITS:
        bins = tl.arange(0, 256)
        left = take  # keys still to keep at or below the digits found so far
        for step in tl.static_range(4):
            shift: tl.constexpr = 24 - 8 * step
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            if step == 0:
                hist = tl.histogram(digit, 256)
            else:  # the keys whose higher digits are the threshold's
                match = (key >> (shift + 8)) == (prefix >> (shift + 8))
                hist = tl.histogram(digit, 256, mask=match)
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matching keys >= each bin
            d = tl.max(tl.where(at_least >= left, bins, 0), 0)  # the largest such bin
            left -= tl.sum(tl.where(bins == d, at_least - hist, 0), 0)  # those above it
            prefix = prefix | (d.to(tl.uint32) << shift)
    else:
        done = take < 0  # false: a block-uniform flag (each step's count is a block reduction)
        for bit in tl.static_range(31, -1, -1):
            if not done:
                cand = prefix | (one << bit)
                cnt = tl.sum((key >= cand).to(tl.int32), 0)
                prefix = tl.where(cnt >= take, cand, prefix)
                if EARLY_EXIT:  # {key >= cand} is exactly the kept set: no later bit changes it
                    done = cnt == take
    gt = key > prefix
    eq = key == prefix
    need = take - tl.sum(gt.to(tl.int32), 0)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    pos = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(IDS + row * K + pos, offs, mask=sel)
    offs_k = tl.arange(0, BLOCK_K)
    tl.store(IDS + row * K + offs_k, tl.full([BLOCK_K], 0, tl.int32) + P,
             mask=(offs_k >= take) & (offs_k < K))
    tl.store(COUNTS + row, take)


# The top-k's plan (H200, 2026-12-05, benchmarks/request_decode_sweep.py --select): warps per
# program by the bound count, and whether the radix steps stop once the threshold is exact.
SELECT_EARLY_EXIT = True
# The radix select by 8-bit digits (four histogram steps) instead of 32 one-bit steps
# (`select_page_list(digits=)`): off by default. It runs in the interpreter (tests) but does
# not compile for sm_90 yet (CompilationError, `sm90_compile.py`, 2026-12-08): not usable on a
# GPU until that is fixed.
SELECT_DIGITS = False


def select_warps(pages: int) -> int:
    """Warps of a top-k program over `pages` bounds (its block: the next power of two)."""
    block = triton.next_power_of_2(pages)
    return 4 if block <= 4096 else 16 if block <= 16384 else 32


def select_page_list(bounds: torch.Tensor, num_pages: torch.Tensor, budget_pages: int,
                     sink_pages: int, recent_pages: int, *, num_warps: int | None = None,
                     early_exit: bool | None = None,
                     digits: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """bounds [B, H, P] (-inf past each request's pages), num_pages int [B] (pages per request)
    -> (page_ids int32 [B, H, K] ascending then P, page_counts int32 [B, H]),
    K = min(P, budget + sink + recent).

    Like `codec.pages.select_pages`: the first `sink_pages` and last `recent_pages` pages are
    always kept and count toward `budget_pages`; the rest go by largest bound; a request with no
    more pages than the budget keeps all of them. One launch, no host sync. `num_warps`,
    `early_exit` and `digits` choose the plan (defaults: `select_warps`, `SELECT_EARLY_EXIT`,
    `SELECT_DIGITS`); the outputs are the same under every plan."""
    _check_select_args(bounds, budget_pages)
    bsz, h, p = bounds.shape
    if p > MAX_SELECT_PAGES:
        raise ValueError(f"select_page_list: {p} pages per request > {MAX_SELECT_PAGES} "
                         f"(the top-k holds a request's bounds in one program)")
    k = min(p, budget_pages + sink_pages + recent_pages)
    ids = torch.empty(bsz, h, k, dtype=torch.int32, device=bounds.device)
    counts = torch.empty(bsz, h, dtype=torch.int32, device=bounds.device)
    block = triton.next_power_of_2(p)
    _select_top_pages[(bsz, h)](bounds.contiguous(), num_pages.to(bounds.device, torch.int32),
                                ids, counts, h, p, k, budget_pages, sink_pages, recent_pages,
                                BLOCK_P=block, BLOCK_K=triton.next_power_of_2(k),
                                EARLY_EXIT=SELECT_EARLY_EXIT if early_exit is None else early_exit,
                                DIGITS=SELECT_DIGITS if digits is None else bool(digits),
                                num_warps=num_warps or select_warps(p))
    return ids, counts


def _check_select_args(bounds: torch.Tensor, budget_pages: int) -> None:
    if bounds.dim() != 3 or bounds.dtype != torch.float32:
        raise ValueError(f"select_page_list: bounds must be float32 [B, H, P], got "
                         f"{bounds.dtype} {tuple(bounds.shape)}")
    if budget_pages < 1:
        raise ValueError(f"select_page_list: budget_pages={budget_pages} must be >= 1")


def select_page_list_reference(bounds: torch.Tensor, num_pages: torch.Tensor, budget_pages: int,
                               sink_pages: int, recent_pages: int):
    """Torch oracle of `select_page_list` (topk + sort); same outputs up to ties."""
    _check_select_args(bounds, budget_pages)
    bsz, h, p = bounds.shape
    idx = torch.arange(p, device=bounds.device)
    n = num_pages.to(bounds.device).long()[:, None, None]  # [B, 1, 1]
    forced = (idx < sink_pages) | (idx >= n - recent_pages)
    score = torch.where(forced & (idx < n), torch.inf, bounds)
    k = min(p, budget_pages + sink_pages + recent_pages)
    top, ids = score.topk(k, dim=-1)  # forced pages (+inf) first
    n_forced = torch.clamp(torch.minimum(n, torch.full_like(n, sink_pages + recent_pages)), max=p)
    take = torch.maximum(n_forced, torch.minimum(n, torch.full_like(n, budget_pages)))
    rank = torch.arange(k, device=bounds.device)
    keep = (rank < take) & (top > float("-inf"))  # [B, H, K]
    ids = torch.where(keep, ids, p).sort(-1).values  # dropped entries sort last
    return ids.to(torch.int32), keep.sum(-1, dtype=torch.int32)


@triton.jit
def _rows_from_requests(
    IDS,  # int32 [B, H, K]: each request's kept pages, ascending, padded with a large id
    ROW_REQ,  # int64 [R]
    LO, HI,  # int32 [R]: the row's pages are the request's pages [LO, HI)
    OUT_IDS, OUT_COUNTS,  # int32 [R, H, KR] (row-local ids, then 0), [R, H]
    H, K, KR,
    BLOCK_K: tl.constexpr,
):
    """One program per (row, KV head): the request's kept pages that fall in the row, compacted
    in order with a prefix sum and made row-local."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b = tl.load(ROW_REQ + r)
    lo = tl.load(LO + r)
    hi = tl.load(HI + r)
    offs = tl.arange(0, BLOCK_K)
    ids = tl.load(IDS + (b * H + h) * K + offs, mask=offs < K, other=2147483647)
    sel = (ids >= lo) & (ids < hi)
    count = tl.sum(sel.to(tl.int32), 0)
    pos = tl.cumsum(sel.to(tl.int32), 0) - 1
    row = (r * H + h) * KR
    tl.store(OUT_IDS + row + pos, ids - lo, mask=sel)
    tl.store(OUT_IDS + row + offs, tl.full([BLOCK_K], 0, tl.int32),
             mask=(offs >= count) & (offs < KR))
    tl.store(OUT_COUNTS + r * H + h, count)


def rows_from_requests(ids: torch.Tensor, row_req: torch.Tensor, lo: torch.Tensor,
                       hi: torch.Tensor, row_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request kept pages `ids` int32 [B, H, K] (ascending, padded with >= every hi) ->
    per-row (page_ids int32 [R, H, min(K, row_pages)] row-local then 0, page_counts int32
    [R, H]) for rows [lo, hi) of request row_req. One launch, no host sync."""
    bsz, h, k = ids.shape
    rows, kr = row_req.numel(), min(k, row_pages)
    page_ids = torch.empty(rows, h, kr, dtype=torch.int32, device=ids.device)
    counts = torch.empty(rows, h, dtype=torch.int32, device=ids.device)
    if rows:
        _rows_from_requests[(rows, h)](ids, row_req, lo, hi, page_ids, counts, h, k, kr,
                                       BLOCK_K=triton.next_power_of_2(max(k, 1)), num_warps=4)
    return page_ids, counts


def rows_from_requests_reference(ids, row_req, lo, hi, row_pages):
    """Torch form of `rows_from_requests` (the same contract)."""
    h = ids.shape[1]
    mine = ids[row_req]  # [R, H, K]: the row's request's kept pages
    start = torch.searchsorted(mine, lo[:, None, None].expand(-1, h, 1).contiguous())
    end = torch.searchsorted(mine, hi[:, None, None].expand(-1, h, 1).contiguous())
    k = min(mine.shape[2], row_pages)
    pos = (start + torch.arange(k, device=ids.device)).clamp_max(mine.shape[2] - 1)
    local = torch.gather(mine, 2, pos) - lo[:, None, None]
    counts = (end - start)[..., 0].to(torch.int32)
    keep = torch.arange(k, device=ids.device) < counts[..., None]
    return torch.where(keep, local, 0).to(torch.int32).contiguous(), counts


class RowSelection:
    """Selection over requests whose pages span several arena rows (one row per basis block,
    as the serving pool packs a long request): the budget is per request, so the rows' bounds
    are gathered into one line per request, `select_page_list` runs once, and the kept pages go
    back to per-row lists for `BandDecodeWrapper.run`. Built on the host once per step (the
    rows' layout, the gather index); `select` is device-only, three launches: the gather, the
    top pages, the split back into rows (the decode step is launch bound).

        rs = RowSelection(row_req=[0, 0, 1], row_pages=[128, 40, 90], device="cuda")
        ids, counts = rs.select(bounds, budget_pages=128, sink_pages=2, recent_pages=8)

    `page_bounds(..., out=rs.bounds_out(H))` writes the bounds where `select` reads them.
    """

    def __init__(self, row_req: list[int], row_pages: list[int], device):
        if len(row_req) != len(row_pages) or any(b < a for a, b in zip(row_req, row_req[1:])):
            raise ValueError(f"RowSelection: row_req must be sorted and match row_pages, got "
                             f"{row_req} / {row_pages}")
        n_req = (row_req[-1] + 1) if row_req else 0
        offset, req_pages = [], [0] * n_req
        for b, n in zip(row_req, row_pages):
            offset.append(req_pages[b])
            req_pages[b] += n
        self.rows, self.row_pmax = len(row_req), max(row_pages + [1])
        p_req = max(req_pages + [1])
        # (row, page) of each (request, page); past a request's pages: row `rows` (padding)
        self._src_row = torch.full((n_req, p_req), self.rows, dtype=torch.long)
        self._src_page = torch.zeros((n_req, p_req), dtype=torch.long)
        # every (row, page) at once (a slice assignment per row cost ~1 ms a step at 96 rows)
        counts = torch.tensor(row_pages, dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(self.rows), counts)
        page = torch.arange(len(row)) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        req = torch.tensor(row_req, dtype=torch.long)[row]
        at = torch.tensor(offset, dtype=torch.long)[row] + page
        self._src_row[req, at] = row
        self._src_page[req, at] = page
        self.device = torch.device(device)
        self.req_pages = torch.tensor(req_pages, dtype=torch.int32, device=device)
        self.row_req = torch.tensor(row_req, dtype=torch.long, device=device)
        self.lo = torch.tensor(offset, dtype=torch.int32, device=device)
        self.hi = self.lo + torch.tensor(row_pages, dtype=torch.int32, device=device)
        self._heads, self._flat, self._src = None, None, None

    def bounds_out(self, heads: int) -> torch.Tensor:
        """float32 [R, heads, row pages] view of this step's bounds buffer (followed by one -inf,
        what padding reads), and the request-major gather index into it, made once per step."""
        if self._heads != heads:
            r, p = self.rows, self.row_pmax
            self._flat = torch.full((r * heads * p + 1,), float("-inf"), device=self.device)
            hh = torch.arange(heads)[None, :, None]
            src = (self._src_row[:, None, :] * heads + hh) * p + self._src_page[:, None, :]
            src[(self._src_row == r)[:, None, :].expand_as(src)] = r * heads * p
            self._src, self._heads = src.to(self.device), heads
        return self._flat[:-1].view(self.rows, heads, self.row_pmax)

    def select(self, bounds: torch.Tensor, budget_pages: int, sink_pages: int,
               recent_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """bounds [R, H, >= max row pages] (`page_bounds` over the rows; no copy when written
        into `bounds_out(H)`) -> per-row (page_ids int32 [R, H, K] ascending, page_counts int32
        [R, H])."""
        r, h = bounds.shape[:2]
        if r != self.rows or bounds.shape[2] < self.row_pmax:
            raise ValueError(f"RowSelection.select: bounds {tuple(bounds.shape)} do not cover "
                             f"{self.rows} rows of up to {self.row_pmax} pages")
        buf = self.bounds_out(h)
        if bounds.data_ptr() != buf.data_ptr() or bounds.stride() != buf.stride():
            buf.copy_(bounds[:, :, :self.row_pmax])
        req_bounds = self._flat[self._src]  # [B, H, P_req]
        ids, _ = select_page_list(req_bounds, self.req_pages, budget_pages, sink_pages,
                                  recent_pages)  # ascending, padded with P_req
        return rows_from_requests(ids, self.row_req, self.lo, self.hi, self.row_pmax)
