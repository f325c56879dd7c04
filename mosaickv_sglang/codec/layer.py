"""Compress one layer's K/V stream into sealed segments + a dense hot buffer.

Layout per layer: SVD bases (one K and one V basis per KV head per basis block), a list of
segments (each: header, K and V in the strategies the chooser picked, page metadata for
selection), and the hot buffer of the most recent tokens kept dense in bf16. Every tensor kept is
enumerated by `CompressedLayer.byte_breakdown`, which is where all reported ratios come from.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import MosaicConfig
from .basis import fit_with, resolve_fit_solver, write_transform
from .pages import PageMeta, build_page_meta
from .strategies import Encoded, Strategy, parse_strategy, strategy_id
from .strategies.band import Band
from mosaickv_kernels.band_errors import CHUNK as BAND_ERRORS_CHUNK, band_errors
from mosaickv_kernels.band_encode import band_encode
from .timing import phase
from .transfer import to_device_async

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
                  write: tuple[torch.Tensor, torch.Tensor] | None = None,
                  keep_decoded: bool = False) -> "SegmentBatch":
    """N segments' K and V [N, H, S, D] (float) with their bases [N, H, D, D] -> N sealed
    segments as one `SegmentBatch`: the chooser's strategies, page metadata in the space its
    scores are computed in, and the headers, as per-batch tensors and per-segment index arrays
    (a `Segment` is made only when one is read: `batch[i]`). Each candidate is encoded once for
    all N (segments are independent: every strategy works per head, and the batch rides on the
    head axis), which is what makes sealing a whole request (pages x layers) cheap. A segment's
    tensors are views of the batch's (no copy per segment): the serving store copies them into
    its arena by row index, and whatever keeps a segment elsewhere calls `own_storage`. Shared
    by the offline codec and the serving pool. `keep_rotated` also keeps the rotated K/V
    (`SegmentBatch.rotated`, and `Segment.rotated` of a segment read from it). `write`: the
    bases' write transforms (`write_transform(kb)`, `write_transform(vb)`) when the caller has
    them, so pages sharing a basis block invert each basis once, not once per segment; kb and
    vb are then unused (None), and the transforms may be per layer for whole pages (`_rotate`).
    `keep_decoded` keeps the chosen reconstructions (`SegmentBatch.decoded`: K and V float32
    [N, H, S, D], each in its strategy's own space, rebuilt from the codes as `decode` rebuilds
    them), for reading the segments back without decoding each one."""
    budgets = (cfg.sink_error_budget,) * 2 if sink else (cfg.k_error_budget, cfg.v_error_budget)
    k_cands, v_cands = (cands.sink, cands.sink) if sink else (cands.k, cands.v)
    reason = "sink" if sink else "within-budget"
    with phase(timer, "choose_encode"):
        kw, vw = write if write is not None else (write_transform(kb), write_transform(vb))
        k_rot, v_rot = _rotate(k, kw), _rotate(v, vw)
        kc, k_dec = _choose_batch(k, k_rot, "k", k_cands, budgets[0], reason,
                                  fallback, need_decoded=select_meta or keep_decoded,
                                  rescue=cands.rescue,
                                  errors_first=use_errors_first(cfg.chooser, k, k_cands,
                                                                cands.rescue),
                                  encode_kernel=cfg.encode_kernel == "triton")
        vc, v_dec = _choose_batch(v, v_rot, "v", v_cands, budgets[1], reason, fallback,
                                  need_decoded=keep_decoded, rescue=cands.rescue,
                              errors_first=use_errors_first(cfg.chooser, v, v_cands,
                                                                cands.rescue),
                                  encode_kernel=cfg.encode_kernel == "triton")
    n, h, s, d = k.shape
    meta = None
    with phase(timer, "page_meta"):
        if select_meta:  # see codec/pages.py
            flat = build_page_meta(k_dec.reshape(n * h, s, d), cfg.page_tokens,
                                   cfg.select.meta_channels)
            meta = PageMeta(*(t.reshape(n, h, *t.shape[1:]) for t in
                              (flat.channels, flat.lo, flat.hi, flat.rest_norm)))
        # per try its header columns, per segment its try's: no per-segment Python
        cols = [kc.column(lambda st: strategy_id(st.name)), vc.column(lambda st: strategy_id(st.name)),
                kc.column(lambda st: basis_id if st.rot else -1),
                vc.column(lambda st: basis_id if st.rot else -1),
                np.asarray(starts, dtype=np.int64), np.full(n, s, dtype=np.int64)]
        headers = torch.from_numpy(np.stack(cols, 1).astype(np.int32))
    return SegmentBatch(kc, vc, list(starts), s, basis_id, meta, headers,
                        (k_rot, v_rot) if keep_rotated else None,
                        (k_dec, v_dec) if keep_decoded else None)


class SegmentBatch(Sequence):
    """What `seal_segments` returns for N segments: per kind the chooser's tries (`ChoiceBatch`:
    per try its batch tensors, per segment its (try, row)), the page metadata stacked
    ([N, H, ...] per field, or None), the codec headers int32 [N, len(HEADER_FIELDS)] and,
    when kept, the rotated K/V float32 [N, H, S, D]. Indexing makes the segment's `Segment`
    (views of the batch tensors) on first read and keeps it: the serving store installs a
    batch by its arrays and never makes one."""

    def __init__(self, k: "ChoiceBatch", v: "ChoiceBatch", starts: list[int], tokens: int,
                 basis: int, meta: PageMeta | None, headers: torch.Tensor,
                 rotated: tuple[torch.Tensor, torch.Tensor] | None,
                 decoded: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.k, self.v, self.starts, self.tokens, self.basis = k, v, starts, tokens, basis
        self.meta, self.headers, self.rotated = meta, headers, rotated
        self.decoded = decoded  # (K, V) chosen reconstructions, when kept (`keep_decoded`)
        self._made: list[Segment | None] = [None] * len(starts)
        self._nbytes: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        if i < 0:
            i += len(self)
        if self._made[i] is None:
            kc, vc = self.k[i], self.v[i]
            pages = None if self.meta is None else PageMeta(
                self.meta.channels[i], self.meta.lo[i], self.meta.hi[i], self.meta.rest_norm[i])
            self._made[i] = Segment(self.starts[i], self.tokens, kc, vc, self.basis, pages,
                                    pages is not None and kc.strategy.rot, self.headers[i],
                                    None if self.rotated is None else
                                    (self.rotated[0][i], self.rotated[1][i]))
        return self._made[i]

    def segment_nbytes(self) -> np.ndarray:
        """int64 [N]: `sum(segment_bytes(self[i]).values())` of every segment, from the tries'
        per-row byte sizes, the metadata's and the header's (no segment made)."""
        if self._nbytes is not None:
            return self._nbytes
        meta = 0 if self.meta is None else sum(
            t[0].numel() * t.element_size() for t in self.meta.tensors().values())
        header = self.headers[0].numel() * self.headers.element_size() if len(self) else 0
        self._nbytes = self.k.row_bytes() + self.v.row_bytes() + (meta + header)
        return self._nbytes

    def kinds(self, i: int) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
        """(kind, strategy spec, chooser reason) of segment i's K and V (no segment made)."""
        return ("k", *self.k.spec_reason(i)), ("v", *self.v.spec_reason(i))


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


def use_errors_first(choice: str, x: torch.Tensor, candidates, rescue) -> bool:
    """Does the chooser (config `chooser`) check errors first for segments x [N, H, S, D] with
    these candidates? "errors_first" needs every candidate and rescue to be a band
    `band_errors` reads (else it is refused); "auto" takes it on CUDA when they are."""
    if choice == "cascade":
        return False
    n, h, s, d = x.shape
    ok = all(isinstance(st, Band) and st.group % BAND_ERRORS_CHUNK == 0 and s % st.group == 0
             for st in (*candidates, *rescue)) and d & (d - 1) == 0
    if choice == "errors_first" and not ok:
        raise ValueError("mosaickv chooser 'errors_first' needs band candidates whose token group "
                         f"is a multiple of {BAND_ERRORS_CHUNK} dividing the segment ({s} tokens) "
                         f"and a power-of-two head_dim; got {[st.spec for st in candidates]} "
                         f"(rescue {[st.spec for st in rescue]}), head_dim {d}")
    return ok and (choice == "errors_first" or x.is_cuda)


def _choose_batch(x, x_rot, kind, candidates, budget, reason, fallback, need_decoded=False,
                  rescue=(), errors_first=False, encode_kernel=False):
    """`choose` for N segments [N, H, S, D] at once -> (the N choices as a `ChoiceBatch`, the
    chosen reconstructions [N, H, S, D] in each choice's own space, when need_decoded).
    Candidates are tried cheapest first (bytes per segment) and each one is encoded only for the
    segments no cheaper one fitted: on real K/V most segments stop at the first or second of
    three (the work the chooser does is its encodes; the picks are those of encoding every
    candidate). Each try's errors come to the host in one transfer; a Choice read from the
    batch has views of its try's tensors. Segments no candidate fits try `rescue` (reason
    "rescued"), then get `fallback`. `errors_first`: the same picks from `_choose_errors_first`
    (every candidate's error checked by a kernel, one transfer, one encode per segment;
    `encode_kernel`: band candidates encoded by `band_encode`, one launch each)."""
    if errors_first:
        return _choose_errors_first(x, x_rot, kind, candidates, budget, reason, fallback,
                                    need_decoded, rescue, encode_kernel)
    n, h, s, d = x.shape
    tries: list[Tried] = []
    try_of = np.full(n, -1, dtype=np.int64)  # segment -> its try
    row_of = np.zeros(n, dtype=np.int64)  # segment -> its row in the try
    todo = np.arange(n)

    def attempt(strat, why, within_budget=True):
        nonlocal todo
        m = len(todo)
        tensors, dec, src = _encode_rows(x, x_rot, strat, kind, todo)
        errs = _errors(dec, src).cpu().numpy().astype(np.float64)
        fits = np.ones(m, dtype=bool) if not within_budget else errs <= budget
        tries.append(Tried(strat, why, tensors, m, errs, dec, todo))
        try_of[todo[fits]] = len(tries) - 1
        row_of[todo[fits]] = np.nonzero(fits)[0]
        todo = todo[~fits]

    for strat in sorted(candidates, key=lambda st: _segment_bytes(st, kind, h, s, d)):
        if len(todo):
            attempt(strat, reason)
    for strat in rescue if candidates else ():
        if len(todo):
            attempt(strat, "rescued")
    if len(todo):  # no candidate met the budget: the fallback (dense), for those segments only
        # With no candidates at all, dense is the configured choice, not a missed budget.
        attempt(fallback, "over-budget" if candidates else reason, within_budget=False)
    batch = ChoiceBatch(kind, (h, s, d), tries, try_of, row_of)
    decoded = batch.decoded() if need_decoded else None
    for t in tries:  # the reconstructions are not kept with the batch
        t.decoded = None
    return batch, decoded


def _encode_rows(x, x_rot, strat, kind, rows: np.ndarray, kernel: bool = False):
    """`strat`'s encoding of the segments `rows` (host indices, ascending) of x [N, H, S, D], or
    of x_rot for a rotated strategy (all N: no gather): (its tensors, its reconstruction
    [m, H, S, D], the input it encoded). `kernel`: a band strategy through `band_encode`."""
    n, h, s, d = x.shape
    src = x_rot if strat.rot else x
    if len(rows) < n:
        src = src[to_device_async(rows, src.device)]
    m = len(rows)
    flat = src.reshape(m * h, s, d)
    if kernel and isinstance(strat, Band) and flat.dtype == torch.float32:
        tensors, dec = band_encode(flat.contiguous(), strat.widths(d))
    else:
        tensors, dec = strat.encode_decoded(flat, kind)
    return tensors, dec.reshape(m, h, s, d), src


def _choose_errors_first(x, x_rot, kind, candidates, budget, reason, fallback, need_decoded,
                         rescue, encode_kernel=False):
    """`_choose_batch` by errors first: each candidate, then each rescue (band strategies), has
    its error on every segment computed without encoding (`band_errors`: per (segment, head)
    the squared error and norm, summed over heads here), the errors of all come to the host in
    one transfer, each segment takes the first in the cascade's order within budget, and each
    candidate then encodes only the segments that took it (the fallback, as in the cascade, the
    segments none took, its error computed from its encoding). A try holds the segments that
    picked it, not every segment that tried it."""
    n, h, s, d = x.shape
    order = sorted(candidates, key=lambda st: _segment_bytes(st, kind, h, s, d))
    whys = [reason] * len(order)
    if candidates:
        order += list(rescue)
        whys += ["rescued"] * len(rescue)
    tries: list[Tried] = []
    try_of = np.full(n, -1, dtype=np.int64)
    row_of = np.zeros(n, dtype=np.int64)
    pick = np.full(n, -1, dtype=np.int64)
    errs = None
    if order:
        # every candidate's per-(segment, head) error and norm into one buffer, summed over
        # heads and brought to the host at once: one launch per candidate, then two
        per_row = torch.empty(len(order), 2, n * h, dtype=torch.float32, device=x.device)
        flat = {}  # x_rot / x as band_errors reads them, made once each
        for c, st in enumerate(order):
            src = x_rot if st.rot else x
            if id(src) not in flat:
                flat[id(src)] = src.reshape(n * h, s, d).to(
                    torch.float32, memory_format=torch.contiguous_format)
            band_errors(flat[id(src)], st.widths(d), out=(per_row[c, 0], per_row[c, 1]))
        both = per_row.view(len(order), 2, n, h).sum(3).cpu().numpy().astype(np.float64)
        errs = np.sqrt(both[:, 0]) / np.maximum(np.sqrt(both[:, 1]), 1e-12)
        fits = errs <= budget
        pick = np.where(fits.any(0), fits.argmax(0), -1)

    def encode(strat, why, rows, row_errs):
        m = len(rows)
        tensors, dec, src = _encode_rows(x, x_rot, strat, kind, rows, encode_kernel)
        if row_errs is None:
            row_errs = _errors(dec, src).cpu().numpy().astype(np.float64)
        tries.append(Tried(strat, why, tensors, m, row_errs, dec, rows))
        try_of[rows] = len(tries) - 1
        row_of[rows] = np.arange(m)

    for c, (strat, why) in enumerate(zip(order, whys)):
        rows = np.nonzero(pick == c)[0]
        if len(rows):
            encode(strat, why, rows, errs[c, rows])
    rest = np.nonzero(pick < 0)[0]
    if len(rest):  # no candidate met the budget: the fallback (dense), as in the cascade
        encode(fallback, "over-budget" if candidates else reason, rest, None)
    batch = ChoiceBatch(kind, (h, s, d), tries, try_of, row_of)
    decoded = batch.decoded() if need_decoded else None
    for t in tries:
        t.decoded = None
    return batch, decoded


@dataclass(eq=False)
class Tried:
    """One chooser try: a strategy encoded for `rows` segments (`segments`: which, in order)."""
    strategy: Strategy
    reason: str
    tensors: Tensors  # the strategy's tensors for all rows, first dim rows * H
    rows: int
    errors: np.ndarray  # float64 [rows], relative reconstruction error of each row
    decoded: torch.Tensor | None  # float32 [rows, H, S, D], dropped once the batch is made
    segments: np.ndarray  # int64 [rows]: the segment of each row

    def __post_init__(self):
        self.spec = self.strategy.spec
        # bytes of one row (a segment), from the tensors themselves: every tensor's first dim is
        # rows * H, and the sizes are the same for every row (no strategy's size depends on
        # the values)
        self.row_bytes = sum(t.numel() * t.element_size() for t in self.tensors.values()) \
            // max(self.rows, 1)
        self._views: list[Tensors] | None = None

    def views(self) -> list[Tensors]:
        """Per row its tensors as views ([H, ...] each), made once per try."""
        if self._views is None:
            h = None
            per_name = {}
            for name, t in self.tensors.items():
                h = t.shape[0] // self.rows
                per_name[name] = t.reshape(self.rows, h, *t.shape[1:]).unbind(0)
            self._views = [dict(zip(per_name, row)) for row in zip(*per_name.values())]
        return self._views

    def rows_of(self, name: str) -> torch.Tensor:
        """Tensor `name` as [rows, H, ...] (a view)."""
        t = self.tensors[name]
        return t.view(self.rows, t.shape[0] // self.rows, *t.shape[1:])


class ChoiceBatch(Sequence):
    """The chooser's picks for N segments of one kind: its tries (`Tried`) and per segment its
    try (`try_of`) and row in it (`row_of`). Indexing makes that segment's `Choice`."""

    def __init__(self, kind: str, shape: tuple[int, int, int], tries: list[Tried],
                 try_of: np.ndarray, row_of: np.ndarray):
        self.kind, self.shape, self.tries, self.try_of, self.row_of = \
            kind, shape, tries, try_of, row_of

    def __len__(self) -> int:
        return len(self.try_of)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        t, row = self.tries[self.try_of[i]], int(self.row_of[i])
        return Choice(t.strategy, Encoded(self.kind, self.shape, t.views()[row]),
                      float(t.errors[row]), t.reason)

    def column(self, of_strategy) -> np.ndarray:
        """int64 [N]: of_strategy(strategy) of every segment's try (computed once per try)."""
        return np.array([of_strategy(t.strategy) for t in self.tries],
                        dtype=np.int64)[self.try_of] if self.tries else np.zeros(0, np.int64)

    def row_bytes(self) -> np.ndarray:
        """int64 [N]: the bytes each segment's encoded tensors take."""
        return np.array([t.row_bytes for t in self.tries], dtype=np.int64)[self.try_of]

    def errors(self) -> np.ndarray:
        """float64 [N]: each segment's relative reconstruction error."""
        out = np.empty(len(self))
        for i, t in enumerate(self.tries):
            mine = self.try_of == i
            out[mine] = t.errors[self.row_of[mine]]
        return out

    def spec_reason(self, i: int) -> tuple[str, str]:
        t = self.tries[self.try_of[i]]
        return t.spec, t.reason

    def decoded(self) -> torch.Tensor:
        """The chosen reconstructions [N, H, S, D]: one copy per try."""
        if len(self.tries) == 1 and self.tries[0].rows == len(self):
            return self.tries[0].decoded  # rows in segment order: every segment picked it
        out = None
        for i, t in enumerate(self.tries):
            mine = np.nonzero(self.try_of == i)[0]
            if not len(mine):
                continue
            if out is None:
                out = t.decoded.new_empty((len(self), *t.decoded.shape[1:]))
            dev = t.decoded.device
            out[to_device_async(mine, dev)] = t.decoded[to_device_async(self.row_of[mine], dev)]
        return out


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
