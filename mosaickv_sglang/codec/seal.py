"""Seal a group of full pages (all layers) into compressed segments: the one sealing routine.

The serving pool runs it inline (``daemon: off``, and backpressure seals) and the recompression
daemon's worker runs it on pages copied into shared memory, so both produce the same segments
from the same K/V. A group without bases fits them on its own pages (the first seal of a basis
block); later groups of the block reuse them. Torch only: no SGLang import (the worker is a bare
process).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import MosaicConfig
from .basis import fit_basis
from .layer import Candidates, Segment, seal_segments, segment_bytes
from .pages import build_page_meta
from .strategies import Encoded, Strategy, parse_strategy

# (page index in the group, local layer) -> (K, V) as float [H, S, D]
PageReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class BasisPair:
    """K and V bases of one position block, per layer ([H, D, D] bf16 each)."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass
class SealedPage:
    position: int  # first token position in the request that sealed it
    segments: list[Segment]  # one per layer
    bases: BasisPair
    nbytes: int = 0


def fit_bases(read: PageReader, n_pages: int, layers: int) -> BasisPair:
    """Bases of a basis block, fitted on the pages of its first sealed group."""
    ks, vs = [], []
    for local in range(layers):
        kv = [read(i, local) for i in range(n_pages)]
        ks.append(fit_basis(torch.cat([k for k, _ in kv], 1)))
        vs.append(fit_basis(torch.cat([v for _, v in kv], 1)))
    return BasisPair(ks, vs)


SEAL_BATCH = 256  # segments (page x layer) encoded per chooser call: bounds the transient memory


def seal_page(read: PageReader, index: int, position: int, bases: BasisPair, layers: int,
              cfg: MosaicConfig, cands: Candidates, dense: Strategy) -> SealedPage:
    """One page (all layers) -> SealedPage; `position` decides whether it is a sink page."""
    return seal_pages(read, [index], [position], bases, layers, cfg, cands, dense)[0]


def seal_group(read: PageReader, positions: list[int], bases: BasisPair | None, layers: int,
               cfg: MosaicConfig, cands: Candidates, dense: Strategy) -> list[SealedPage]:
    """Pages of one basis block (positions in request order); bases fitted here if None."""
    if bases is None:
        bases = fit_bases(read, len(positions), layers)
    return seal_pages(read, list(range(len(positions))), positions, bases, layers, cfg, cands,
                      dense)


def seal_pages(read: PageReader, indices: list[int], positions: list[int], bases: BasisPair,
               layers: int, cfg: MosaicConfig, cands: Candidates,
               dense: Strategy) -> list[SealedPage]:
    """Pages (all layers) sharing `bases` -> SealedPages, the (page, layer) segments batched
    through the chooser (`seal_segments`) SEAL_BATCH at a time, sink pages apart."""
    segs = {}
    for sink in (True, False):
        todo = [(j, local) for j, pos in enumerate(positions)
                if (pos // cfg.segment_tokens < cfg.sink_segments) == sink
                for local in range(layers)]
        for c in range(0, len(todo), SEAL_BATCH):
            part = todo[c:c + SEAL_BATCH]
            kv = [read(indices[j], local) for j, local in part]
            sealed = seal_segments(
                torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv]),
                torch.stack([bases.k[local] for _, local in part]),
                torch.stack([bases.v[local] for _, local in part]), 0,
                [positions[j] for j, _ in part], cfg, cands, sink, cfg.select.enabled, dense)
            segs.update(zip(part, sealed))
    pages = []
    for j, pos in enumerate(positions):
        page_segs = [segs[(j, local)] for local in range(layers)]
        pages.append(SealedPage(pos, page_segs, bases,
                                sum(sum(segment_bytes(x).values()) for x in page_segs)))
    return pages


def worst_encoded_bytes(specs, kind: str, heads: int, tokens: int, head_dim: int) -> int:
    """Largest bytes any of `specs` keeps for one [heads, tokens, head_dim] K or V segment."""
    x = torch.randn(heads, tokens, head_dim)
    return max(Encoded(kind, tuple(x.shape), parse_strategy(s).encode(x, kind)).nbytes()
               for s in specs)


def worst_page_bytes(cfg: MosaicConfig, heads: int, head_dim: int, dense: Strategy) -> int:
    """Upper bound of one sealed page's bytes per layer (any candidate or the dense fallback,
    page metadata, header), without bases."""
    s = cfg.segment_tokens
    k = worst_encoded_bytes([*cfg.k_candidates, *cfg.sink_candidates, dense], "k", heads, s,
                            head_dim)
    v = worst_encoded_bytes([*cfg.v_candidates, *cfg.sink_candidates, dense], "v", heads, s,
                            head_dim)
    meta = build_page_meta(torch.randn(heads, s, head_dim), cfg.page_tokens,
                           cfg.select.meta_channels).nbytes() if cfg.select.enabled else 0
    return k + v + meta + 4 * 6
