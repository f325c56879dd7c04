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
from .basis import fit_with, resolve_fit_solver, write_transform
from .pages import PageMeta, build_page_meta
from .strategies import Encoded, Strategy, parse_strategy, strategy_id
from .timing import phase

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
    # The chooser's K and V in their bases (float32 [H, S, D], views of its batch), kept only
    # when sealing asks for them (`keep_rotated`): the serving store's GPU pack kernel encodes
    # the chosen bands from them straight into its arena, then drops them.
    rotated: tuple[torch.Tensor, torch.Tensor] | None = None


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
    rescue: list[Strategy] = field(default_factory=list)  # before the dense fallback

    @classmethod
    def from_config(cls, cfg: MosaicConfig) -> "Candidates":
        parse = lambda specs: [parse_strategy(s) for s in specs]  # noqa: E731
        return cls(parse(cfg.k_candidates), parse(cfg.v_candidates), parse(cfg.sink_candidates),
                   parse(cfg.rescue_candidates))


def seal_segment(k: torch.Tensor, v: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                 basis_id: int, start: int, cfg: MosaicConfig, cands: Candidates, sink: bool,
                 select_meta: bool, fallback: Strategy = DENSE) -> Segment:
    """One segment's K and V [H, S, D] (float) -> a sealed Segment (see `seal_segments`)."""
    return seal_segments(k[None], v[None], kb[None], vb[None], basis_id, [start], cfg, cands,
                         sink, select_meta, fallback)[0]


def seal_segments(k: torch.Tensor, v: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                  basis_id: int, starts: list[int], cfg: MosaicConfig, cands: Candidates,
                  sink: bool, select_meta: bool, fallback: Strategy = DENSE,
                  timer=None, keep_rotated: bool = False,
                  write: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[Segment]:
    """N segments' K and V [N, H, S, D] (float) with their bases [N, H, D, D] -> N sealed
    Segments: the chooser's strategies, page metadata in the space its scores are computed in,
    and the header. Each candidate is encoded once for all N (segments are independent: every
    strategy works per head, and the batch rides on the head axis), which is what makes sealing
    a whole request (pages x layers) cheap. A segment's tensors are views of the batch's (no
    copy per segment): the serving store copies them into its arena, and whatever keeps a
    segment elsewhere calls `own_storage`. Shared by the offline codec and the serving pool.
    `keep_rotated` also hands each segment its rotated K/V (`Segment.rotated`). `write`: the
    bases' write transforms (`write_transform(kb)`, `write_transform(vb)`) when the caller has
    them, so pages sharing a basis block invert each basis once, not once per segment; kb and
    vb are then unused (None), and the transforms may be per layer for whole pages (`_rotate`)."""
    budgets = (cfg.sink_error_budget,) * 2 if sink else (cfg.k_error_budget, cfg.v_error_budget)
    k_cands, v_cands = (cands.sink, cands.sink) if sink else (cands.k, cands.v)
    reason = "sink" if sink else "within-budget"
    with phase(timer, "choose_encode"):
        kw, vw = write if write is not None else (write_transform(kb), write_transform(vb))
        k_rot, v_rot = _rotate(k, kw), _rotate(v, vw)
        kc, k_dec = _choose_batch(k, k_rot, "k", k_cands, budgets[0], reason,
                                  fallback, need_decoded=select_meta, rescue=cands.rescue)
        vc, _ = _choose_batch(v, v_rot, "v", v_cands, budgets[1], reason, fallback,
                              rescue=cands.rescue)
    n, h, s, d = k.shape
    metas = [None] * n
    with phase(timer, "page_meta"):
        if select_meta:  # see codec/pages.py
            flat = build_page_meta(k_dec.reshape(n * h, s, d), cfg.page_tokens,
                                   cfg.select.meta_channels)
            parts = [t.reshape(n, h, *t.shape[1:]).unbind(0) for t in
                     (flat.channels, flat.lo, flat.hi, flat.rest_norm)]
            metas = [PageMeta(*meta) for meta in zip(*parts)]
        headers = torch.tensor([[strategy_id(kc[i].strategy.name), strategy_id(vc[i].strategy.name),
                                 basis_id if kc[i].strategy.rot else -1,
                                 basis_id if vc[i].strategy.rot else -1, start, s]
                                for i, start in enumerate(starts)], dtype=torch.int32)
    return [Segment(start, s, kc[i], vc[i], basis_id, metas[i],
                    metas[i] is not None and kc[i].strategy.rot, headers[i],
                    (k_rot[i], v_rot[i]) if keep_rotated else None)
            for i, start in enumerate(starts)]


def _rotate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, H, S, D] @ w: one transform per segment ([N, H, D, D]), or n < N transforms that
    repeat over x's rows (N = pages x n layers, page-major: `seal_pages`'s whole-page batches),
    broadcast instead of copied per segment."""
    x = x.float()
    if w.shape[0] == x.shape[0]:
        return x @ w
    return (x.view(-1, w.shape[0], *x.shape[1:]) @ w).flatten(0, 1)


def own_storage(seg: Segment) -> None:
    """Give a segment's tensors their own memory: `seal_segments` hands out views of its batch
    tensors, which would keep the whole batch alive for as long as the segment is kept."""
    for choice in (seg.k, seg.v):
        choice.encoded.tensors = {name: t.clone() for name, t in choice.encoded.tensors.items()}
    if seg.pages is not None:
        seg.pages = PageMeta(*(t.clone() for t in
                               (seg.pages.channels, seg.pages.lo, seg.pages.hi,
                                seg.pages.rest_norm)))
    seg.header = seg.header.clone()
    seg.rotated = None


def _choose_batch(x, x_rot, kind, candidates, budget, reason, fallback, need_decoded=False,
                  rescue=()):
    """`choose` for N segments [N, H, S, D] at once -> (N Choices, the chosen reconstructions
    [N, H, S, D] in each choice's own space, when need_decoded). Candidates are tried cheapest
    first (bytes per segment) and each one is encoded only for the segments no cheaper one
    fitted: on real K/V most segments stop at the first or second of three (the work the
    chooser does is its encodes; the picks are those of encoding every candidate). Each try's
    errors come to the host in one transfer; each Choice's tensors are views of its try's batch.
    Segments no candidate fits try `rescue` (reason "rescued"), then get `fallback`."""
    n, h, s, d = x.shape
    tries = []  # (strategy, tensors, segments encoded, errors, reconstruction, reason)
    pick = {}  # segment -> (try, row in the try)
    todo = list(range(n))

    def attempt(strat, why, within_budget=True):
        nonlocal todo
        src = x_rot if strat.rot else x
        if len(todo) < n:
            src = src[todo]
        m = len(todo)
        tensors, dec = strat.encode_decoded(src.reshape(m * h, s, d), kind)
        dec = dec.reshape(m, h, s, d)
        errs = _errors(dec, src).tolist()
        tries.append((strat, tensors, m, errs, dec, why))
        for row, i in enumerate(todo):
            if not within_budget or errs[row] <= budget:
                pick[i] = (len(tries) - 1, row)
        todo = [i for i in todo if i not in pick]

    for strat in sorted(candidates, key=lambda st: _segment_bytes(st, kind, h, s, d)):
        if todo:
            attempt(strat, reason)
    for strat in rescue if candidates else ():
        if todo:
            attempt(strat, "rescued")
    if todo:  # no candidate met the budget: the fallback (dense), for those segments only
        # With no candidates at all, dense is the configured choice, not a missed budget.
        attempt(fallback, "over-budget" if candidates else reason, within_budget=False)
    rows_of = {}  # try -> per segment row, its tensors as views (made once per try)

    def views(t):
        if t not in rows_of:
            _, tensors, rows, *_ = tries[t]
            per_name = {name: t_.reshape(rows, h, *t_.shape[1:]).unbind(0)
                        for name, t_ in tensors.items()}
            rows_of[t] = [dict(zip(per_name, row)) for row in zip(*per_name.values())]
        return rows_of[t]

    choices, decoded = [], []
    for i in range(n):
        t, row = pick[i]
        strat, _, _, errs, dec, why = tries[t]
        choices.append(Choice(strat, Encoded(kind, (h, s, d), views(t)[row]), errs[row], why))
        if need_decoded:
            decoded.append(dec[row])
    return choices, torch.stack(decoded) if need_decoded else None


_BYTES: dict[tuple, int] = {}


def _segment_bytes(strat: Strategy, kind: str, heads: int, tokens: int, head_dim: int) -> int:
    """Bytes one [heads, tokens, head_dim] segment takes in `strat` (what orders the chooser's
    candidates; no strategy's size depends on the values), measured once per shape."""
    key = (strat.spec, kind, heads, tokens, head_dim)
    if key not in _BYTES:
        x = torch.randn(heads, tokens, head_dim)
        _BYTES[key] = Encoded(kind, tuple(x.shape), strat.encode(x, kind)).nbytes()
    return _BYTES[key]


def _errors(dec: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Relative reconstruction error per segment, [N] (on the device)."""
    return (dec - src).flatten(1).norm(dim=1) / src.flatten(1).norm(dim=1).clamp_min(1e-12)


def compress_layer(k: torch.Tensor, v: torch.Tensor, cfg: MosaicConfig,
                   select_meta: bool | None = None, fit_on=None) -> CompressedLayer:
    """k, v: [H, T, D] (bf16 values as the dense cache holds them) -> CompressedLayer.

    Tokens past the last whole segment that leaves >= hot_tokens behind stay in the hot buffer
    (what the server's next token, at position T, reads compressed).
    `select_meta` (default: cfg.select.enabled) builds per-page metadata for query-aware selection.
    `fit_on(block_start, block_end, k, v, layer)` -> (k, v) [H, N, D] float32: what a block's
    bases are fitted on (default: the config's `basis_fit`, as the server fits them, a short
    tail block reusing the previous block's under `basis_inherit_below_tokens`); `layer`
    holds the blocks before it (scripts/basis_rule_probe.py measures other rules).
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
    solver = resolve_fit_solver(cfg.fit_solver, k.device)
    for block_start in range(0, sealed, cfg.basis_block_tokens):
        block_end = min(block_start + cfg.basis_block_tokens, sealed)
        if fit_on is None and block_start and cfg.basis_fit == "group" and \
                block_end - block_start < min(cfg.basis_inherit_below_tokens,
                                              cfg.basis_block_tokens):
            # a short tail block takes the previous block's bases, as the server's pool gives
            # a group that opens a block with fewer tokens (MosaicKVPool._opening_bases)
            kb, vb = layer.k_bases[-1], layer.v_bases[-1]
        else:
            if fit_on is None:
                # the block's first segment (first_page, as codec/seal.fit_block_bases) or all
                fit_end = block_start + seg if cfg.basis_fit == "first_page" else block_end
                fk, fv = kf[:, block_start:fit_end], vf[:, block_start:fit_end]
            else:
                fk, fv = fit_on(block_start, block_end, kf, vf, layer)
            layer.k_bases.append(fit_with(fk, solver))
            layer.v_bases.append(fit_with(fv, solver))
            kb, vb = layer.k_bases[-1], layer.v_bases[-1]
        basis_id = len(layer.k_bases) - 1
        for start in range(block_start, block_end, seg):
            layer.segments.append(seal_segment(
                kf[:, start:start + seg], vf[:, start:start + seg], kb, vb, basis_id, start, cfg,
                cands, sink=start // seg < cfg.sink_segments, select_meta=select_meta))
    layer.hot_k = k[:, sealed:].to(torch.bfloat16).contiguous()
    layer.hot_v = v[:, sealed:].to(torch.bfloat16).contiguous()
    return layer
