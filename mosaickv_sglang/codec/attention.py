"""Reference decode attention over (packed segments + dense hot buffer), GQA-aware.

This is the torch oracle the Triton kernels are tested against and the CPU path of the attention
backend. Per segment it rotates q into the segment's K basis, scores on the packed form
(`Strategy.qk`), masks pages the selector dropped, and accumulates p.v in the segment's V basis
(`Strategy.pv`), rotating the partial output back once per segment. Partials merge with a running
log-sum-exp, so it is stable for any score range and never builds the decompressed cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SelectionConfig
from .basis import rotate_query, unrotate
from .layer import CompressedLayer
from .pages import page_upper_bound, select_pages


@dataclass
class AttentionInfo:
    pages_read: int  # summed over queries and KV heads
    pages_total: int
    page_keep: torch.Tensor | None  # [Nq, H, P] bool, None when everything is read
    pages_rescored: int = 0  # candidates whose compressed K was scored to rank them (rescore)


@dataclass
class PageReads:
    """Running count of compressed (page, KV head) pairs a decode path could read
    (`available`) and read (`read`: the selected pages, or all of them without selection),
    summed over queries, layers and steps: selection's read fraction in the server stats."""
    available: int = 0
    read: int = 0

    def add(self, info: AttentionInfo) -> None:
        """One `decode_attention` call's pages (host ints: the reference is the CPU path)."""
        self.available += info.pages_total
        self.read += info.pages_read

    def stats(self) -> dict:
        return {"pages_available": self.available, "pages_read": self.read,
                "read_fraction": self.read / self.available if self.available else None}


class _Merger:
    """Running (max, sum, acc) over partial softmaxes, in float32."""

    def __init__(self, h: int, g: int, d: int, device):
        self.m = torch.full((h, g), float("-inf"), device=device)
        self.l = torch.zeros(h, g, device=device)
        self.acc = torch.zeros(h, g, d, device=device)

    def add(self, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> None:
        new_m = torch.maximum(self.m, m)
        a = torch.exp(self.m - new_m).nan_to_num(0.0)
        b = torch.exp(m - new_m).nan_to_num(0.0)
        self.l = self.l * a + l * b
        self.acc = self.acc * a[..., None] + acc * b[..., None]
        self.m = new_m

    def result(self) -> torch.Tensor:
        return self.acc / self.l[..., None]


def _softmax_parts(scores: torch.Tensor):
    m = scores.amax(-1)
    p = torch.exp(scores - m.clamp_min(torch.finfo(scores.dtype).min)[..., None])
    return m, p


def decode_attention(q: torch.Tensor, layer: CompressedLayer, q_positions: torch.Tensor,
                     select: SelectionConfig | None, page_tokens: int,
                     sm_scale: float | None = None, return_probs: bool = False):
    """q [Nq, Hq, D] for decode queries at absolute positions q_positions [Nq] (each attends to
    every compressed token and to hot tokens at positions <= its own).

    Returns (out [Nq, Hq, D], AttentionInfo), plus, with return_probs, the attention
    probabilities the method effectively used over all T tokens [Nq, Hq, T] (for analysis).
    """
    nq, hq, d = q.shape
    h = layer.hot_k.shape[0]
    if hq % h:
        raise ValueError(f"{hq} query heads do not group evenly over {h} KV heads")
    g = hq // h
    qh = _grouped_queries(q, h, sm_scale)
    merger = _Merger(h, nq * g, d, q.device)

    q_in = [rotate_query(qh, b) for b in layer.k_bases]  # q in each K basis, once per basis
    seg_scores = [seg.k.strategy.qk(seg.k.encoded, q_in[seg.basis] if seg.k.strategy.rot else qh)
                  for seg in layer.segments]  # [H, Nq*G, S] each
    keep = _select(qh, q_in, layer, select, page_tokens, nq, g)
    rescored = 0
    if keep is not None and select is not None and select.rescore_factor:
        page_scores = seg_scores
        if select.rescore_meta_only:
            page_scores = [_meta_channel_scores(seg, q_in[seg.basis] if seg.pages_rotated
                                                else qh, full)
                           for seg, full in zip(layer.segments, seg_scores)]
        elif select.rescore_channels:
            page_scores = [_leading_channel_scores(seg, q_in[seg.basis], full,
                                                   select.rescore_channels)
                           for seg, full in zip(layer.segments, seg_scores)]
        keep, rescored = _rescore(keep, page_scores, select, page_tokens, nq, g)
    all_scores = []
    for i, seg in enumerate(layer.segments):
        vb = layer.v_bases[seg.basis] if seg.v.strategy.rot else None
        scores = seg_scores[i]
        if keep is not None:
            ppseg = seg.tokens // page_tokens
            page_mask = keep[:, :, i * ppseg:(i + 1) * ppseg]  # [Nq, H, pages]
            tok_mask = page_mask.repeat_interleave(page_tokens, dim=-1)  # [Nq, H, S]
            tok_mask = tok_mask.permute(1, 0, 2)[:, :, None].expand(-1, -1, g, -1)
            scores = scores.masked_fill(~tok_mask.reshape(h, nq * g, -1), float("-inf"))
        all_scores.append(scores)
        m, p = _softmax_parts(scores)
        acc = unrotate(seg.v.strategy.pv(seg.v.encoded, p), vb)
        merger.add(m, p.sum(-1), acc)

    if layer.hot_k.shape[1]:
        hot_pos = layer.hot_start + torch.arange(layer.hot_k.shape[1], device=q.device)
        visible = hot_pos[None, :] <= q_positions.to(q.device)[:, None]  # [Nq, T_hot]
        scores = torch.einsum("hgd,htd->hgt", qh, layer.hot_k.float())
        vis = visible[None, :, None, :].expand(h, -1, g, -1).reshape(h, nq * g, -1)
        scores = scores.masked_fill(~vis, float("-inf"))
        all_scores.append(scores)
        m, p = _softmax_parts(scores)
        merger.add(m, p.sum(-1), torch.einsum("hgt,htd->hgd", p, layer.hot_v.float()))

    out = merger.result().reshape(h, nq, g, d).permute(1, 0, 2, 3).reshape(nq, hq, d)
    total = sum(s.tokens // page_tokens for s in layer.segments) * nq * h
    info = AttentionInfo(total if keep is None else int(keep.sum()), total, keep, rescored)
    if not return_probs:
        return out, info
    probs = torch.cat(all_scores, -1).softmax(-1)  # [H, Nq*G, T]
    probs = probs.reshape(h, nq, g, -1).permute(1, 0, 2, 3).reshape(nq, hq, -1)
    return out, info, probs


def _meta_channel_scores(seg, q: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """[H, Nq*G, S] per-token scores from a segment's page-metadata channels only (their codes,
    decoded, exactly) plus the rest-norm bound of the token's page for the other channels:
    what a second selection stage reading m channels of the candidates' K ranks by. `full`
    (the whole compressed-K scores) is returned where the metadata is not in K's space."""
    meta = seg.pages
    if meta is None or seg.pages_rotated != bool(seg.k.strategy.rot):
        return full
    k = seg.k.strategy.decode(seg.k.encoded).float()  # [H, S, D] in the scoring space
    q = q.float()
    idx = meta.channels.long()  # [H, m]
    k_c = torch.gather(k, 2, idx[:, None, :].expand(-1, k.shape[1], -1))  # [H, S, m]
    q_c = torch.gather(q, 2, idx[:, None, :].expand(-1, q.shape[1], -1))  # [H, Q, m]
    q_rest = (q.pow(2).sum(-1) - q_c.pow(2).sum(-1)).clamp_min(0).sqrt()  # [H, Q]
    page_tokens = k.shape[1] // meta.num_pages
    rest = meta.rest_norm.float().repeat_interleave(page_tokens, dim=1)  # [H, S]
    return torch.einsum("hqm,hsm->hqs", q_c, k_c) + q_rest[:, :, None] * rest[:, None, :]


def _leading_channel_scores(seg, q: torch.Tensor, full: torch.Tensor, r: int) -> torch.Tensor:
    """[H, Nq*G, S] per-token scores on the leading `r` channels of a segment's compressed K in
    its SVD basis (`q` rotated into it), exactly, and nothing for the others: what a second
    stage reading r channels of the candidates' K ranks by. `full` where K is not rotated."""
    if not seg.k.strategy.rot or r >= q.shape[-1]:
        return full
    k = seg.k.strategy.decode(seg.k.encoded).float()[..., :r]  # [H, S, r]
    return torch.einsum("hqr,hsr->hqs", q.float()[..., :r], k)


def _rescore(candidates: torch.Tensor, seg_scores: list, select: SelectionConfig,
             page_tokens: int, nq: int, g: int):
    """Second stage of selection (`select.rescore_factor` > 0): among the candidate pages the
    bound kept (`candidates` [Nq, H, P], chosen at rescore_factor x the budget), the budget's
    pages by their best score on the compressed K (max over the page's tokens and the group's
    query heads), sink and recent pages kept as in stage 1. Returns (keep [Nq, H, P], the
    candidate (query, head, page) triples scored)."""
    h = seg_scores[0].shape[0]
    best = torch.cat([s.reshape(h, nq * g, -1, page_tokens).amax(-1) for s in seg_scores], -1)
    best = best.reshape(h, nq, g, -1).permute(1, 0, 2, 3)  # [Nq, H, G, P]
    best = best.masked_fill(~candidates[:, :, None, :], float("-inf"))
    sink, recent = _forced_pages(select, page_tokens)
    keep = torch.stack([select_pages(best[i], page_tokens, select.budget_tokens, sink, recent)
                        for i in range(nq)])
    return keep & candidates, int(candidates.sum())


def _forced_pages(select: SelectionConfig, page_tokens: int) -> tuple[int, int]:
    """(sink pages, recent pages) every selection keeps."""
    return -(-select.sink_tokens // page_tokens), -(-select.recent_tokens // page_tokens)


def _grouped_queries(q: torch.Tensor, h: int, sm_scale: float | None) -> torch.Tensor:
    """q [Nq, Hq, D] -> scaled float32 [H, Nq*G, D]: the query axis rides along the GQA group."""
    nq, hq, d = q.shape
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    return (q.float() * sm_scale).reshape(nq, h, hq // h, d).permute(1, 0, 2, 3).reshape(h, -1, d)


def _select(qh, q_in, layer: CompressedLayer, select: SelectionConfig | None, page_tokens: int,
            nq: int, g: int) -> torch.Tensor | None:
    """Page keep mask [Nq, H, P_total], or None when selection is off or the budget covers all."""
    if select is None or not select.enabled or not layer.segments:
        return None
    total_pages = sum(s.tokens // page_tokens for s in layer.segments)
    if select.budget_tokens >= total_pages * page_tokens:
        return None
    if any(s.pages is None for s in layer.segments):
        raise ValueError("selection is enabled but the layer was compressed without page metadata")
    bounds = torch.cat([page_upper_bound(s.pages, q_in[s.basis] if s.pages_rotated else qh)
                        for s in layer.segments], dim=-1)  # [H, Nq*G, P]
    h = bounds.shape[0]
    bounds = bounds.reshape(h, nq, g, -1)
    sink, recent = _forced_pages(select, page_tokens)
    # with a second stage, the bound picks rescore_factor x the budget's pages as candidates
    budget = select.budget_tokens * max(select.rescore_factor, 1)
    return torch.stack([select_pages(bounds[:, i], page_tokens, budget, sink, recent)
                        for i in range(nq)])
