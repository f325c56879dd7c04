"""Query-aware page selection (the sequence dimension), Quest-style but in the rotated space.

Per page of `page_tokens` tokens and per KV head we keep, for the m channels of the segment's K
basis with the most energy, the page min and max (fp16, rounded outward), and for the remaining
channels the largest L2 norm in the page. Then for any query q

    q.k <= sum_{c in top-m} max(q_c lo_c, q_c hi_c) + ||q_rest|| * max_page ||k_rest||

is a true upper bound on every score of the page (Cauchy-Schwarz on the rest). After rotation
most energy sits in the first channels, so m=16 of 64 gives a tight bound for a fraction of
Quest's 2*D values per page. Bounds are computed from the *decoded* K in the space where the
segment's scores are computed (its SVD basis when the K strategy is rotated, raw channels
otherwise), so they bound exactly what the attention reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import SCALE_DTYPE as META_DTYPE, round_fp16  # metadata is fp16 like scales


@dataclass
class PageMeta:
    channels: torch.Tensor  # [H, m] uint8, channels covered by lo/hi
    lo: torch.Tensor  # [H, P, m] fp16
    hi: torch.Tensor  # [H, P, m] fp16
    rest_norm: torch.Tensor  # [H, P] fp16, max ||k_rest|| in the page

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"page_channels": self.channels, "page_lo": self.lo, "page_hi": self.hi,
                "page_rest_norm": self.rest_norm}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def num_pages(self) -> int:
        return self.lo.shape[1]


def build_page_meta(k: torch.Tensor, page_tokens: int, meta_channels: int) -> PageMeta:
    """k: decoded K [H, S, D] in the segment's K basis; S must be a multiple of page_tokens."""
    h, s, d = k.shape
    if s % page_tokens:
        raise ValueError(f"segment of {s} tokens is not a multiple of page_tokens={page_tokens}")
    m = min(meta_channels, d)
    chans = k.pow(2).sum(1).topk(m, dim=-1).indices.sort(-1).values  # [H, m]
    pages = k.reshape(h, s // page_tokens, page_tokens, d)
    sel = torch.gather(pages, 3, chans[:, None, None, :].expand(-1, pages.shape[1], page_tokens, -1))
    rest_sq = (pages.pow(2).sum(-1) - sel.pow(2).sum(-1)).clamp_min(0)
    return PageMeta(
        channels=chans.to(torch.uint8),
        lo=round_fp16(sel.amin(2), down=True),
        hi=round_fp16(sel.amax(2), down=False),
        rest_norm=round_fp16(rest_sq.amax(2).sqrt(), down=False),
    )


def page_upper_bound(meta: PageMeta, q: torch.Tensor) -> torch.Tensor:
    """q [H, G, D] in the same basis -> upper bound of q.k per page, [H, G, P]."""
    q = q.float()
    idx = meta.channels.long()[:, None, :].expand(-1, q.shape[1], -1)
    qc = torch.gather(q, 2, idx)  # [H, G, m]
    lo, hi = meta.lo.float()[:, None], meta.hi.float()[:, None]  # [H, 1, P, m]
    head = torch.maximum(qc[:, :, None] * lo, qc[:, :, None] * hi).sum(-1)
    q_rest = (q.pow(2).sum(-1) - qc.pow(2).sum(-1)).clamp_min(0).sqrt()  # [H, G]
    return head + q_rest[..., None] * meta.rest_norm.float()[:, None]


def select_pages(bounds: torch.Tensor, page_tokens: int, budget_tokens: int,
                 sink_pages: int, recent_pages: int) -> torch.Tensor:
    """bounds [H, G, P] over all compressed pages of a sequence -> keep mask [H, P] (bool).

    The G query heads sharing a KV head vote with their max bound, so every rank and every head of
    a group reads the same pages. Sink and recent pages are always kept and count toward the
    budget; if the budget covers everything, everything is read.
    """
    h, _, p = bounds.shape
    keep = torch.zeros(h, p, dtype=torch.bool, device=bounds.device)
    pages_allowed = max(budget_tokens // page_tokens, 0)
    if pages_allowed >= p:
        keep[:] = True
        return keep
    keep[:, :min(sink_pages, p)] = True
    if recent_pages:
        keep[:, max(p - recent_pages, 0):] = True
    score = bounds.amax(1).masked_fill(keep, float("-inf"))
    extra = pages_allowed - int(keep[0].sum())
    if extra > 0:
        top = score.topk(min(extra, p), dim=-1).indices
        keep.scatter_(1, top, True)
    return keep
