"""Seal a group of full pages (all layers) into compressed segments: the one sealing routine.

The serving pool runs it inline (``daemon: off``, and backpressure seals) and the recompression
daemon's worker runs it on pages copied into shared memory, so both produce the same segments
from the same K/V. A group without bases fits them on its own pages (the first seal of a basis
block); later groups of the block reuse them. Torch only: no SGLang import (the worker is a bare
process).
"""
from __future__ import annotations

import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ..config import FIT_SOLVERS, MosaicConfig
from .basis import fit_with, resolve_fit_solver, unrotate, write_transform
from .layer import Candidates, Segment, SegmentBatch, seal_segments
from .pages import build_page_meta
from .strategies import Encoded, Strategy, parse_strategy
from .timing import phase
from .transfer import to_device_async

# page indices of a group -> its K and V, all layers, each [P, L, H, S, D] in the cache's dtype:
# one gather per group, read once for the basis fit and for the chooser
PageReader = Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class BasisPair:
    """K and V bases of one position block, per layer ([H, D, D] bf16 each). `whole`, when set,
    is the one [2L, H, D, D] tensor (K layers, then V layers) they are views of: a daemon slot
    takes the pair in one copy instead of a 64-input stack, and a result carries one tensor."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    whole: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # set on a block's pair that reuses another block's tensors (`inherit`): bytes are counted
    # once per `key()`, while each block keeps its own pair (a request's rows are its blocks)
    source: "BasisPair | None" = field(default=None, repr=False, compare=False)

    def inherit(self) -> "BasisPair":
        """A pair for another block that reads these same tensors (no copy)."""
        return BasisPair(self.k, self.v, self.whole, self.owner())

    def owner(self) -> "BasisPair":
        """The pair whose tensors these are (itself, or the block it inherited them from)."""
        return self.source or self

    def key(self) -> int:
        """Identity of the tensors (what byte accounting counts once)."""
        return id(self.owner())

    @classmethod
    def of(cls, whole: torch.Tensor) -> "BasisPair":
        views = whole.unbind(0)
        return cls(list(views[:len(views) // 2]), list(views[len(views) // 2:]), whole)

    def stacked(self) -> torch.Tensor:
        """[2L, H, D, D]: `whole`, or a new stack of the layers' bases."""
        return self.whole if self.whole is not None else torch.stack(self.k + self.v)

    def copy_to(self, device) -> "BasisPair":
        """A copy on `device` (one tensor): bases read in place from a daemon slot must leave it
        before the slot is reused."""
        return BasisPair.of(self.stacked().to(device, non_blocking=True, copy=True))

    def __reduce__(self):  # pickled (a daemon result) as the one tensor when there is one
        return (BasisPair, (self.k, self.v)) if self.whole is None else (BasisPair.of,
                                                                         (self.whole,))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class PageSegments(Sequence):
    """A sealed page's segments, one per layer, as (batch, index) references into the
    `SegmentBatch`es that sealed them: a `Segment` is made only when read, and the serving
    store installs the page from the batches' arrays (`SegmentStore.install_pages`)."""

    def __init__(self, refs: list[tuple[SegmentBatch, int]]):
        self.refs = refs

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[i] for i in range(len(self))[layer]]
        batch, i = self.refs[layer]
        return batch[i]

    def kinds(self) -> list[tuple[str, str, str]]:
        """(kind, strategy spec, chooser reason) of every layer's K and V (no segment made)."""
        return [kind for batch, i in self.refs for kind in batch.kinds(i)]

    def __reduce__(self):
        # pickled (a daemon result that is not arena-ready) as its Segments, not the batches:
        # a batch holds every try's tensors for all its segments
        return (list, (list(self),))


@dataclass
class SealedPage:
    position: int  # first token position in the request that sealed it
    segments: Sequence[Segment]  # one per layer (a list, or lazily made: PageSegments)
    bases: BasisPair
    nbytes: int = 0

    def kinds(self) -> list[tuple[str, str, str]]:
        """(kind, strategy spec, chooser reason) of every layer's K and V (pool counters)."""
        if hasattr(self.segments, "kinds"):  # lazily made segments know them without a Segment
            return self.segments.kinds()
        return [(kind, c.strategy.spec, c.reason) for seg in self.segments
                for kind, c in (("k", seg.k), ("v", seg.v))]


SEAL_BATCH = 256  # segments (page x layer) encoded per chooser call: bounds the transient memory


class HostSolvers(TorchFunctionMode):
    """Runs `fit_basis`'s dense solvers (eigh, qr) of device tensors on the CPU: one copy of their
    [N, D, D] input to the host and of the results back, the batch split over host threads with
    one intra-op thread each (LAPACK solves one matrix at a time, so the split equals one
    single-threaded call bit for bit; MKL's result depends on its thread count). cuSOLVER also
    solves one matrix per call (torch picks syevj for fp32 D in [32, 512]). fit_basis itself
    stays the one definition of a basis."""
    OPS = (torch.linalg.eigh, torch.linalg.qr)

    def __init__(self, threads: int):
        super().__init__()
        self.threads = threads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.OPS or args[0].device.type == "cpu":
            return func(*args, **kwargs)
        out = solve_split(func, args[0].cpu(), self.threads, *args[1:], **kwargs)
        return type(out)([t.to(args[0].device) for t in out])


def solve_split(func, x: torch.Tensor, threads: int, *args, **kwargs):
    """func(x) for a batched solver returning a tuple (eigh, qr), the batch split over threads,
    each with one intra-op thread (thread-local): LAPACK (MKL) would otherwise start its own
    threads in every part, threads x threads in all (measured on 2 cores: 196 ms for 256 eigh
    128x128 split over 2 threads, 84 ms with one intra-op thread each; docs/codec.md)."""
    parts = x.tensor_split(max(1, min(threads, x.shape[0])))

    def solve(part):
        torch.set_num_threads(1)
        return func(part, *args, **kwargs)

    with ThreadPoolExecutor(len(parts)) as pool:
        outs = list(pool.map(solve, parts))
    return type(outs[0])([torch.cat(ts) for ts in zip(*outs)])


def host_threads() -> int:
    """Host threads for HostSolvers: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def fit_bases(k: torch.Tensor, v: torch.Tensor, solver: str = "host", timer=None) -> BasisPair:
    """Bases of a basis block, fitted on the pages of its first sealed group: K and V
    [P, L, H, S, D] -> per layer [H, D, D]. `solver` (config `fit_solver`):

    * "host": one `fit_basis` call per kind fits the heads of several layers at once
      ([layers*H, P*S, D], as many layers as keep that within SEAL_BATCH segments), its solvers
      on the CPU over host threads (HostSolvers): a few transfers per block instead of cuSOLVER's
      per-matrix calls;
    * "device": cuSOLVER, one call per layer as before (cuSOLVER loops over matrices anyway,
      and the covariance GEMMs keep the batch shape, hence the bits, they had);
    * "jacobi": `jacobi_axes` (batched GEMMs) where the pages are, layers batched as for host;
    * "jacobi_tf32": the same, its rotation steps on TF32 tensor cores on a GPU;
    * "auto": jacobi for pages on a GPU, host for CPU pages (`resolve_fit_solver`);
    * "identity": no fit, identity bases (the no-rotation ablation).

    Every head is fitted alone, so on the CPU all of them equal fitting layer by layer, bit for
    bit (jacobi's batched GEMMs included: tests/test_seal_batch.py)."""
    if solver not in FIT_SOLVERS:
        raise ValueError(f"fit_bases: solver={solver!r}; choose one of {FIT_SOLVERS}")
    solver = resolve_fit_solver(solver, k.device)
    p, layers, h, s, d = k.shape
    step = 1 if solver == "device" else max(1, SEAL_BATCH // p)
    out = ([], [])
    with phase(timer, "fit_bases"):
        for x, bases in zip((k, v), out):
            for first in range(0, layers, step):
                part = x[:, first:first + step]
                n = part.shape[1]
                # contiguous, like the per-layer concatenation the fit always got
                flat = part.permute(1, 2, 0, 3, 4).reshape(n * h, p * s, d).contiguous()
                with HostSolvers(host_threads()) if solver == "host" else nullcontext():
                    b = fit_with(flat, solver)
                bases.extend(b.reshape(n, h, *b.shape[1:]).unbind(0))
    return BasisPair.of(torch.stack(out[0] + out[1]))


def fit_block_bases(k: torch.Tensor, v: torch.Tensor, solver: str = "host",
                    timer=None) -> BasisPair:
    """A basis block's bases, fitted on its first page alone: K and V [P, L, H, S, D] whose
    page 0 is the block's first page. Fitting on that one page (not on whatever pages happen to
    be sealed together) makes a sealed page a function of its own K/V and its block's first
    page only: the same whatever the chunking, batching or timing that sealed it, so a greedy
    request reads the same bytes alone or under load, and a prefix cached by another request
    holds exactly the pages the request would have sealed itself (docs/determinism.md; on real
    SmolLM2 KV the attention error was no worse than fitting on the whole block)."""
    return fit_bases(k[:1], v[:1], solver, timer)


def fit_groups(groups: list[tuple[torch.Tensor, torch.Tensor]], cfg: MosaicConfig,
               timer=None) -> list[BasisPair]:
    """Bases of several basis blocks, each fitted as `seal_group` fits it (`fit_block_bases` on
    its first page under basis_fit "first_page", else `fit_bases` on its pages): K and V
    [P_g, L, H, S, D] per group. Groups fitted on the same number of pages go through one
    `fit_bases` call, their layers side by side ([P, U * L, H, S, D]: every (layer, head) is
    still fitted alone on its own tokens), so a decode step whose requests each open a block
    fits them in a few solver calls, not one set per request."""
    if cfg.basis_fit == "first_page":
        groups = [(k[:1], v[:1]) for k, v in groups]
    out: list[BasisPair | None] = [None] * len(groups)
    by_pages: dict[int, list[int]] = {}
    for g, (k, _) in enumerate(groups):
        by_pages.setdefault(k.shape[0], []).append(g)
    for p, idx in by_pages.items():
        if len(idx) == 1:
            out[idx[0]] = fit_bases(*groups[idx[0]], cfg.fit_solver, timer)
            continue
        layers = groups[idx[0]][0].shape[1]
        k = torch.cat([groups[g][0] for g in idx], 1)  # [P, U * L, H, S, D]
        v = torch.cat([groups[g][1] for g in idx], 1)
        both = fit_bases(k, v, cfg.fit_solver, timer)
        for u, g in enumerate(idx):
            part = slice(u * layers, (u + 1) * layers)
            out[g] = BasisPair.of(torch.stack(both.k[part] + both.v[part]))
    return out


def gather_pages(k_buffer: list[torch.Tensor], v_buffer: list[torch.Tensor],
                 pages: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A `PageReader`'s read of a dense cache (one [rows, H, D] tensor per layer, pages of
    `page_size` rows; `pages` the page numbers in it) -> K and V [P, L, H, S, D], one gather per
    layer and kind."""
    rows = (pages.long()[:, None] * page_size + torch.arange(page_size)).flatten()
    rows = to_device_async(rows, k_buffer[0].device)
    out = []
    for buf in (k_buffer, v_buffer):
        x = torch.stack([layer[rows] for layer in buf])  # [L, P*S, H, D]
        out.append(x.view(len(buf), len(pages), page_size, *x.shape[2:]).permute(1, 0, 3, 2, 4))
    return out[0], out[1]


def page_kv(k_buffer: list[torch.Tensor], v_buffer: list[torch.Tensor], page: int,
            page_size: int) -> torch.Tensor:
    """One page of a dense cache (layout as `gather_pages`), every layer's K and V, as one
    contiguous [L, 2, H, S, D] tensor on the cache's device: the page's rows are a slice of each
    layer, so this is one stack and one transpose (what a daemon slot copy needs in one copy)."""
    rows = slice(page * page_size, (page + 1) * page_size)
    kv = torch.stack([buf[rows] for pair in zip(k_buffer, v_buffer) for buf in pair])
    return kv.view(len(k_buffer), 2, *kv.shape[1:]).transpose(2, 3).contiguous()


def seal_group(read: PageReader, positions: list[int], bases: BasisPair | None,
               cfg: MosaicConfig, cands: Candidates, dense: Strategy,
               timer=None, keep_rotated: bool = False,
               cache: "WriteTransformCache | None" = None) -> list[SealedPage]:
    """Pages of one basis block (positions in request order) read in one gather; bases fitted
    here if None, on the first page only (`fit_block_bases`: the group then starts with its
    block's first page). `keep_rotated`, `cache`: see `seal_pages`."""
    with phase(timer, "read"):
        k, v = read(list(range(len(positions))))
    if bases is None:
        bases = (fit_block_bases(k, v, cfg.fit_solver, timer) if cfg.basis_fit == "first_page"
                 else fit_bases(k, v, cfg.fit_solver, timer))
    return seal_pages(k, v, positions, bases, cfg, cands, dense, timer, keep_rotated,
                      cache=cache)


def write_transforms(bases: BasisPair) -> tuple[torch.Tensor, torch.Tensor]:
    """The bases' write transforms (R^-1 fp32, [L, H, D, D] for K and V): computed once per call
    of `seal_pages`, or once per daemon job, instead of once per (page, layer) segment (the
    inverses were 54% of sealing a Llama-8B page on one CPU core)."""
    return write_transforms_of([bases])[0]


def write_transforms_of(blocks: Sequence[BasisPair]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`write_transforms` of several blocks' bases in one batched inversion: one launch (and,
    on a GPU, the one host sync of `torch.linalg.inv`'s error check) for a decode step that
    seals a page of each of N requests, instead of 2N. Each block's K and V transforms are
    views of one [2U, L, H, D, D] tensor (K blocks first). Each matrix is inverted on its own
    (LU per matrix): the same values as one at a time (tests/test_seal_batch.py)."""
    inv = _inverses(blocks)
    return [(inv[u], inv[len(blocks) + u]) for u in range(len(blocks))]


def _inverses(blocks: Sequence[BasisPair]) -> torch.Tensor:
    """R^-1 fp32 of every block's K bases, then of every block's V bases: [2U, L, H, D, D]."""
    layers = len(blocks[0].k)

    def part(b: BasisPair, kind: int) -> torch.Tensor:
        if b.whole is not None:
            return b.whole[kind * layers:(kind + 1) * layers]
        return torch.stack(b.v if kind else b.k)

    return write_transform(torch.stack([part(b, kind) for kind in (0, 1) for b in blocks]))


class WriteTransformCache:
    """Write transforms (R^-1, fp32 [L, H, D, D] for K and V) of the basis blocks still being
    sealed, kept between `seal_pages` calls. A decode step seals one page of each running
    request's open block, so without it a block's bases are inverted once per page sealed
    (32 times for a 4096-token block of 128-token pages; on the CPU the inverses were 21% of a
    decode seal step at the Llama-8B shape, 40% at small heads). The values are those
    `write_transforms` computes (the same call, kept). Bounded by `max_bytes`: a block that
    does not fit is inverted each time (counted: `uncached`), nothing is evicted to make room
    (a batch of requests sealing in turn would evict each other's). An entry leaves when its
    bases are collected (a weak reference) or when the caller `drop`s it (the pool: a block
    whose last page is sealed). `bytes` is what it holds now (reported in the pool's stats)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: dict[int, tuple] = {}  # id(owner) -> (weakref, K, V, bytes)
        self.bytes = 0
        self.hits = self.misses = self.uncached = 0

    def tables(self, blocks: Sequence[BasisPair]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each block's (K, V) write transforms: kept ones, the others from one batched
        inversion (`write_transforms_of`), kept if they fit."""
        out: list = [None] * len(blocks)
        missing = []
        for i, b in enumerate(blocks):
            e = self._live(b)
            if e is not None:
                out[i] = (e[1], e[2])
                self.hits += 1
            else:
                missing.append(i)
        if missing:
            got = write_transforms_of([blocks[i] for i in missing])
            self.misses += len(missing)
            for i, (kt, vt) in zip(missing, got):
                out[i] = (kt, vt)
                nb = 2 * kt.numel() * kt.element_size()
                if self.bytes + nb > self.max_bytes:
                    self.uncached += 1
                    continue
                if len(missing) > 1:  # views of the batch's inverse: own memory for the kept
                    kt, vt = kt.clone(), vt.clone()
                    out[i] = (kt, vt)
                self._keep(blocks[i].owner(), kt, vt, nb)
        return out

    def _live(self, bases: BasisPair) -> tuple | None:
        """The entry of `bases`' tensors, if one is kept for these very bases (an id of
        collected bases may have been reused)."""
        owner = bases.owner()
        e = self._entries.get(id(owner))
        return e if e is not None and e[0]() is owner else None

    def _keep(self, owner: BasisPair, kt, vt, nb: int) -> None:
        key = id(owner)
        self._drop_key(key)
        ref = weakref.ref(owner, lambda r, key=key: self._drop_key(key, r))
        self._entries[key] = (ref, kt, vt, nb)
        self.bytes += nb

    def drop(self, bases: BasisPair | None) -> None:
        """Forget `bases`' transforms (its block takes no more pages)."""
        if bases is not None and self._live(bases) is not None:
            self._drop_key(bases.key())

    def _drop_key(self, key: int, ref=None) -> None:
        e = self._entries.get(key)
        if e is not None and (ref is None or e[0] is ref):
            del self._entries[key]
            self.bytes -= e[3]

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        return {"blocks": len(self), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "uncached": self.uncached}


def seal_pages(k: torch.Tensor, v: torch.Tensor, positions: list[int],
               bases: BasisPair | Sequence[BasisPair], cfg: MosaicConfig, cands: Candidates,
               dense: Strategy, timer=None, keep_rotated: bool = False,
               write: tuple[torch.Tensor, torch.Tensor] | None = None,
               cache: WriteTransformCache | None = None,
               keep_decoded: bool = False) -> list[SealedPage]:
    """Pages K and V [P, L, H, S, D] -> SealedPages, the (page, layer) segments batched through
    the chooser (`seal_segments`) SEAL_BATCH at a time, sink pages apart. `bases`: one
    BasisPair all pages share, or one per page (pages of several basis blocks, e.g. one page of
    each request a decode step seals: one chooser batch and one install for all of them
    instead of one per block; each segment is rotated by its own page's bases, so a page gets
    the bytes it gets sealed alone). `keep_rotated` keeps each segment's rotated K/V for the
    store's pack kernel (all batches' rotated float32 K/V stay alive until the pages are
    installed). `write`: the bases' `write_transforms` when the caller seals more pages of one
    block one call at a time (one shared BasisPair only); `cache`: where the blocks' write
    transforms are kept between calls (else all are computed here, in one inversion).
    `keep_decoded`: each batch keeps its chosen reconstructions (`seal_segments`)."""
    layers = k.shape[1]
    per_page = not isinstance(bases, BasisPair)
    if per_page and len(bases) != len(positions):
        raise ValueError(f"seal_pages: {len(bases)} BasisPairs for {len(positions)} pages")
    if per_page and write is not None:
        raise ValueError("seal_pages: `write` goes with one shared BasisPair, not per-page bases")
    uniq = list({id(b): b for b in bases}.values()) if per_page else [bases]
    with phase(timer, "choose_encode"):
        if write is not None:
            tables = [write]
        elif cache is not None:
            tables = cache.tables(uniq)
        else:  # one inversion for every block
            tables = write_transforms_of(uniq)
    # per page: the row of its bases in `tables`
    row_of = {id(b): u for u, b in enumerate(uniq)}
    which = [row_of[id(pb)] for pb in bases] if per_page else [0] * len(positions)
    refs = {}  # (page, layer) -> (its SegmentBatch, index in it)
    nbytes = np.zeros(len(positions), dtype=np.int64)
    for sink in (True, False):
        todo = [(j, local) for j, pos in enumerate(positions)
                if (pos // cfg.segment_tokens < cfg.sink_segments) == sink
                for local in range(layers)]
        for c in range(0, len(todo), SEAL_BATCH):
            part = todo[c:c + SEAL_BATCH]
            with phase(timer, "gather"):
                kk, vv, transforms = _batch(k, v, tables, which, part)
            sealed = seal_segments(kk, vv, None, None, 0, [positions[j] for j, _ in part], cfg,
                                   cands, sink, cfg.select.enabled, dense, timer, keep_rotated,
                                   write=transforms, keep_decoded=keep_decoded)
            refs.update(zip(part, ((sealed, i) for i in range(len(part)))))
            np.add.at(nbytes, [j for j, _ in part], sealed.segment_nbytes())
    with phase(timer, "bookkeeping"):
        pages = [SealedPage(pos, PageSegments([refs[(j, local)] for local in range(layers)]),
                            uniq[which[j]], int(nbytes[j])) for j, pos in enumerate(positions)]
    return pages


def _batch(k: torch.Tensor, v: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]],
           which: list[int], part: list[tuple[int, int]]):
    """The chooser's input for `part` ((page, layer) pairs, page-major): K and V as contiguous
    float32 [N, H, S, D] (the layout the chooser's kernels always saw) and the write transforms
    (`tables`: per basis block its [L, H, D, D] K and V transforms; `which`: per page its
    block). Whole consecutive pages of one block (a daemon job's page, or 8 pages of 32 layers)
    are a slice converted in one pass, and their transforms stay the per-layer tensors, which
    `seal_segments` broadcasts over the pages: no gathered copy of a basis per segment (those
    copies and the index gather were 14% of sealing a Llama-8B page on one core). Other parts
    gather one transform per segment (the same matrices: per segment the same product)."""
    layers = k.shape[1]
    first, pages = part[0][0], len(part) // layers
    whole = part == [(first + i, local) for i in range(pages) for local in range(layers)]
    if whole:
        kk, vv = (x[first:first + pages].to(torch.float32, memory_format=torch.contiguous_format)
                  .flatten(0, 1) for x in (k, v))
        if len({which[j] for j, _ in part}) == 1:
            return kk, vv, tables[which[first]]
    else:
        pj = to_device_async(torch.tensor([j for j, _ in part]), k.device)
        pl = to_device_async(torch.tensor([local for _, local in part]), k.device)
        kk, vv = (x[pj, pl].to(torch.float32, memory_format=torch.contiguous_format)
                  for x in (k, v))
    # one transform per segment, stacked (one copy): whole pages as their blocks' [L, ...]
    # tables, a part cut inside pages segment by segment
    if whole:
        at = [which[first + i] for i in range(pages)]
        return kk, vv, tuple(torch.stack([tables[b][kind] for b in at]).flatten(0, 1)
                             for kind in (0, 1))
    return kk, vv, tuple(torch.stack([tables[which[j]][kind][local] for j, local in part])
                         for kind in (0, 1))


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


def decoded_segment(seg, k_basis: torch.Tensor, v_basis: torch.Tensor):
    """One sealed segment's K and V as they read back, float32 [H, S, D] in the raw basis."""
    k = seg.k.strategy.decode(seg.k.encoded)
    v = seg.v.strategy.decode(seg.v.encoded)
    return (unrotate(k, k_basis) if seg.k.strategy.rot else k,
            unrotate(v, v_basis) if seg.v.strategy.rot else v)


def read_back_block(refs: list, k_basis: torch.Tensor, v_basis: torch.Tensor, dtype: torch.dtype):
    """Segments of one basis block just sealed (`refs`: (SegmentBatch, index), each batch
    sealed with `keep_decoded`) as they read back: K and V [n, S, H, D] in `dtype` (raw basis),
    from the chooser's reconstructions, each rotated one unrotated by the block's bases, in a
    few launches for all n (`decoded_segment` per segment: ~70 launches each). The same bits
    as `decoded_segment` of each on the CPU (its decode rebuilds the same codes the same way;
    the unrotation is the same per-head product, batched: tests/test_read_rule.py). The pool's
    prefill reads a chunk's own pages so; `seal_bench.py --chunk-layers` times both."""
    out = []
    for kind, basis in ((0, k_basis), (1, v_basis)):
        rows = torch.stack([batch.decoded[kind][i] for batch, i in refs])  # [n, H, S, D]
        choices = [batch.v if kind else batch.k for batch, _ in refs]  # ChoiceBatch per ref
        rot = torch.tensor([bool(c.tries[c.try_of[i]].strategy.rot)
                            for c, (_, i) in zip(choices, refs)])
        back = rows
        if bool(rot.any()):
            turned = rows @ basis.float()  # [n, H, S, D] @ [H, D, D]: unrotate's product
            back = turned if bool(rot.all()) else torch.where(
                rot.to(rows.device)[:, None, None, None], turned, rows)
        out.append(back.transpose(1, 2).to(dtype))
    return out
