"""Group a selection's pages by width class, on the device, before the band decode reads them.

The band decode kernel compiles one stage-1 launch per width class (the (K b8, b4, b2, V b8, b4,
b2) channel counts of a layout): without this, every launch walked all selected pages of its
(row, KV head) and skipped those of other classes, so C classes cost C walks of the list (on an
H200 with the default config's 16 classes, 148 us of a 300 us layer at 32K, batch 1:
benchmarks/results/h200_2026-12-04_full_graph). Here one launch, one program per (row, KV head),
reads each selected page's segment header once, finds its class and writes the page ids again
grouped by class (ascending within a class) with per-class offsets; stage 1 for class c then
walks [offs[c], offs[c+1]) only. A page whose widths match no class goes past offs[C] and is
read by no launch, as before (the caller registers every layout's class).

    ids, offs = class_partition(page_ids, page_counts, seg_indptr, seg_ids, headers, classes,
                                units_per_seg)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import HDR, HEADER_WIDTH


@triton.jit
def _class_partition(
    PAGE_IDS, PAGE_COUNTS,  # int32 [R, H, K], [R, H]
    SEG_INDPTR, SEG_IDS, HEADERS,  # int32 [R+1], [S], [S, HDR_W]
    CLASSES,  # int32 [C, 6]: K b8, b4, b2, V b8, b4, b2 of each class
    OUT_IDS, OFFS,  # int32 [R, H, K], [R, H, C+1]
    H, K, C, units_per_seg,
    HDR_W: tl.constexpr, KC: tl.constexpr, VC: tl.constexpr, BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rh = r * H + h
    offs = tl.arange(0, BLOCK_K)
    ok = offs < tl.load(PAGE_COUNTS + rh)
    unit = tl.load(PAGE_IDS + rh * K + offs, mask=ok, other=0)
    seg = tl.load(SEG_IDS + tl.load(SEG_INDPTR + r) + unit // units_per_seg, mask=ok, other=0)
    hdr = HEADERS + seg.to(tl.int64) * HDR_W
    k8 = tl.load(hdr + KC, mask=ok, other=-1)
    k4 = tl.load(hdr + KC + 1, mask=ok, other=-1)
    k2 = tl.load(hdr + KC + 2, mask=ok, other=-1)
    v8 = tl.load(hdr + VC, mask=ok, other=-1)
    v4 = tl.load(hdr + VC + 1, mask=ok, other=-1)
    v2 = tl.load(hdr + VC + 2, mask=ok, other=-1)
    base = 0
    for c in range(C):
        w = CLASSES + c * 6
        mine = ok & (k8 == tl.load(w)) & (k4 == tl.load(w + 1)) & (k2 == tl.load(w + 2)) & \
            (v8 == tl.load(w + 3)) & (v4 == tl.load(w + 4)) & (v2 == tl.load(w + 5))
        m = mine.to(tl.int32)
        pos = base + tl.cumsum(m, 0) - 1
        tl.store(OUT_IDS + rh * K + pos, unit, mask=mine)
        tl.store(OFFS + rh * (C + 1) + c, base)
        base += tl.sum(m, 0)
    tl.store(OFFS + rh * (C + 1) + C, base)


def _check(page_ids, page_counts, classes):
    if page_ids.dtype != torch.int32 or page_ids.dim() != 3 or not page_ids.is_contiguous():
        raise ValueError(f"class_partition: page_ids must be contiguous int32 [R, H, K], got "
                         f"{page_ids.dtype} {tuple(page_ids.shape)}")
    if page_counts.dtype != torch.int32 or tuple(page_counts.shape) != tuple(page_ids.shape[:2]):
        raise ValueError(f"class_partition: page_counts must be int32 "
                         f"{list(page_ids.shape[:2])}, got {page_counts.dtype} "
                         f"{tuple(page_counts.shape)}")
    if classes.dtype != torch.int32 or classes.dim() != 2 or classes.shape[1] != 6:
        raise ValueError(f"class_partition: classes must be int32 [C, 6], got {classes.dtype} "
                         f"{tuple(classes.shape)}")


def class_partition(page_ids: torch.Tensor, page_counts: torch.Tensor, seg_indptr: torch.Tensor,
                    seg_ids: torch.Tensor, headers: torch.Tensor, classes: torch.Tensor,
                    units_per_seg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page ids int32 [R, H, K] grouped by class, offsets int32 [R, H, C+1]): for (row r,
    KV head h), class c's pages are ids[r, h, offs[r, h, c]:offs[r, h, c+1]], in the order they
    had. `page_ids`/`page_counts`: a selection (the first counts[r, h] entries valid, page
    indices within row r's segments `seg_ids[seg_indptr[r]:seg_indptr[r+1]]`, `units_per_seg`
    pages per segment); `classes`: int32 [C, 6] width classes. One launch, no host sync."""
    _check(page_ids, page_counts, classes)
    r, h, k = page_ids.shape
    c = classes.shape[0]
    out = torch.zeros_like(page_ids)
    offs = torch.empty(r, h, c + 1, dtype=torch.int32, device=page_ids.device)
    if r * h:
        _class_partition[(r, h)](
            page_ids, page_counts.contiguous(), seg_indptr, seg_ids, headers, classes, out, offs,
            h, k, c, units_per_seg, HDR_W=HEADER_WIDTH, KC=HDR["k_b8"], VC=HDR["v_b8"],
            BLOCK_K=max(16, triton.next_power_of_2(max(k, 1))))
    return out, offs


def class_partition_reference(page_ids: torch.Tensor, page_counts: torch.Tensor,
                              seg_indptr: torch.Tensor, seg_ids: torch.Tensor,
                              headers: torch.Tensor, classes: torch.Tensor,
                              units_per_seg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`class_partition` in plain torch (loops on the host): the test's reference."""
    _check(page_ids, page_counts, classes)
    r, h, k = page_ids.shape
    c = classes.shape[0]
    ids, counts = page_ids.cpu(), page_counts.cpu()
    indptr, segs, hdr = seg_indptr.cpu(), seg_ids.cpu(), headers.cpu()
    cls_w = [tuple(row) for row in classes.cpu().tolist()]
    cols = [HDR["k_b8"], HDR["k_b8"] + 1, HDR["k_b8"] + 2,
            HDR["v_b8"], HDR["v_b8"] + 1, HDR["v_b8"] + 2]
    out = torch.zeros(r, h, k, dtype=torch.int32)
    offs = torch.zeros(r, h, c + 1, dtype=torch.int32)
    for i in range(r):
        for j in range(h):
            units = ids[i, j, :int(counts[i, j])].tolist()
            widths = [tuple(hdr[int(segs[int(indptr[i]) + u // units_per_seg]), cols].tolist())
                      for u in units]
            at = 0
            for ci, w in enumerate(cls_w):
                offs[i, j, ci] = at
                mine = [u for u, uw in zip(units, widths) if uw == w]
                out[i, j, at:at + len(mine)] = torch.tensor(mine, dtype=torch.int32)
                at += len(mine)
            offs[i, j, c] = at
    return out.to(page_ids.device), offs.to(page_ids.device)
