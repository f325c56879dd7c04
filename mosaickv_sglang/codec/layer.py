"""Compress one layer's K/V stream into sealed segments + a dense hot buffer.

Layout per layer: SVD bases (one K and one V basis per KV head per basis block), a list of
segments (each: header, K and V in the strategies the chooser picked, page metadata for
selection), and the hot buffer of the most recent tokens kept dense in bf16. Every tensor kept is
enumerated by `CompressedLayer.byte_breakdown`, which is where all reported ratios come from.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import MosaicConfig
from .basis import fit_basis, rotate
from .pages import PageMeta, build_page_meta
from .strategies import Encoded, Strategy, parse_strategy, strategy_id

HEADER_FIELDS = ("k_strategy", "v_strategy", "k_basis", "v_basis", "start", "tokens")
DENSE = parse_strategy("dense")


@dataclass
class Choice:
    strategy: Strategy
    encoded: Encoded
    error: float  # relative reconstruction error measured at seal time
    reason: str  # 'within-budget', 'sink' (sink candidate within the sink budget) or
    # 'over-budget' (no candidate met the budget: kept dense)


def relative_error(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    return float((x_hat - x).norm() / x.norm().clamp_min(1e-12))


def choose(x: torch.Tensor, x_rot: torch.Tensor, kind: str, candidates: list[Strategy],
           budget: float, reason: str = "within-budget", fallback: Strategy = DENSE) -> Choice:
    """Cheapest candidate (measured bytes) whose reconstruction error is within budget.

    x and x_rot are the same vectors in the raw and the rotated basis (norms are equal, so errors
    compare). If none qualifies the segment stays dense: outlier-heavy segments end up here.
    """
    tried = []
    for strat in candidates:
        src = x_rot if strat.rot else x
        enc = Encoded(kind, tuple(x.shape), strat.encode(src, kind))
        tried.append((enc.nbytes(), relative_error(strat.decode(enc), src), strat, enc))
    tried.sort(key=lambda item: item[0])
    for _, err, strat, enc in tried:
        if err <= budget:
            return Choice(strat, enc, err, reason)
    enc = Encoded(kind, tuple(x.shape), fallback.encode(x, kind))
    # With no candidates at all, dense is the configured choice, not a missed budget.
    return Choice(fallback, enc, relative_error(fallback.decode(enc), x),
                  "over-budget" if candidates else reason)


@dataclass
class Segment:
    start: int
    tokens: int
    k: Choice
    v: Choice
    basis: int  # index of the basis block (K basis for pages/rotated K, V basis for rotated V)
    pages: PageMeta | None
    pages_rotated: bool  # page metadata lives in the K basis (K is rotated), else raw channels
    header: torch.Tensor  # int32 [len(HEADER_FIELDS)], what a kernel needs to find and read it


@dataclass
class CompressedLayer:
    k_bases: list[torch.Tensor] = field(default_factory=list)  # [H, D, D] bf16 per block
    v_bases: list[torch.Tensor] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    hot_k: torch.Tensor | None = None  # [H, T_hot, D] bf16
    hot_v: torch.Tensor | None = None
    hot_start: int = 0

    def byte_breakdown(self) -> dict[str, int]:
        """Physical bytes of everything kept, by kind, measured from the tensors themselves."""
        out = {"values": 0, "indices": 0, "scales": 0, "headers": 0, "page_meta": 0,
               "bases": 0, "hot": 0}
        used_k = {s.basis for s in self.segments if s.k.strategy.rot or s.pages_rotated}
        used_v = {s.basis for s in self.segments if s.v.strategy.rot}
        out["bases"] = sum(_nbytes(self.k_bases[i]) for i in used_k) + \
            sum(_nbytes(self.v_bases[i]) for i in used_v)
        for seg in self.segments:
            for kind, n in segment_bytes(seg).items():
                out[kind] += n
        for t in (self.hot_k, self.hot_v):
            if t is not None:
                out["hot"] += _nbytes(t)
        return out

    def tokens(self) -> int:
        hot = 0 if self.hot_k is None else self.hot_k.shape[1]
        return sum(s.tokens for s in self.segments) + hot


def segment_bytes(seg: Segment) -> dict[str, int]:
    """Bytes one sealed segment keeps, by kind (bases are shared and counted by their owner)."""
    out = {"values": 0, "indices": 0, "scales": 0, "headers": _nbytes(seg.header),
           "page_meta": seg.pages.nbytes() if seg.pages is not None else 0}
    for choice in (seg.k, seg.v):
        for name, t in choice.encoded.tensors.items():
            out[_byte_kind(name)] += _nbytes(t)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _byte_kind(name: str) -> str:
    if name.startswith(("values", "codes")):
        return "values"
    if name in ("index", "bitmap", "channels"):
        return "indices"
    return "scales"  # scale, zero, value_scale


@dataclass
class Candidates:
    """The parsed strategy candidates of a config (parsed once, used for every segment)."""
    k: list[Strategy]
    v: list[Strategy]
    sink: list[Strategy]

    @classmethod
    def from_config(cls, cfg: MosaicConfig) -> "Candidates":
        parse = lambda specs: [parse_strategy(s) for s in specs]  # noqa: E731
        return cls(parse(cfg.k_candidates), parse(cfg.v_candidates), parse(cfg.sink_candidates))


def seal_segment(k: torch.Tensor, v: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                 basis_id: int, start: int, cfg: MosaicConfig, cands: Candidates, sink: bool,
                 select_meta: bool, fallback: Strategy = DENSE) -> Segment:
    """One segment's K and V [H, S, D] (float) -> a sealed Segment: the chooser's strategies,
    page metadata in the space its scores are computed in, and the header. Shared by the
    offline codec (compress_layer) and the serving pool."""
    if sink:
        kc = choose(k, rotate(k, kb), "k", cands.sink, cfg.sink_error_budget, "sink", fallback)
        vc = choose(v, rotate(v, vb), "v", cands.sink, cfg.sink_error_budget, "sink", fallback)
    else:
        kc = choose(k, rotate(k, kb), "k", cands.k, cfg.k_error_budget, fallback=fallback)
        vc = choose(v, rotate(v, vb), "v", cands.v, cfg.v_error_budget, fallback=fallback)
    pages = None
    if select_meta:  # see codec/pages.py
        pages = build_page_meta(kc.strategy.decode(kc.encoded), cfg.page_tokens,
                                cfg.select.meta_channels)
    tokens = k.shape[1]
    header = torch.tensor([strategy_id(kc.strategy.name), strategy_id(vc.strategy.name),
                           basis_id if kc.strategy.rot else -1,
                           basis_id if vc.strategy.rot else -1, start, tokens], dtype=torch.int32)
    return Segment(start, tokens, kc, vc, basis_id, pages, pages is not None and kc.strategy.rot,
                   header)


def compress_layer(k: torch.Tensor, v: torch.Tensor, cfg: MosaicConfig,
                   select_meta: bool | None = None) -> CompressedLayer:
    """k, v: [H, T, D] (bf16 values as the dense cache holds them) -> CompressedLayer.

    Tokens past the last whole segment that leaves >= hot_tokens behind stay in the hot buffer.
    `select_meta` (default: cfg.select.enabled) builds per-page metadata for query-aware selection.
    """
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [H, T, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    select_meta = cfg.select.enabled if select_meta is None else select_meta
    _, t, _ = k.shape
    seg = cfg.segment_tokens
    sealed = max((t - cfg.hot_tokens) // seg, 0) * seg
    cands = Candidates.from_config(cfg)
    layer = CompressedLayer(hot_start=sealed)
    kf, vf = k.float(), v.float()
    for block_start in range(0, sealed, cfg.basis_block_tokens):
        block_end = min(block_start + cfg.basis_block_tokens, sealed)
        kb = fit_basis(kf[:, block_start:block_end])
        vb = fit_basis(vf[:, block_start:block_end])
        layer.k_bases.append(kb)
        layer.v_bases.append(vb)
        basis_id = len(layer.k_bases) - 1
        for start in range(block_start, block_end, seg):
            layer.segments.append(seal_segment(
                kf[:, start:start + seg], vf[:, start:start + seg], kb, vb, basis_id, start, cfg,
                cands, sink=start // seg < cfg.sink_segments, select_meta=select_meta))
    layer.hot_k = k[:, sealed:].to(torch.bfloat16).contiguous()
    layer.hot_v = v[:, sealed:].to(torch.bfloat16).contiguous()
    return layer
