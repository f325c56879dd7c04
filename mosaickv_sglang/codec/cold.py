"""Recompression of a sealed page's segments with cheaper ("cold") candidates.

A sealed band segment is decoded in its SVD basis and re-encoded with each cold candidate that
keeps fewer bytes, cheapest first; the first whose error against the decoded segment, added to
the error the segment was sealed with, is within the cold budget wins (a bound on its error
against the original K/V, by the triangle inequality). Bases are unchanged (same basis, same
rotation); the page metadata of a recompressed K is rebuilt from its new reconstruction, as
sealing builds it from the chooser's. A kind no candidate fits is kept as it is.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..config import MosaicConfig
from .layer import Choice, Segment, relative_error, segment_bytes
from .pages import build_page_meta
from .seal import BasisPair, SealedPage
from .strategies import Encoded, Strategy, parse_strategy


def _cheaper(choice: Choice, kind: str, candidates: list[Strategy], budget: float,
             ) -> tuple[Choice, torch.Tensor] | None:
    """The cheapest candidate within budget that keeps fewer bytes than `choice`, with its
    reconstruction (float32, the SVD basis); None when the kind is not a rotated band or none
    fits."""
    if not choice.strategy.rot or choice.strategy.name != "band":
        return None
    x_hat = choice.strategy.decode(choice.encoded).float()
    have = choice.encoded.nbytes()
    tried = []
    for strat in candidates:
        enc = Encoded(kind, choice.encoded.shape, strat.encode(x_hat, kind))
        if enc.nbytes() < have:
            tried.append((enc.nbytes(), strat, enc))
    for _, strat, enc in sorted(tried, key=lambda t: t[0]):
        dec = strat.decode(enc).float()
        err = choice.error + relative_error(dec, x_hat)
        if err <= budget:
            return Choice(strat, enc, err, "cold"), dec
    return None


def recompress_segment(seg: Segment, cfg: MosaicConfig, k_cands: list[Strategy],
                       v_cands: list[Strategy]) -> Segment | None:
    """`seg` with its K and/or V in a cheaper cold candidate, or None when neither changed."""
    k = _cheaper(seg.k, "k", k_cands, cfg.cold.k_error_budget)
    v = _cheaper(seg.v, "v", v_cands, cfg.cold.v_error_budget)
    if k is None and v is None:
        return None
    pages = seg.pages
    if k is not None and pages is not None and seg.pages_rotated:
        pages = build_page_meta(k[1], cfg.page_tokens, cfg.select.meta_channels)
    # rotated=None: the store copies the encoded tensors as they are (the pack kernel would
    # re-encode the unchanged kind from its reconstruction, not byte for byte the same)
    return replace(seg, k=k[0] if k else seg.k, v=v[0] if v else seg.v, pages=pages,
                   header=seg.header.clone(), rotated=None)


def recompress_page(position: int, segments, bases: BasisPair | None, cfg: MosaicConfig,
                    k_cands: list[Strategy], v_cands: list[Strategy]) -> SealedPage | None:
    """A sealed page with each layer's segment through `recompress_segment` (the layers no cold
    candidate improves kept as they were), its bytes re-counted; None when no layer changed.
    What the scheduler thread runs without a daemon and a worker runs for a cold job."""
    segs = list(segments)
    new = [recompress_segment(seg, cfg, k_cands, v_cands) for seg in segs]
    if all(n is None for n in new):
        return None
    segs = [n if n is not None else seg for n, seg in zip(new, segs)]
    return SealedPage(position, segs, bases, sum(sum(segment_bytes(x).values()) for x in segs))


def cold_candidates(cfg: MosaicConfig) -> tuple[list[Strategy], list[Strategy]]:
    return ([parse_strategy(s) for s in cfg.cold.k_candidates],
            [parse_strategy(s) for s in cfg.cold.v_candidates])
