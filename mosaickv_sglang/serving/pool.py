"""MosaicKV token-to-KV pool: logical slots, a dense hot buffer, and sealed compressed pages.

SGLang hands out *logical* slot ids (page-aligned, ``page_size == segment_tokens``), writes K/V
through ``set_kv_buffer`` and keeps slot ids in ``req_to_token`` and in the radix tree. This pool
keeps two physical stores behind those ids:

* the hot buffer: the dense ``k_buffer``/``v_buffer`` of the parent ``MHATokenToKVPool``, sized
  to ``hot_buffer_fraction`` of the logical capacity; a logical page gets a hot page when it is
  first written and gives it back when it is sealed;
* sealed pages: each full page, once it is ``hot_tokens`` behind its request's last token, is
  compressed by the codec (strategy chosen per layer, K and V independently) and becomes an
  immutable ``Segment`` per layer. A page shared through the radix tree is one logical page, so
  a shared prefix is compressed once and stored once.

Page 0 of a request's positions is its sink page. Bases are per (request position block of
``basis_block_tokens``): the first seal in a block fits them, later pages of that block (also
other requests reusing the prefix) reuse them. Every byte kept is counted by ``stats()``.

Sealing runs inline (``daemon: off``) or in the recompression daemon (``daemon: process``,
``daemon/``): a submitted page stays hot, and is read hot, until its result is adopted between
scheduler steps (``adopt``). ``_install`` is the only way into ``sealed``; ``release_pages`` and
``clear`` the only ways out. A logical page carries a generation, bumped when it is freed, so a
result for a page that was freed (and maybe reused) meanwhile is discarded, never installed.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from ..codec.arena import ArenaPage, pack_page
from ..codec.attention import PageReads
from ..codec.basis import unrotate
from ..codec.cold import cold_candidates, recompress_page
from ..codec.layer import Candidates, CompressedLayer, own_storage, segment_bytes
from ..codec.pages import build_page_meta
from ..codec.seal import (BasisPair, PageSegments, SealedPage, WriteTransformCache, decoded_segment,
                         fit_bases, fit_block_bases, fit_groups, gather_pages, seal_group, seal_pages,
                         read_back_block, worst_page_bytes)
from ..codec.strategies import parse_strategy
from ..codec.timing import StepProfiler
from ..config import MosaicConfig, check_fits, fit_rescue
from ..daemon.swaplog import SwapLog
from .segment_store import SegmentStore
from .sizing import PageBytes, byte_deficit, in_flight_pages, plan_memory, window_tokens

logger = logging.getLogger(__name__)


__all__ = ["BasisPair", "MosaicKVPool", "SealedPage"]


# A prefill forward's layer-by-layer seal keeps each layer's rotated K/V (float32, 8 bytes per
# K+V element) for the store's pack kernel until its pages install after the last layer: 2.1 GB
# for an 8K chunk of Llama-8B, 8.6 GB for 32K (out of memory at the largest 32K batch with 32K
# chunks, H100 2026-12-07, h100_2026-12-07c_prefill_batched/). Layers past this budget keep none
# and install by torch copies, the same bytes (tests/test_pack_install.py), ~0.025 ms more per
# segment (RESULTS.md, sealing: install 0.031 vs 0.006 ms), counted in
# segment_store.packed_by.no_rotated.
CHUNK_ROTATED_BYTES = 1 << 30


@dataclass
class ChunkSeal:
    """Pages one prefill forward seals layer by layer (`MosaicKVPool.plan_chunk_seal`): tokens
    of the chunk read them compressed, so each layer's segments are made right after that
    layer's K/V is written and before its attention; the pages are installed after the last
    layer. Segments and fitted bases accumulate here, layer by layer."""
    pages: list[int]  # logical pages, grouped by basis block, each group in position order
    positions: list[int]  # first token position of each page in its request
    groups: list[tuple[list[int], BasisPair | None]]  # (indices into pages, the block's bases
    # when its first page is sealed already; None: fitted here on the group's first page)
    # per page: one (SegmentBatch, index) per layer sealed so far (`PageSegments` refs)
    segments: list[list] = field(default_factory=list)
    fitted: list[tuple[list, list]] = field(default_factory=list)  # per group: K, V bases/layer
    rotated_bytes: int = 0  # the rotated K/V its layers keep for the pack kernel until install

    def __post_init__(self):
        self.segments = [[] for _ in self.pages]
        self.fitted = [([], []) for _ in self.groups]

    def add_group(self, pages: list[int], positions: list[int], bases: BasisPair | None,
                  segments: list[list] | None = None, fitted: tuple | None = None) -> None:
        """One basis block's `pages` (position order) appended as a group, with what was
        sealed of them so far (`segments` per page, `fitted` bases: none by default)."""
        self.groups.append((list(range(len(self.pages), len(self.pages) + len(pages))), bases))
        self.pages += pages
        self.positions += positions
        self.segments += segments if segments is not None else [[] for _ in pages]
        self.fitted.append(fitted if fitted is not None else ([], []))

    def without(self, drop: set) -> "ChunkSeal | None":
        """This seal less every group holding a page of `drop` (freed pages), with what the
        kept groups sealed so far; None when no group is left."""
        out = ChunkSeal([], [], [])
        for g, (idx, bases) in enumerate(self.groups):
            if not any(self.pages[j] in drop for j in idx):
                out.add_group([self.pages[j] for j in idx], [self.positions[j] for j in idx],
                              bases, [self.segments[j] for j in idx], self.fitted[g])
        out.rotated_bytes = self.rotated_bytes  # (an upper bound for what the kept groups keep)
        return out if out.pages else None


@dataclass(eq=False)
class DecodeSeal:
    """Pages one decode step made sealable (one request's, `decode_seal_layers` > 0), sealed
    that many layers per decode step (`MosaicKVPool.advance_decode_seals`) and installed after
    their last layer; read dense from the hot buffer until then, as the chunk rule reads any
    page not sealed yet. Compared by identity (the pool indexes its pages by it)."""
    seal: ChunkSeal
    next_layer: int = 0  # the first layer not sealed yet


@dataclass
class PoolCounters:
    sealed_pages: int = 0
    reused_pages: int = 0  # sealed pages handed to requests by a radix-tree prefix match
    freed_pages: int = 0
    over_budget: int = 0  # segment kinds kept dense because no candidate met the budget
    rescued: int = 0  # segment kinds no candidate fitted, kept by a rescue candidate instead
    arena_over_budget: int = 0  # seals that left the packed bytes above the start-up sizing
    # reads that found a request's sealed pages not a prefix and sealed the pages before them
    # inline (seal_prefix_now), and the pages that took
    prefix_repairs: int = 0
    prefix_repair_pages: int = 0
    # reads that found a request's basis block holding pages of two blocks' bases (the same
    # swap, ending inside a block) and moved them to the block's bases (`rebase_blocks`): pages
    # re-pointed (equal bases, bytes unchanged) and pages re-sealed under the block's bases
    basis_rebases: int = 0
    basis_aliased_pages: int = 0
    basis_resealed_pages: int = 0
    # pages sealed inside a prefill forward, layer by layer, because later tokens of the same
    # chunk read them compressed (the read rule, docs/determinism.md)
    chunk_sealed_pages: int = 0
    # step boundaries at which the byte gate started limiting admission (refresh_byte_gate)
    byte_limited: int = 0
    # cold pages (recompress_cold): re-encoded cheaper, left as they were (no cold candidate
    # fitted), and the packed bytes that saved
    cold_pages: int = 0
    cold_kept: int = 0
    cold_saved_bytes: int = 0
    # reads that found pages sealed that the read rule wants dense (only possible with a
    # window > 0: a page another request sealed inside it, e.g. a prefix cached by a request
    # whose prompt length is not known): read compressed, counted
    early_sealed_reads: int = 0
    # position rule with a window (prompt_split): request lookups that found no prompt length
    # recorded (`set_prompt_len`); those reads took the window for every page
    prompt_len_unknown: int = 0
    # decode_seal_layers > 0: (page, layer) segments sealed a slice at a time between decode
    # steps, pages installed that way, and pages whose remaining layers were sealed at once
    # because they were needed whole (hot-buffer pressure, a finished request, a prefill or
    # prefix repair reaching them)
    decode_seal_slices: int = 0
    decode_sealed_pages: int = 0
    decode_seals_forced: int = 0
    # basis blocks opened by a group of fewer than basis_inherit_below_tokens tokens that took
    # the request's previous block's bases instead of a fit
    inherited_bases: int = 0
    # `batched_seals`: inline seals of several groups (requests or basis blocks) sealed in one
    # batch, and the groups they held
    seal_batches: int = 0
    seal_batch_groups: int = 0
    strategies: dict = field(default_factory=dict)
    # Per page position in its request (index i: tokens [i*page, (i+1)*page)): pages sealed there
    # and sealed pages handed out there by prefix matches. A prefix shared by N requests shows one
    # seal and N reuses per position; a prefix each request recomputes shows N seals.
    sealed_by_position: list = field(default_factory=list)
    reused_by_position: list = field(default_factory=list)


def upload_changed_span(now: np.ndarray, uploaded: np.ndarray, dev: torch.Tensor) -> None:
    """Bring `dev` (the device copy of host array `now`) up to date: one copy of the span of
    entries that differ from `uploaded` (what `dev` holds), which is then updated. None on most
    steps; a whole-table copy was 84 KB a step at 1.3M tokens."""
    changed = np.flatnonzero(now != uploaded)
    if changed.size:
        lo, hi = int(changed[0]), int(changed[-1]) + 1
        dev[lo:hi].copy_(torch.from_numpy(now[lo:hi]))
        uploaded[lo:hi] = now[lo:hi]


def _bump(counts: list, index: int) -> None:
    counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += 1


def hot_buffer_requests(hot_tokens: int, page_size: int, chunked_prefill_size: int | None,
                        context_len: int, hot_buffer_fraction: float,
                        window_tokens: int = 0) -> int:
    """How many requests may run at once beside one prefill chunk in the hot buffer. A chunk's
    pages (at most context - 1 prompt tokens, whole pages: chunks and prefix matches are page
    aligned) are all hot until its forward ends (its full pages are sealed after it), and every
    other running request keeps its last, partial page hot: the buffer must hold one chunk plus
    one page per other request, or a forward stops the server with the buffer exhausted (seen
    on the H200 with SGLang's default 32768-token chunk and a 32768-token buffer at 3 requests).
    The read rule's dense window (`window_tokens`: hot_tokens, + daemon_lag_tokens with the
    daemon) keeps up to ceil(window / page) more full pages hot per request, the chunk's
    included: the window is what a request reads, so it is sized here, never taken back under
    pressure. Refuses (ValueError) a buffer that cannot hold one chunk."""
    need, extra = in_flight_pages(page_size, chunked_prefill_size, context_len, window_tokens)
    if hot_tokens < need * page_size:
        raise ValueError(
            f"MosaicKV: the hot buffer holds {hot_tokens} tokens (hot_buffer_fraction="
            f"{hot_buffer_fraction} of the token slots) but one prefill chunk needs "
            f"{need * page_size} (--chunked-prefill-size {chunked_prefill_size}, context "
            f"{context_len}): raise hot_buffer_fraction to >= "
            f"{hot_buffer_fraction * need * page_size / max(hot_tokens, 1):.3f} in "
            "--mosaickv-config or lower --chunked-prefill-size")
    return (hot_tokens // page_size - need) // (1 + extra) + 1


def cap_running_requests(fit: int, derived: int, requested: int | None, page_size: int,
                         hot_buffer_fraction: float) -> int:
    """The scheduler's max running requests for a MosaicKV pool whose hot buffer carries `fit`
    (`hot_buffer_requests`): SGLang's `derived` value lowered to `fit` (logged), or a clear
    start-up error when the user asked for more with --max-running-requests (`requested`)."""
    if derived <= fit:
        return derived
    if requested is not None and requested > fit:
        raise ValueError(
            f"MosaicKV: --max-running-requests {requested} does not fit the hot buffer, which "
            f"holds one prefill chunk plus the last page (and the read rule's dense window) of "
            f"{fit - 1} other running requests "
            f"({page_size}-token pages): lower --max-running-requests to <= {fit}, lower "
            f"--chunked-prefill-size by {(requested - fit) * page_size} tokens, or raise "
            f"hot_buffer_fraction (now {hot_buffer_fraction}) in --mosaickv-config")
    logger.warning("MosaicKV: max running requests lowered from %d to %d: the hot buffer holds "
                   "one prefill chunk plus the last page (and the read rule's dense window) of "
                   "each other running request (raise hot_buffer_fraction or lower "
                   "--chunked-prefill-size for more)", derived, fit)
    return fit


class MosaicKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` whose dense buffers are only the hot buffer (see module doc)."""

    @staticmethod
    def hot_pages_for(size: int, page_size: int, hot_buffer_fraction: float) -> int:
        return max(2, int((size // page_size + 1) * hot_buffer_fraction))

    def __init__(self, size: int, page_size: int, *args, mosaic_config: MosaicConfig,
                 hot_tokens: int | None = None, memory_bytes: int | None = None, **kwargs):
        """`size` logical token slots. The server (integration/wiring.py) passes `hot_tokens`
        (`sizing.auto_hot_tokens` by default) and the `memory_bytes` SGLang gave the cache,
        which `sizing.plan_memory` splits. Built directly without them, the hot buffer is
        `hot_buffer_fraction` of the slots (0: all of them) and every slot may be sealed at the
        largest layout (the arena never limits admission)."""
        if page_size != mosaic_config.segment_tokens:
            raise ValueError(f"MosaicKV needs --page-size {mosaic_config.segment_tokens} "
                             f"(= segment_tokens), got {page_size}")
        self.logical_size = size
        self.num_logical_pages = size // page_size + 1
        if hot_tokens is not None:
            hot_pages = max(2, -(-hot_tokens // page_size))
        elif mosaic_config.hot_buffer_fraction > 0:
            hot_pages = self.hot_pages_for(size, page_size, mosaic_config.hot_buffer_fraction)
        else:
            hot_pages = self.num_logical_pages
        super().__init__(hot_pages * page_size, page_size, *args, **kwargs)
        self.cfg = mosaic_config = fit_rescue(mosaic_config, self.head_dim)
        self.num_hot_pages = hot_pages
        # logical page -> hot page (-1: none). Hot page 0 is the parent's padding page, and
        # logical page 0 (never handed out by the allocator) maps to it: the padded rows of a
        # CUDA-graph batch write slot 0, which must not take a real hot page.
        self.hot_page_of = torch.full((self.num_logical_pages + 1,), -1, dtype=torch.long)
        self.hot_page_of[0] = 0
        self.free_hot_pages = list(range(hot_pages, 0, -1))
        self.sealed: dict[int, SealedPage] = {}
        # The page table's host side, kept with `sealed` (install, release, clear): per logical
        # page whether it is sealed and its basis block (the id of its BasisPair, alive while
        # the page is). A step's plan reads these for every page of every request, vectorized.
        self.page_sealed = np.zeros(self.num_logical_pages + 1, dtype=bool)
        self.page_basis = np.zeros(self.num_logical_pages + 1, dtype=np.int64)
        # and the device address of each sealed page's bases (BasisPair.whole: alive while the
        # page is sealed), for tables built on the device (graph_decode.DevicePageTable); False
        # once a page's bases had no single tensor (then the host builds every table)
        self.page_basis_addr = np.zeros(self.num_logical_pages + 1, dtype=np.int64)
        self.basis_addr_ok = True
        self.counters = PoolCounters()
        # Bumped by every change of the page table (a page sealed, freed, given a hot page or
        # losing one, a clear): a decode step may skip its host work only while it has not
        # moved since the last step that did it (`GraphDecode.can_skip_host`).
        self.version = 0
        check_fits(mosaic_config, self.head_dim, page_size)
        # Memory (serving/sizing.py): per-layer arenas from the plan of the memory SGLang gave;
        # or, built directly, room for every slot at the largest layout.
        self.page_bytes = PageBytes.of(mosaic_config, self.head_num, self.head_dim,
                                       self.dtype.itemsize)
        if memory_bytes is not None:
            self.memory_plan = plan_memory(mosaic_config, self.page_bytes, size, self.layer_num,
                                           page_size, hot_pages * page_size, memory_bytes)
            arena_per_layer = self.memory_plan.arena_bytes
        else:
            self.memory_plan = None
            arena_per_layer = self.num_logical_pages * self.page_bytes.worst
        # what the plan gives sealed pages (`arena_bytes` counts blocks, bases, headers, page
        # metadata): the arenas + the bases reserve + the per-page tables
        pb, pages = self.page_bytes, self.num_logical_pages
        # The bases' part of it: one bases pair per basis_block_tokens of sealed tokens. A pair
        # costs the same whatever its block holds, so a short request, or a prompt's partial last
        # block, holds a whole pair for a few pages: under short-request traffic the bases go
        # past this reserve while the arena still backs the pages (they are not in the arena;
        # the byte gate takes the excess from the arena's free bytes, `bases_over_reserve`).
        # `bases_bytes`: the distinct bases the sealed pages use now.
        self.bases_reserve_bytes = self.memory_plan.bases_bytes if self.memory_plan else \
            int(pages * pb.bases * self.layer_num)
        self.arena_budget_bytes = arena_per_layer * self.layer_num + self.bases_reserve_bytes + (
            self.memory_plan.table_bytes if self.memory_plan
            else int(pages * pb.table * self.layer_num))
        # The byte gate: free slots the arena cannot back, refreshed between steps
        # (`refresh_byte_gate`) and subtracted from the allocator's available_size.
        self.byte_deficit = 0
        self._gate_version = -1
        self.arena_bytes = 0
        self.bases_bytes = 0
        self._basis_refs: dict[int, int] = {}
        self.cands = Candidates.from_config(mosaic_config)
        # R^-1 of the blocks still taking pages, kept between seals (dropped with a block's
        # last page, or when its bases are freed)
        self.write_cache = WriteTransformCache(mosaic_config.write_transform_cache_mb << 20)
        # Dense fallback in the cache's own precision, so "dense" is lossless for fp32 caches too.
        self.dense = parse_strategy("dense:val=fp32" if self.dtype == torch.float32 else "dense")
        self.decode_path = None  # the backend's PackedDecode when decode runs on the kernels
        # pages the torch reference decode could read and read (every request on a CPU server,
        # the kernel path's unreadable requests on a GPU): selection's read fraction there
        self.reference_reads = PageReads()
        # set by the attention backend: {"kernel": its prefill attention, "calls": n}
        self.prefill_attention = {"kernel": None, "calls": 0}
        # Every prefill (extend) step timed by phase when decode steps are (decode_profile_every):
        # they are few and long, so the syncs cost little; stats()["prefill"]["profile"].
        self.prefill_timer = StepProfiler(1 if mosaic_config.decode_profile_every else 0,
                                          self.device)
        self._write_map: tuple = (None, None)  # (slots of this forward, their hot-buffer rows)
        self._table_map: tuple = (None, None)  # the same, mapped on the device (write_by_table)
        # The hot-page table on the device (a view of hot_page_of on a CPU pool), refreshed by
        # prepare_writes before each forward: a decode graph's writes map through it.
        self.hot_page_dev = self.hot_page_of if torch.device(self.device).type == "cpu" else \
            self.hot_page_of.to(self.device)
        # what hot_page_dev holds (host copy): each refresh uploads the changed span only
        self._hot_uploaded = self.hot_page_of.numpy().copy()
        self.store = SegmentStore(self.layer_num, self.num_logical_pages, self.head_num,
                                  self.head_dim, page_size, mosaic_config.page_tokens,
                                  self.device, mosaic_config.select.meta_channels
                                  if mosaic_config.select.enabled else None,
                                  arena_per_layer, mosaic_config.pack_kernel,
                                  self.page_bytes.worst, mosaic_config.arena == "shared")
        # daemon state: page generations, pages submitted (page -> job; None: deferred), pages
        # waiting for the bases their block's first page is getting (first -> (pos, page, gen))
        self.page_gen = [0] * (self.num_logical_pages + 1)
        self.pending: dict[int, object] = {}
        self.deferred: dict[int, list[tuple[int, int, int]]] = {}
        # page -> the page before it in its request: readers need a request's sealed pages to be
        # a prefix, so a daemon job installs only after the pages before its own (installable)
        self.prev_page: dict[int, int] = {}
        # sealed pages whose hot copy is kept: installed from the daemon before the read rule
        # reads them compressed (freed by _drop_kept_hot, release_pages, clear)
        self.kept_hot: set[int] = set()
        # cold recompression (cfg.cold): sealed pages in seal order with their generation, and
        # the pages already recompressed (or found with nothing cheaper); both left on free
        self._cold_queue: deque[tuple[int, int]] = deque()
        self.cold_done: set[int] = set()
        self._cold_cands = cold_candidates(mosaic_config) if mosaic_config.cold.enabled \
            else None
        self.daemon = self._start_daemon() if mosaic_config.daemon == "process" else None
        # the read rule (docs/determinism.md): "position" or "chunk"; its window
        # (compressed_pages): hot_tokens, plus the daemon's slack under the position rule
        self.position_rule = mosaic_config.read_rule == "position"
        self.dense_window = window_tokens(mosaic_config)
        # the window is anchored at the prompt's end for prompt tokens and slides for generated
        # ones (compressed_pages): each request's prompt length (req_pool_idx -> tokens,
        # `set_prompt_len`), looked up where it can change a read
        self.prompt_split = self.position_rule and self.dense_window > 0
        self.prompt_lens: dict[int, int] = {}
        self.swaps = SwapLog() if self.daemon is not None else None  # flushed by step_boundary()
        # decode_seal_layers (chunk rule, no daemon): layers a decode step seals of the pages
        # in flight (0: all at once), and those pages -> their DecodeSeal, oldest first (the
        # one record of what is in flight: advance_decode_seals, _finish_decode_seals,
        # _drop_decode_pages and clear change it)
        self.decode_seal_layers = mosaic_config.decode_seal_layers
        if self.decode_seal_layers and (self.daemon is not None or self.position_rule):
            logger.warning("MosaicKV: decode_seal_layers=%d ignored: it applies to read_rule "
                           "'chunk' with daemon 'off' (here %s, daemon %s); pages seal as before",
                           self.decode_seal_layers, mosaic_config.read_rule,
                           mosaic_config.daemon)
            self.decode_seal_layers = 0
        self.decode_sealing: dict[int, DecodeSeal] = {}
        # inside `batched_seals`: the inline seals asked for so far ((group, bases) as
        # `_seal_now` got them) and their pages, sealed together when the block ends
        self._seal_queue: list[tuple] | None = None
        self._queued: set[int] = set()
        logger.info("MosaicKV pool: %d logical token slots, hot buffer %d tokens (%.1f MB "
                    "dense), arena %.1f MB per layer: it holds %d sealed tokens at the largest "
                    "layout, %d at the candidates' mean, %d at the smallest (%.2fx / %.2fx / "
                    "%.2fx below dense); blocks written by %s", size, hot_pages * page_size,
                    self._hot_capacity_bytes() / 1e6, arena_per_layer / 1e6,
                    arena_per_layer // pb.worst * page_size,
                    int(arena_per_layer // pb.expected) * page_size,
                    arena_per_layer // pb.best * page_size, pb.dense / pb.worst,
                    pb.dense / pb.expected, pb.dense / pb.best,
                    "the pack kernel" if self.store.pack_kernel else "torch copies")

    # ---- writes -------------------------------------------------------------------------
    def physical_loc(self, loc: torch.Tensor, allocate: bool = False) -> torch.Tensor:
        """Logical slots -> hot-buffer rows (allocating hot pages for new logical pages)."""
        pages = torch.div(loc, self.page_size, rounding_mode="floor")
        hot = self.hot_page_of[pages.cpu()].to(loc.device)
        if allocate and bool((hot < 0).any()):
            for page in pages[hot < 0].unique().tolist():
                if page in self.sealed:
                    raise RuntimeError(f"MosaicKV: write into sealed (immutable) page {page}")
                self.hot_page_of[page] = self._take_hot_page()
            hot = self.hot_page_of[pages.cpu()].to(loc.device)
        if bool((hot < 0).any()):
            raise RuntimeError("MosaicKV: read of a logical page that is neither hot nor sealed")
        return hot * self.page_size + loc % self.page_size

    def _take_hot_page(self) -> int:
        if not self.free_hot_pages and self.daemon is not None:
            # Still before any attention of this forward (hot pages are taken at the first
            # layer's write), so installing pages here switches them for the whole forward.
            self._relieve(1)
        if not self.free_hot_pages and self.decode_sealing:
            self._relieve_decode_seals()  # the same point: before any attention of the forward
        if not self.free_hot_pages:
            raise RuntimeError(
                "MosaicKV hot buffer exhausted: raise hot_buffer_fraction in --mosaickv-config "
                f"(now {self.cfg.hot_buffer_fraction}) or lower --max-running-requests / "
                "--chunked-prefill-size")
        self.version += 1
        return self.free_hot_pages.pop()

    def prepare_writes(self, loc: torch.Tensor) -> None:
        """Before a forward, between steps (the backend's forward-metadata hooks): hot pages for
        the new logical pages `loc` (this forward's slots) writes, and the device table its
        writes map through. Every layer's `set_kv_buffer` with this very `loc` reuses the
        mapping (no host work); `write_by_table` maps any other slot tensor on the device."""
        self._write_map = (loc, self.physical_loc(loc, allocate=True))
        self.sync_hot_page_dev()

    def map_write_pages(self, pages: np.ndarray) -> None:
        """`prepare_writes` for a forward whose writes map through the device table
        (`write_by_table`: the decode graph), from the logical pages it writes, known on the
        host: hot pages for those that have none, then the device table refreshed. No device
        read (`prepare_writes` reads `loc` back: three host syncs)."""
        hot = self.hot_page_of.numpy()
        for page in np.unique(pages[hot[pages] < 0]).tolist():
            if page in self.sealed:
                raise RuntimeError(f"MosaicKV: write into sealed (immutable) page {page}")
            self.hot_page_of[page] = self._take_hot_page()
        self.sync_hot_page_dev()

    def sync_hot_page_dev(self) -> None:
        """Bring the device hot-page table up to date (`upload_changed_span`). Writes outside
        `prepare_writes` (a prefill's `set_kv_buffer` mapping at its first layer) change the host
        table only: whoever reads the device table syncs it first."""
        if self.hot_page_dev is not self.hot_page_of:
            upload_changed_span(self.hot_page_of.numpy(), self._hot_uploaded, self.hot_page_dev)

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, *args, **kwargs):
        loc, _, _ = unwrap_write_loc(loc_info)
        # Every layer of a forward writes the same slots: mapped once, by prepare_writes before
        # the forward, else at the first layer (which then allocates hot pages).
        if self._write_map[0] is not loc:
            first = layer.layer_id == self.start_layer
            self._write_map = (loc, self.physical_loc(loc, allocate=first))
        phys = self._write_map[1]
        super().set_kv_buffer(layer, phys, cache_k, cache_v, *args, **kwargs)

    def write_by_table(self, layer, loc: torch.Tensor, cache_k, cache_v) -> None:
        """A write mapped through the device hot-page table (`prepare_writes` refreshed it for
        this step's pages): no host work and no sync, so a CUDA graph can hold it. Padded rows
        of a graph batch write slot 0: logical page 0 is the padding hot page. Mapped once per
        forward, at its first layer (in a graph: recorded there, so every replay maps its own
        slots), and reused by the other layers on the same slot tensor: five launches per layer
        fewer (~5 us per layer at batch 1, H200)."""
        if layer.layer_id == self.start_layer or self._table_map[0] is not loc:
            ps = self.page_size
            self._table_map = (
                loc, self.hot_page_dev[torch.div(loc, ps, rounding_mode="floor")] * ps + loc % ps)
        super().set_kv_buffer(layer, self._table_map[1], cache_k, cache_v)

    # ---- reads --------------------------------------------------------------------------
    def request_view(self, layer_id: int, slots: torch.Tensor, prompt: int | None = None):
        """(sealed logical pages in position order, hot K, hot V, hot start) for one request's
        slots [T] in position order, as its token at T - 1 reads them (`prompt`: its prompt
        length, `compressed_pages`). Sealed pages are a prefix of the request's pages (made one
        first by `seal_prefix_now` where SGLang's prefix swap broke it, and their basis blocks
        one basis each by `rebase_blocks`, as the kernel paths read them)."""
        ps = self.page_size
        pages = (slots[::ps] // ps).tolist()
        n_sealed = self._sealed_prefix(pages)
        if any(p in self.sealed for p in pages[n_sealed:]):
            self.seal_prefix_now(pages)
        n_sealed = self.read_split(pages, slots.numel() - 1, prompt)
        self.rebase_blocks(pages, n_sealed)
        local = layer_id - self.start_layer
        hot_slots = slots[n_sealed * ps:]
        phys = self.physical_loc(hot_slots) if hot_slots.numel() else hot_slots
        hot_k = self.k_buffer[local][phys].transpose(0, 1)  # [H, T_hot, D]
        hot_v = self.v_buffer[local][phys].transpose(0, 1)
        return pages[:n_sealed], hot_k, hot_v, n_sealed * ps

    def _sealed_prefix(self, pages) -> int:
        """How many leading `pages` (a list or numpy array of page ids) are sealed: one look at
        the page table."""
        sealed = self.page_sealed[np.asarray(pages, dtype=np.int64)]
        return len(sealed) if sealed.all() else int(sealed.argmin())

    def seal_prefix_now(self, pages: list[int]) -> int:
        """Seal on this thread every unsealed page before the last sealed one of `pages` (one
        request's, in position order), so its sealed pages are a prefix again, which every read
        path needs. They stop being one when SGLang swaps a running request's own prefix pages
        for the radix tree's copies of the same tokens (`cache_unfinished_req` frees the
        duplicates) after pages behind them were sealed, or submitted with the freed page as the
        one to wait for. Called before a forward's first read; the same on every TP rank.
        Counted (`prefix_repairs`, `prefix_repair_pages`) and logged. Returns pages sealed."""
        last = max((i for i, p in enumerate(pages) if p in self.sealed), default=-1)
        todo = [i for i in range(last) if pages[i] not in self.sealed]
        if not todo:
            return 0
        block = self.cfg.basis_block_tokens // self.page_size
        before = self.counters.sealed_pages
        for i in todo:
            page = pages[i]
            while page not in self.sealed:  # each turn seals this page or brings it closer
                if page in self.decode_sealing:  # in flight in slices: its other layers now
                    self._finish_decode_seals([page])
                    continue
                if page not in self.pending:  # hot, never submitted: seal it alone
                    first = pages[i // block * block]
                    self._seal_now([(i * self.page_size, page, self.page_gen[page])],
                                   self.sealed[first].bases if first in self.sealed else None)
                    continue
                job = self._job_of(page)
                self.daemon.cancel(job)
                self._finish([job])
        done = self.counters.sealed_pages - before
        self.counters.prefix_repairs += 1
        self.counters.prefix_repair_pages += done
        logger.warning("MosaicKV: a request's sealed pages were not a prefix (its prefix pages "
                       "were swapped for the radix tree's copies): %d pages before them sealed "
                       "on the scheduler thread (counted as prefix_repairs)", done)
        return done

    def rebase_blocks(self, pages, n: int) -> int:
        """Make the first `n` of one request's `pages` (position order, all sealed) one basis
        per position block again: every page on the bases of its block's first page, as sealing
        gives a request's own pages and the decode graph's rows (position blocks, one bases
        address each) need. They stop being that when SGLang swaps a running request's own
        prefix pages for the radix tree's copies (`cache_unfinished_req`: two requests with a
        common prefix prefilled in one batch) and the common prefix ends inside a block: the
        block then holds the tree's pages, on their block's bases, followed by the request's
        own, on the bases it fitted on its own (now freed) first page; a later request matching
        that tree path holds the same block. A page on other bases is re-pointed at the block's
        when they hold the same values (same tokens fitted alike: its bytes unchanged), else
        re-sealed under them from its decoded K/V (the codec's seal, so its bytes change: a
        second encoding). In place: every request holding the page holds the same first page
        before it (one tree path), so it is fixed for all of them. A function of the page table
        (the same pages on every TP rank). Counted (`basis_rebases`, `basis_aliased_pages`,
        `basis_resealed_pages`) and logged. Returns pages changed."""
        if n <= 0:
            return 0
        block = self.cfg.basis_block_tokens // self.page_size
        read = np.asarray(pages[:n], dtype=np.int64)
        keys = self.page_basis[read]
        bad = np.flatnonzero(keys != keys[np.arange(n) // block * block])
        if not bad.size:
            return 0
        if not self.page_sealed[read].all():
            raise RuntimeError("MosaicKV: rebase_blocks on pages that are not all sealed")
        alias, reseal, same = [], [], {}
        for j in bad.tolist():
            page, first = int(read[j]), int(read[j // block * block])
            old, target = self.sealed[page].bases, self.sealed[first].bases
            key = (id(old), id(target))
            if key not in same:
                same[key] = torch.equal(old.stacked(), target.stacked())
            (alias if same[key] else reseal).append((page, target))
        for page, target in alias:
            sp = self.sealed[page]
            self._account(sp, -1)
            self._put_sealed(page, SealedPage(sp.position, sp.segments, target, sp.nbytes))
        if reseal:
            self._reseal(reseal)
        self.version += 1
        self.counters.basis_rebases += 1
        self.counters.basis_aliased_pages += len(alias)
        self.counters.basis_resealed_pages += len(reseal)
        logger.warning("MosaicKV: a request's basis block held pages of two blocks' bases (SGLang "
                       "swapped its own prefix pages for the radix tree's, up to a page inside the "
                       "block): %d pages moved to the block's bases (%d re-sealed), counted as "
                       "basis_rebases", len(bad), len(reseal))
        return len(bad)

    def _reseal(self, todo: list[tuple[int, BasisPair]]) -> None:
        """Sealed pages re-sealed under other bases ((page, bases) each): decoded (every layer,
        in the cache dtype, as a hot page holds it), sealed again by the codec at their own
        positions, and stored in place of their old segments (`rebase_blocks`)."""
        pages = [p for p, _ in todo]
        olds = [self.sealed[p] for p in pages]
        kv = [[decoded_segment(sp.segments[local], sp.bases.k[local], sp.bases.v[local])
               for local in range(self.layer_num)] for sp in olds]
        k, v = (torch.stack([torch.stack([layer[x] for layer in page]) for page in kv])
                .to(self.dtype) for x in (0, 1))  # [P, L, H, S, D]
        with self._worker_threads():
            fresh = seal_pages(k, v, [sp.position for sp in olds], [b for _, b in todo],
                               self.cfg, self.cands, self.dense,
                               keep_rotated=self.store.pack_kernel)
        for page, sp in zip(pages, olds):
            self._count_strategies(sp, -1)
            self._account(sp, -1)
            self.store.release(page)
        self._count_sealed(fresh)
        for page, sp, segs in zip(pages, fresh, self.store.store_pages(pages, fresh)):
            self._put_sealed(page, SealedPage(sp.position, segs, sp.bases, sp.nbytes))
            if page in self.cold_done:  # its new encoding is not cold: found again
                self.cold_done.discard(page)
                self._cold_queue.append((page, self.page_gen[page]))

    def _put_sealed(self, page: int, sp: SealedPage) -> None:
        """`sp` as sealed `page`'s entry, new (`_install`) or in place of the one it had (whose
        bytes the caller took out of the account): the page table's sealed flag, bases key and
        address, and its bytes counted."""
        self.sealed[page] = sp
        self.page_sealed[page], self.page_basis[page] = True, id(sp.bases)
        if sp.bases is not None and sp.bases.whole is not None:
            self.page_basis_addr[page] = sp.bases.whole.data_ptr()
        else:
            self.basis_addr_ok = False
        self._account(sp, +1)

    def layer_view(self, layer_id: int, slots: torch.Tensor,
                   prompt: int | None = None) -> CompressedLayer:
        """One request's sealed segments + hot rows as a CompressedLayer for the codec
        (`request_view`'s split)."""
        pages, hot_k, hot_v, hot_start = self.request_view(layer_id, slots, prompt)
        local = layer_id - self.start_layer
        blocks, index = self.basis_blocks(pages)
        return CompressedLayer(
            segments=[replace(self.sealed[p].segments[local], basis=i)
                      for p, i in zip(pages, index)],
            k_bases=[b.k[local] for b in blocks], v_bases=[b.v[local] for b in blocks],
            hot_k=hot_k, hot_v=hot_v, hot_start=hot_start)

    def basis_blocks(self, pages: list[int]) -> tuple[list[BasisPair], list[int]]:
        """The distinct bases of sealed `pages` (first use first) and each page's index into
        them: a request's basis blocks, as the codec view, decode rows and prefill read them."""
        blocks, index, of = [], [], {}
        for p in pages:
            bases = self.sealed[p].bases
            if id(bases) not in of:
                of[id(bases)] = len(blocks)
                blocks.append(bases)
            index.append(of[id(bases)])
        return blocks, index

    def dense_kv(self, layer_id: int, slots: torch.Tensor):
        """Decompress one request's K/V [T, H, D] into a workspace (prefill over a prefix): with
        the kernel decode path and every page packed, one `band_unpack` launch; else the codec."""
        pages, hot_k, hot_v, _ = self.request_view(layer_id, slots)
        k, v = self.decompress(layer_id - self.start_layer, pages)
        return (torch.cat([k, hot_k.transpose(0, 1).to(self.dtype)]),
                torch.cat([v, hot_v.transpose(0, 1).to(self.dtype)]))

    # ---- the read rule and prefill chunks ---------------------------------------------------
    def compressed_pages(self, position: int, prompt: int | None = None) -> int:
        """The read rule: how many leading pages of its request a token at `position` reads
        compressed (the rest dense). The window W (`dense_window`: hot_tokens, + daemon_lag_tokens
        with the daemon) slides with the generated tokens and is anchored at the prompt's end
        for the prompt: with `prompt` (the request's prompt length L) a generated token
        (t >= L) reads compressed every page ending at least W before it, max(t - W, 0) // page,
        and a prompt token (t < L) every full page before its own that ends at least W before
        the prompt's end, min(t // page, max(L - W, 0) // page). So the prompt's last W tokens
        (and the page holding the first of them) are read dense by every token from there on
        until the window passes them: the first answer token reads the prompt's end dense,
        wherever the prompt ends in a page. Without `prompt` (unknown) the window slides for
        every token. A function of the position and the prompt length alone, so what a
        request reads does not depend on how it was chunked, batched or re-prefilled after a
        retraction; nor on who cached its prefix: every page some token reads dense is one the
        request computed itself (the radix tree holds a request's last W prompt tokens back
        from its match: `MosaicRadixCache.window_cap`; docs/determinism.md). With W = 0 a token
        reads every full page before its own compressed."""
        n = max(position - self.dense_window, 0) // self.page_size
        if prompt is None or position >= prompt:
            return n
        tail = max(prompt - self.dense_window, 0) // self.page_size
        return max(n, min(position // self.page_size, tail))

    def chunk_reads(self, first: int, end: int, ja: int, prompt: int | None = None) -> torch.Tensor:
        """int64 [end - first]: how many pages each token of a prefill chunk at positions
        first .. end - 1 reads compressed (`compressed_pages` for each with `prompt`, at least
        `ja`, what the chunk's first token reads: see chunk_kv); under the chunk rule all read
        `ja`."""
        if not self.position_rule:
            return torch.full((end - first,), ja, dtype=torch.long)
        pos = torch.arange(first, end, dtype=torch.long)
        n = (pos - self.dense_window).clamp(min=0) // self.page_size
        if prompt is not None:
            tail = max(prompt - self.dense_window, 0) // self.page_size
            n = torch.where(pos < prompt,
                            torch.maximum(n, (pos // self.page_size).clamp(max=tail)), n)
        return n.clamp(min=ja)

    def set_prompt_len(self, req_pool_idx: int, prompt: int) -> None:
        """Record the prompt length of the request holding `req_pool_idx` (the scheduler's
        prepare_for_extend, before each prefill forward; a reused index is overwritten)."""
        self.prompt_lens[req_pool_idx] = prompt

    def prompt_lens_of(self, req_pool_indices: list[int]) -> list[int | None]:
        """The prompt length of each request (by req_pool_idx) where the read rule uses it
        (`prompt_split`), else all None. One without a record reads by the window alone:
        counted (`prompt_len_unknown`), logged once."""
        if not self.prompt_split:
            return [None] * len(req_pool_indices)
        out = [self.prompt_lens.get(i) for i in req_pool_indices]
        missing = out.count(None)
        if missing:
            if not self.counters.prompt_len_unknown:
                logger.warning("MosaicKV: %d request(s) without a recorded prompt length: their "
                               "prompt tokens read by the window too (counted in stats as "
                               "prompt_len_unknown)", missing)
            self.counters.prompt_len_unknown += missing
        return out

    def sealed_prefix(self, pages: list[int]) -> int:
        """How many leading `pages` are sealed."""
        return self._sealed_prefix(pages)

    def plan_chunk_seal(self, requests: list[tuple[list[int], int, int | None]]
                        ) -> ChunkSeal | None:
        """Before a prefill forward's attention: the pages its tokens read compressed under the
        read rule that are not sealed yet (pages of this very chunk, or hot pages of a cached
        prefix), grouped by basis block; `requests` holds (page ids in position order, position
        of the chunk's last token, prompt length or None) per request. Pages still with the
        daemon are sealed now (they are needed now). None when there is nothing to seal."""
        if not self.position_rule:
            return None  # a chunk reads what was sealed before it: nothing to seal inside it
        ps, block = self.page_size, self.cfg.basis_block_tokens // self.page_size
        todo: dict[int, tuple[int, int]] = {}  # page -> (position index, its block's first page)
        for pages, last, prompt in requests:
            for i in range(min(self.compressed_pages(last, prompt), len(pages))):
                p = pages[i]
                if p not in self.sealed and p not in todo:
                    todo[p] = (i, pages[i // block * block])
        if self.daemon is not None and any(p in self.pending for p in todo):
            for pages, last, prompt in requests:
                self.daemon.counters.sync_seals_needed += self._seal_pending(
                    pages, min(self.compressed_pages(last, prompt), len(pages)))
            todo = {p: x for p, x in todo.items() if p not in self.sealed}
        if not todo:
            return None
        by_first: dict[int, list[int]] = {}
        for p, (i, first) in sorted(todo.items(), key=lambda item: item[1][0]):
            by_first.setdefault(first, []).append(p)
        cs = ChunkSeal([], [], [])
        for first, group in by_first.items():
            cs.add_group(group, [todo[p][0] * ps for p in group], self._block_bases(first, group))
        return cs

    def _block_bases(self, first: int, group: list[int]) -> BasisPair | None:
        """The bases of the basis block whose first page is `first` for sealing `group` (its
        pages, position order): the sealed first page's, or None when `group` starts with
        `first` (fitted while sealing it)."""
        bases = self.sealed[first].bases if first in self.sealed else None
        if bases is None and group[0] != first:
            raise RuntimeError(f"MosaicKV: page {group[0]} needs the bases of block page "
                               f"{first}, which is neither sealed nor being sealed")
        return bases

    @contextmanager
    def _worker_threads(self):
        """Inline seals of a CPU pool under the daemon run with the workers' intra-op threads:
        GEMM reduction order depends on the thread count, and a page must be the same bytes
        whether a worker or this thread sealed it (which one does depends on timing). A GPU
        pool's inline seals run on the device, where the bytes can differ from a worker's in the
        last bits (noise, like a batch shape's)."""
        if self.daemon is None or torch.device(self.device).type != "cpu":
            yield
            return
        n = torch.get_num_threads()
        torch.set_num_threads(self.cfg.daemon_threads)
        try:
            yield
        finally:
            torch.set_num_threads(n)

    def seal_chunk_layer(self, cs: ChunkSeal, local: int) -> dict[int, tuple]:
        """One layer of `cs`'s pages sealed from the hot buffer (the same codec calls and bases as
        sealing the whole page at once: `fit_block_bases` on the block's first page, or
        `fit_bases` on the group's pages under basis_fit "group", then `seal_pages`). Returns
        page -> (K, V) [S, H, D] in the cache dtype as the sealed segment reads back (raw
        basis), for this layer's attention."""
        with self._worker_threads():
            return self._seal_chunk_layer(cs, local)

    def _seal_chunk_layer(self, cs: ChunkSeal, local: int,
                          read_back: bool = True) -> dict[int, tuple]:
        return self._seal_layers([(cs, local)], read_back)[0]

    def _seal_layers(self, work: list[tuple[ChunkSeal, int]],
                     read_back: bool = False) -> list[dict[int, tuple]]:
        """One layer of each of several seals (`work`: (seal, its layer), e.g. every decode
        seal in flight), every group of all of them sealed in one batch: one fit call per page
        count for the groups that open their block (`fit_groups`), one `seal_pages` with each
        page's own bases, as each group sealed alone gives (the same bytes). Returns per item
        page -> (K, V) [S, H, D] as they read back (`read_back`), else empty dicts."""
        ks, vs, positions, per_page, owners, opening = [], [], [], [], [], []
        at = 0
        for w, (cs, local) in enumerate(work):
            for g, (idx, bases) in enumerate(cs.groups):
                k, v = self._read_layer_pages(local, [cs.pages[j] for j in idx])
                ks.append(k)
                vs.append(v)
                positions += [cs.positions[j] for j in idx]
                owners.append((w, g, idx, bases, slice(at, at + len(idx))))
                if bases is None:
                    opening.append(len(owners) - 1)
                at += len(idx)
        fitted = dict(zip(opening, fit_groups([(ks[o], vs[o]) for o in opening], self.cfg)))
        ones = []
        for o, (w, g, idx, bases, _) in enumerate(owners):
            cs, local = work[w]
            if bases is None:
                one = fitted[o]
                cs.fitted[g][0].append(one.k[0])
                cs.fitted[g][1].append(one.v[0])
            else:
                one = BasisPair([bases.k[local]], [bases.v[local]])
            ones.append(one)
            per_page += [one] * len(idx)
        k, v = (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks), torch.cat(vs))
        keep = self.store.pack_kernel
        if keep:  # within the budget of rotated K/V the seals in `work` keep until install
            size = k.shape[0] * k[0].numel() * 8  # float32 K and V of this call's segments
            keep = sum(cs.rotated_bytes for cs, _ in work) + size <= CHUNK_ROTATED_BYTES
            if keep:
                for cs, _ in work:
                    cs.rotated_bytes += size // len(work)
        sealed = seal_pages(k, v, positions, per_page, self.cfg, self.cands, self.dense,
                            keep_rotated=keep, keep_decoded=read_back)
        out = [{} for _ in work]
        for (w, _, idx, _, rows), one in zip(owners, ones):
            cs = work[w][0]
            refs = [sp.segments.refs[0] for sp in sealed[rows]]
            for j, ref in zip(idx, refs):
                cs.segments[j].append(ref)
            if read_back:
                kr, vr = read_back_block(refs, one.k[0], one.v[0], self.dtype)
                out[w].update((cs.pages[j], (kr[r], vr[r])) for r, j in enumerate(idx))
        if read_back:  # the reconstructions (float32, 4x a bf16 page) are not kept past here
            for sp in sealed:
                sp.segments.refs[0][0].decoded = None
        return out

    def finish_chunk_seal(self, cs: ChunkSeal) -> int:
        """After the forward's last layer: install `cs`'s pages (every layer sealed). Returns
        pages installed."""
        n = self._install_chunk_seal(cs)
        self.counters.chunk_sealed_pages += n
        return n

    def _install_chunk_seal(self, cs: ChunkSeal) -> int:
        """Install `cs`'s pages, every layer sealed (a prefill's `ChunkSeal` after its forward, a
        `DecodeSeal`'s after its last slice). Returns pages installed."""
        pages, sealed = [], []
        for g, (idx, bases) in enumerate(cs.groups):
            if bases is None:
                bases = BasisPair.of(torch.stack(cs.fitted[g][0] + cs.fitted[g][1]))
            for j in idx:
                segs = cs.segments[j]
                if len(segs) != self.layer_num:
                    raise RuntimeError(f"MosaicKV: page {cs.pages[j]} installed with "
                                       f"{len(segs)} of {self.layer_num} layers sealed")
                pages.append(cs.pages[j])
                sealed.append(SealedPage(cs.positions[j], PageSegments(segs), bases,
                                         sum(int(b.segment_nbytes()[i]) for b, i in segs)))
        # position rule with a window: a page inside another request's window (a hot page of
        # a cached prefix this chunk reads compressed) stays dense for that request until its
        # seal_request drops the copy (the chunk's own pages: right after this forward)
        self._install(pages, sealed, keep_hot=self.prompt_split)
        return len(pages)

    def _read_layer_pages(self, local: int, pages: list[int]):
        """Hot logical pages' K and V of one layer, [P, 1, H, S, D] (`seal_pages`' layout)."""
        ps = self.page_size
        hot = self.hot_page_of[pages]
        if bool((hot < 0).any()):
            raise RuntimeError(f"MosaicKV: sealing pages {pages} that are not all hot")
        rows = (hot[:, None] * ps + torch.arange(ps)).flatten().to(self.k_buffer[local].device)
        return tuple(buf[local][rows].view(len(pages), ps, *buf[local].shape[1:])
                     .transpose(1, 2)[:, None] for buf in (self.k_buffer, self.v_buffer))

    def chunk_kv(self, local: int, slots: torch.Tensor, first: int, fresh: dict,
                 prompt: int | None = None):
        """What a prefill chunk of one request reads at one layer: `slots` its slots [0, b) in
        position order, `first` the chunk's first position, `fresh` this forward's
        `seal_chunk_layer` output, `prompt` the request's prompt length (`compressed_pages`).
        Returns (Kc, Vc, Kd, Vd, jc, ja): Kc/Vc [jc * page, H, D] the compressed pages as they
        read back (jc = pages the chunk's last token reads compressed), Kd/Vd [b - ja * page, H,
        D] the dense tokens from page ja on (ja = pages its first token reads compressed). Pages
        sealed before the read rule wants them (see `read_split`) are read compressed by every
        token: counted."""
        ps, b = self.page_size, slots.numel()
        pages = (slots[::ps] // ps).tolist()
        ja = self.read_split(pages, first, prompt)  # fresh pages install after the forward
        jc = max(self.compressed_pages(b - 1, prompt), ja) if self.position_rule else ja
        old = [p for p in pages[:jc] if p not in fresh]
        if old != pages[:len(old)]:
            raise RuntimeError("MosaicKV: a chunk's compressed pages are not a sealed prefix "
                               "followed by pages sealed in this forward")
        kc, vc = self.decompress(local, old)
        if len(old) < jc:
            new = [fresh[p] for p in pages[len(old):jc]]
            kc = torch.cat([kc, *[x[0] for x in new]])
            vc = torch.cat([vc, *[x[1] for x in new]])
        dense_slots = slots[ja * ps:]
        phys = self.physical_loc(dense_slots)
        return kc, vc, self.k_buffer[local][phys], self.v_buffer[local][phys], jc, ja

    def decompress(self, local: int, pages: list[int]):
        """Sealed `pages`' K and V [len * page, H, D] in the cache dtype (raw basis): one
        `band_unpack` launch when the kernel decode path reads them all packed, else the codec."""
        h, d = self.head_num, self.head_dim
        if not pages:
            empty = torch.empty(0, h, d, dtype=self.dtype, device=self.device)
            return empty, empty
        if self.decode_path is not None and bool(self.store.packed[local, pages].all()):
            return self.decode_path.unpack(local, pages)
        ks, vs = zip(*(decoded_segment(page.segments[local], page.bases.k[local], page.bases.v[local])
                       for page in map(self.sealed.__getitem__, pages)))
        return (torch.cat(ks, 1).transpose(0, 1).to(self.dtype),
                torch.cat(vs, 1).transpose(0, 1).to(self.dtype))

    def _seal_pending(self, pages: list[int], n: int) -> int:
        """Seal on this thread the first `n` of one request's `pages` that the daemon still has
        (they are needed now): its job is cancelled and sealed from the hot buffer. Returns the
        pages sealed (the caller counts them under its reason)."""
        done = 0
        for i in range(n):
            page = pages[i]
            while page not in self.sealed and page in self.pending:
                job = self._job_of(page)
                self.daemon.cancel(job)
                done += self._finish([job])
        return done

    def bound_hot_reads(self, page_ids, seq_len: int, prompt: int | None, cap: int) -> int:
        """Before a decode graph step (between steps): make one request's step (its token at
        `seq_len - 1`, `page_ids` its logical pages on the host, position order) read at most
        `cap` hot tokens, the graph's static hot table, and every step until its next page
        starts (device-planned steps check nothing; a new page makes a host step). Only the
        daemon's pages in flight can push a request past it (read hot until adopted: a long
        prompt just prefilled under the chunk rule); the oldest of those it needs are sealed on
        this thread, counted in `sync_seals_graph` and logged. Returns the hot tokens the step
        then reads."""
        ps = self.page_size
        n_pages = -(-seq_len // ps)
        pages = np.asarray(page_ids)[:n_pages]
        hot = seq_len - self.read_split_np(pages, seq_len - 1, prompt) * ps
        if hot + n_pages * ps - seq_len <= cap or self.daemon is None:  # at the page's end
            return hot
        want = min(n_pages - cap // ps, self.compressed_pages(seq_len - 1, prompt)
                   if self.position_rule else len(pages))
        done = self._seal_pending(pages.tolist(), want)
        if done:
            self.daemon.counters.sync_seals_graph += done
            logger.warning("MosaicKV daemon behind the decode graph: %d pages of a request "
                           "sealed on the scheduler thread (it read %d hot tokens, the graph "
                           "holds %d; counted in daemon.sync_seals_graph)", done, hot, cap)
        return seq_len - self.read_split_np(pages, seq_len - 1, prompt) * ps

    def _job_of(self, page: int):
        """The daemon job that must finish for pending `page` to be sealed: its own, or, when it
        is deferred, the job fitting its block's bases (that one goes first, then it is sent)."""
        job = self.pending[page]
        if job is None:
            job = next((self.pending[first] for first, group in self.deferred.items()
                        if any(p == page for _, p, _ in group)), None)
        if job is None:
            raise RuntimeError(f"MosaicKV: page {page} is pending without a job")
        return job

    # ---- sealing ------------------------------------------------------------------------
    def seal_request(self, slots: torch.Tensor, seq_len: int, prompt: int | None = None) -> int:
        """After a forward: make one request's pages ready for its next token (position
        `seq_len`; `prompt` its prompt length, `compressed_pages`). The pages it reads
        compressed under the read rule are sealed now (inline; ones the daemon still has are
        taken back and sealed here: prompt pages always), and their hot copies kept for the
        read rule are freed; with the daemon, full pages it does not read compressed yet (pages
        holding generated tokens, inside the window) are submitted (that slack is the daemon's
        time). Returns pages newly sealed or submitted."""
        ps = self.page_size
        limit = self._seal_limits(seq_len, prompt)[1]
        return self.seal_request_pages((slots[: limit * ps: ps] // ps).cpu().numpy(), seq_len,
                                       prompt=prompt)

    def _seal_limits(self, seq_len: int, prompt: int | None = None) -> tuple[int, int, int]:
        """(need, limit, inline_below) of `seal_request`: pages read compressed next step,
        pages to seal or submit, pages sealed inline whatever the daemon."""
        need = self.compressed_pages(seq_len, prompt)
        if not self.position_rule:  # chunk rule: pages go to the daemon (if any) until adopted
            return need, need, 0
        # position rule: the pages needed next step are sealed here
        return need, need if self.daemon is None else seq_len // self.page_size, need

    def seal_request_pages(self, page_ids, seq_len: int, decode_step: bool = False,
                           prompt: int | None = None) -> int:
        """`seal_request` from the request's logical page ids on the host (numpy or a CPU
        tensor, position order; pages past what it seals are ignored): what the decode step's
        host work calls with the page ids it reads once for the whole batch. The common case,
        nothing new to seal, is one vectorized look at the page table. `decode_step`: the
        decode step's call; with `decode_seal_layers` its new pages start sealing in slices
        (`DecodeSeal`, advanced by `advance_decode_seals`) instead of all at once. Any other
        call needs its pages whole: those in slices get their other layers sealed now.
        `prompt`: the request's prompt length (`compressed_pages`)."""
        need, limit, inline_below = self._seal_limits(seq_len, prompt)
        pages = np.asarray(page_ids)[:limit]
        if self._queued and not self._queued.isdisjoint(pages.tolist()):
            # a page of this request waits in `batched_seals` (a shared prefix another request
            # asked for, or its block's first page): sealed now, as if no batch were open
            self._flush_seals()
        if self.position_rule:
            listed = pages.tolist()
            if self.daemon is not None:
                self.daemon.counters.sync_seals_needed += self._seal_pending(listed, need)
            self._drop_kept_hot(listed[:need])
        if self.decode_sealing and not decode_step:
            self._finish_decode_seals(pages.tolist())
        unsealed = np.flatnonzero(~self.page_sealed[pages])
        todo = [(int(i), int(pages[i])) for i in unsealed if int(pages[i]) not in self.pending
                and int(pages[i]) not in self.decode_sealing]
        if not todo:
            return 0
        if decode_step and self.decode_seal_layers:
            return self._start_decode_seal(todo, pages.tolist())
        ps, pages = self.page_size, pages.tolist()
        for i, p in todo:  # a page may enter `sealed` only after the page before it
            if i:
                self.prev_page[p] = pages[i - 1]
        block = self.cfg.basis_block_tokens // ps
        for blk in sorted({i // block for i, _ in todo}):
            first = pages[blk * block]
            for now in (True, False):  # pages needed next step: inline; the rest: the daemon
                group = [(i * ps, p, self.page_gen[p]) for i, p in todo
                         if i // block == blk and (i < inline_below) == now]
                if not group:
                    continue
                if first in self._queued:  # its bases are being fitted in `batched_seals`
                    self._flush_seals()
                if first in self.sealed:
                    bases = self.sealed[first].bases
                    if now:
                        self._seal_now(group, bases, may_queue=True)
                    else:
                        self._seal(group, bases, first, may_queue=True)
                elif now:  # starts with `first`: fitted, or the previous block's bases
                    self._seal_now(group, self._opening_bases(pages, blk, len(group)),
                                   may_queue=True)
                elif first in self.pending:  # the daemon is fitting this block's bases: wait
                    self.deferred.setdefault(first, []).extend(group)
                    for _, p, _ in group:
                        self.pending[p] = None
                else:
                    self._seal(group, self._opening_bases(pages, blk, len(group)), first,
                               may_queue=True)
        return len(todo)

    def _opening_bases(self, pages: list[int], blk: int, n: int) -> BasisPair | None:
        """The bases a group of `n` pages opening basis block `blk` of a request (`pages` its
        page ids, position order) is sealed with: its previous block's when the group holds
        fewer than `basis_inherit_below_tokens` tokens and is not the whole block (`basis_fit`
        "group", daemon off) and that block is sealed (counted: inherited_bases), else None
        (fitted on the group). A function of the request's earlier pages: every TP rank takes
        the same."""
        below = min(self.cfg.basis_inherit_below_tokens, self.cfg.basis_block_tokens)
        if (blk == 0 or n * self.page_size >= below or self.daemon is not None
                or self.cfg.basis_fit != "group"):
            return None
        prev = pages[(blk - 1) * (self.cfg.basis_block_tokens // self.page_size)]
        if prev in self._queued:  # the previous block opens in this `batched_seals` batch
            self._flush_seals()
        sp = self.sealed.get(prev)
        if sp is None:
            return None
        self.counters.inherited_bases += 1
        return sp.bases.inherit()

    # ---- decode sealing in slices (decode_seal_layers) ------------------------------------
    # Sealing a page's every layer at once stalls the decode step that does it (~60 ms for a
    # Llama-8B page on the H200); under the chunk rule a page not sealed yet is read dense, so
    # a decode step seals `decode_seal_layers` layers of each page in flight and the page is
    # installed after its last. Every decision is a function of the pool's state (no timing):
    # every TP rank seals the same slices at the same step.
    def _start_decode_seal(self, todo: list[tuple[int, int]], pages: list[int]) -> int:
        """One request's new sealable pages `todo` ((position index, page), position order;
        `pages` its page ids) start sealing in slices, grouped by basis block as sealing them
        at once groups them (same bases, same codec calls: the same bytes). A block whose first
        page is still in slices has no bases yet: its later pages, and the request's pages
        after them (sealed pages stay a prefix), wait for a later step. Returns pages started."""
        ps, block = self.page_size, self.cfg.basis_block_tokens // self.page_size
        cs = ChunkSeal([], [], [])
        for blk in sorted({i // block for i, _ in todo}):
            first = pages[blk * block]
            if first in self.decode_sealing:
                break
            group = [(i, p) for i, p in todo if i // block == blk]
            bases = self._block_bases(first, [p for _, p in group])
            if bases is None:
                bases = self._opening_bases(pages, blk, len(group))
            cs.add_group([p for _, p in group], [i * ps for i, _ in group], bases)
        if not cs.pages:
            return 0
        ds = DecodeSeal(cs)
        for p in cs.pages:
            self.decode_sealing[p] = ds
        return len(cs.pages)

    def _decode_seals(self) -> list[DecodeSeal]:
        """The seals in flight, oldest first (a seal's pages entered `decode_sealing` together,
        after every older seal's)."""
        return list(dict.fromkeys(self.decode_sealing.values()))

    def advance_decode_seals(self) -> int:
        """Between decode steps, after the step's `seal_request_pages` calls: the next
        `decode_seal_layers` layers of every seal in flight (the oldest first), and the pages of
        the seals that reach their last layer installed (read compressed from the next plan on,
        their hot pages freed). Seals advance alike, so a request's pages install in order.
        The seals' slices are sealed together, one batch per layer offset (`_seal_layers`: the
        bytes each seal gets alone). Returns pages installed."""
        return self._advance_decode_seals(self._decode_seals(), self.decode_seal_layers)

    def _advance_decode_seals(self, seals: list[DecodeSeal], layers: int) -> int:
        stops = [min(ds.next_layer + layers, self.layer_num) for ds in seals]
        for off in range(layers):
            work = [(ds.seal, ds.next_layer + off) for ds, stop in zip(seals, stops)
                    if ds.next_layer + off < stop]
            if not work:
                break
            self._seal_layers(work)
            self.counters.decode_seal_slices += sum(len(cs.pages) for cs, _ in work)
        n = 0
        for ds, stop in zip(seals, stops):  # installs in seal order (a request's pages in order)
            ds.next_layer = stop
            if stop < self.layer_num:
                continue
            for p in ds.seal.pages:
                del self.decode_sealing[p]
            done = self._install_chunk_seal(ds.seal)
            self.counters.decode_sealed_pages += done
            n += done
        return n

    def _finish_decode_seals(self, pages: list[int] | None = None) -> int:
        """Pages in slices needed whole now: every layer left of the seals holding any of
        `pages` (None: all seals) and of the seals older than those (a request's pages install
        in order), installed. Counted (`decode_seals_forced`). Returns pages installed."""
        seals = self._decode_seals()
        if pages is not None:
            wanted = {id(self.decode_sealing[p]) for p in pages if p in self.decode_sealing}
            if not wanted:
                return 0
            seals = seals[:max(k for k, ds in enumerate(seals) if id(ds) in wanted) + 1]
        n = self._advance_decode_seals(seals, self.layer_num)
        self.counters.decode_seals_forced += n
        return n

    def _relieve_decode_seals(self) -> int:
        """Hot-buffer pressure: the oldest seals in slices finished until a hot page is free
        (installing frees their hot pages), rather than failing the forward. Counted (forced
        seals) and logged. Returns pages installed."""
        done = 0
        while not self.free_hot_pages and self.decode_sealing:
            done += self._finish_decode_seals([next(iter(self.decode_sealing))])
        if done:
            logger.warning("MosaicKV: hot buffer exhausted with pages sealing in slices "
                           "(decode_seal_layers): %d pages finished at once (counted as "
                           "decode_seals_forced)", done)
        return done

    def _drop_decode_pages(self, pages: list[int]) -> None:
        """Freed `pages`: out of the seals in flight, with the rest of their basis group (its
        bases may have been fitted on them); the group's other pages stay hot, unsealed, and
        start again at their request's next decode step."""
        gone = {p for p in pages if p in self.decode_sealing}
        for ds in dict.fromkeys(self.decode_sealing[p] for p in gone):
            kept = ds.seal.without(gone)
            left = set(kept.pages) if kept is not None else set()
            for p in ds.seal.pages:
                if p not in left:
                    del self.decode_sealing[p]
            if kept is not None:
                ds.seal = kept

    def seal_finished(self, slots: torch.Tensor) -> int:
        """A finished request's pages before its radix insert (`slots` its KV slots in position
        order). Position rule: every full page, whatever the window, with its hot copy freed:
        nothing reads them dense any more (a later request matching them in the radix tree
        matches them outside its own last `dense_window` tokens, which the tree holds back:
        read compressed by its every later token). Chunk rule:
        every full page too. Returns pages sealed."""
        before = self.counters.sealed_pages
        full = slots.numel() // self.page_size * self.page_size
        if not self.position_rule:
            # the chunk rule: every full page (with the daemon: sent). Its last hot_tokens would
            # stay hot in the radix tree for as long as it keeps them: a hot page per cached
            # request, which exhausted the in-flight-sized hot buffer after 64 cached 8K
            # requests (benchmarks/capacity_bench.py). A request extending the prefix reads
            # them compressed, as the chunk rule reads whatever is sealed.
            self.seal_request(slots[:full], full + self.cfg.hot_tokens)
            return self.counters.sealed_pages - before
        if not self.dense_window:
            return 0  # every full page is sealed already
        # a token `dense_window` past the last full page reads every full page compressed:
        # seal_request seals them and frees their kept hot copies
        self.seal_request(slots[:full], full + self.dense_window)
        return self.counters.sealed_pages - before

    def _drop_kept_hot(self, pages: list[int]) -> None:
        """Free the hot copies kept for sealed `pages` (daemon results installed before the read
        rule read them compressed) once their request reads them compressed."""
        for p in pages:
            if p in self.kept_hot:
                self.version += 1
                self.kept_hot.discard(p)
                self.free_hot_pages.append(int(self.hot_page_of[p]))
                self.hot_page_of[p] = -1

    def read_split_np(self, pages: np.ndarray, position: int, prompt: int | None = None) -> int:
        """`read_split` for page ids as a numpy array: the chunk rule's count (the sealed
        prefix) vectorized; the position rule through `read_split`."""
        if self.position_rule:
            return self.read_split(pages.tolist(), position, prompt)
        return self._sealed_prefix(pages)

    def read_split(self, pages: list[int], position: int, prompt: int | None = None) -> int:
        """How many leading `pages` (one request's, position order) a token at `position` reads
        compressed (`prompt`: its request's prompt length): the read rule's count, or more where
        pages past it are sealed without a hot copy (a window > 0 and a page another request
        sealed inside it, or a prompt length not known: counted)."""
        n = self._sealed_prefix(pages)
        if not self.position_rule:
            return n  # whatever is sealed (before this forward) is read compressed
        rule = min(self.compressed_pages(position, prompt), len(pages))
        if n <= rule:
            return n
        if all(p in self.kept_hot for p in pages[rule:n]):
            return rule
        self.counters.early_sealed_reads += 1
        return n

    def _seal(self, group: list[tuple[int, int, int]], bases: BasisPair | None, first: int,
              may_queue: bool = False):
        """Pages (position, page, gen) of one basis block: inline, or submitted to the daemon.
        `may_queue`: see `_seal_now`."""
        if self.daemon is None:
            self._seal_now(group, bases, may_queue=may_queue)
            return
        if self.daemon.broken:
            self.daemon.counters.sync_seals_fallback += len(group)
            self._seal_now(group, bases, keep_hot=self.position_rule)
            return
        mine = {p for _, p, _ in group}
        needs = sorted({self.prev_page[p] for p in mine if p in self.prev_page} - mine)
        job = self.daemon.submit([p for _, p, _ in group], [g for _, _, g in group],
                                 [pos for pos, _, _ in group], first, bases, needs)
        for _, p, _ in group:
            self.pending[p] = job

    @contextmanager
    def batched_seals(self):
        """Inline seals asked for inside this block (one `seal_request_pages` per request of a
        decode step or of a prefill batch) are sealed together when it ends: one gather, one
        chooser batch per SEAL_BATCH segments over every request's pages (each page rotated by
        its own block's bases: `seal_pages` with per-page bases) and one install, instead of
        one of each per request and block. The same pages get the same bytes and enter
        `sealed` in the same order as sealed one by one: a request whose page is already
        waiting (a shared prefix) seals the queue first. Nested blocks join the outer one. On
        an exception the queued pages stay hot and unsealed (sealed at a later step)."""
        if self._seal_queue is not None:
            yield
            return
        self._seal_queue = []
        try:
            yield
            self._flush_seals()
        finally:
            self._seal_queue, self._queued = None, set()

    def _flush_seals(self) -> None:
        """Seal what `batched_seals` has queued (see there), in batches of at most a basis
        block's pages (the most one group sealed before: the gather and the chooser's float32
        copies stay that size; a larger group alone); the queue stays open."""
        queue, self._seal_queue, self._queued = self._seal_queue, [], set()
        most = self.cfg.basis_block_tokens // self.page_size
        batch, pages = [], 0
        for item in queue:
            if batch and pages + len(item[0]) > most:
                self._seal_batch(batch)
                batch, pages = [], 0
            batch.append(item)
            pages += len(item[0])
        if batch:
            self._seal_batch(batch)

    def _seal_batch(self, queue: list[tuple]) -> None:
        """One batch of `_flush_seals`: (group, bases) items sealed together, installed in
        queue order."""
        if len(queue) == 1:
            self._seal_now(*queue[0])
            return
        pages = [p for group, _ in queue for _, p, _ in group]
        positions = [pos for group, _ in queue for pos, _, _ in group]
        with self._worker_threads():
            k, v = self._read_pages(pages)
            starts = np.cumsum([0] + [len(group) for group, _ in queue])
            # groups that start their block's bases (fitted as seal_group fits them), together
            opening = [g for g, (_, bases) in enumerate(queue) if bases is None]
            fitted = dict(zip(opening, fit_groups(
                [(k[starts[g]:starts[g + 1]], v[starts[g]:starts[g + 1]]) for g in opening],
                self.cfg)))
            per_page = [fitted.get(g, bases) for g, (group, bases) in enumerate(queue)
                        for _ in group]
            sealed = seal_pages(k, v, positions, per_page, self.cfg, self.cands, self.dense,
                                keep_rotated=self.store.pack_kernel, cache=self.write_cache)
        self.counters.seal_batches += 1
        self.counters.seal_batch_groups += len(queue)
        self._install(pages, sealed)

    def _seal_now(self, group: list[tuple[int, int, int]], bases: BasisPair | None,
                  keep_hot: bool = False, may_queue: bool = False) -> None:
        """Seal on this thread from the hot buffer (the codec code the worker runs too).
        `may_queue` (`seal_request_pages`' own seals, daemon off): inside `batched_seals`,
        queued (a seal that keeps its hot copy is never queued); every other caller needs its
        pages sealed on return."""
        pages = [p for _, p, _ in group]
        if may_queue and not keep_hot and self._seal_queue is not None:
            self._seal_queue.append((group, bases))
            self._queued.update(pages)
            return
        with self._worker_threads():
            sealed = seal_group(lambda idx: self._read_pages([pages[i] for i in idx]),
                                [pos for pos, _, _ in group], bases, self.cfg, self.cands,
                                self.dense, keep_rotated=self.store.pack_kernel,
                                cache=self.write_cache)
        self._install(pages, sealed, keep_hot=keep_hot)

    def _read_pages(self, pages: list[int]):
        """Hot logical pages' K and V, all layers, [P, L, H, S, D] (the `seal_group` reader)."""
        return gather_pages(self.k_buffer, self.v_buffer, self.hot_page_of[pages], self.page_size)

    def _install(self, pages: list[int], sealed: list[SealedPage | ArenaPage],
                 keep_hot: bool = False) -> None:
        """The one place sealed pages enter ``self.sealed`` (``release_pages``/``clear`` are the
        only exits): store each layer's segments of all `pages` in one batch (arena-ready daemon
        results with one copy each), account their bytes and give their hot pages back."""
        self.version += 1
        for page in pages:
            if page in self.sealed:
                raise RuntimeError(f"MosaicKV: page {page} sealed twice")
        if len(set(pages)) != len(pages):
            raise RuntimeError(f"MosaicKV: pages {pages} installed twice in one batch")
        self._count_sealed(sealed)
        sealed = [SealedPage(sp.position, segs, sp.bases, sp.nbytes)
                  for sp, segs in zip(sealed, self.store.store_pages(pages, sealed))]
        block = self.cfg.basis_block_tokens // self.page_size
        for page, sp in zip(pages, sealed):
            if (sp.position // self.page_size) % block == block - 1:  # the block is complete
                self.write_cache.drop(sp.bases)
            self._put_sealed(page, sp)
            if keep_hot:  # read dense until the read rule says otherwise (_drop_kept_hot)
                self.kept_hot.add(page)
            else:
                self.free_hot_pages.append(int(self.hot_page_of[page]))
                self.hot_page_of[page] = -1
            self.counters.sealed_pages += 1
            if self._cold_cands is not None:
                self._cold_queue.append((page, self.page_gen[page]))
            _bump(self.counters.sealed_by_position, sp.position // self.page_size)
            if self.swaps is not None:
                self.swaps.add(page, self.page_gen[page])

    def _count_sealed(self, sealed: list) -> None:
        """Freshly sealed pages into the strategy counters and the chooser's over-budget and
        rescued counts."""
        for sp in sealed:
            self._count_strategies(sp, +1)
            for _, _, reason in sp.kinds():
                self.counters.over_budget += reason == "over-budget"
                self.counters.rescued += reason == "rescued"

    def _count_strategies(self, sp, sign: int) -> None:
        """The strategy counters (`counters.strategies`): a stored page's per-layer K and V
        specs in (+1) or out (-1)."""
        for kind, spec, _ in sp.kinds():
            key = f"{kind}:{spec}"
            self.counters.strategies[key] = self.counters.strategies.get(key, 0) + sign

    def count_reuse(self, page_slots: list[int]) -> int:
        """A request got these pages (first slot of each, in position order from 0) from the
        radix tree: count the sealed ones, by position. Returns how many were sealed."""
        reused = 0
        for i, slot in enumerate(page_slots):
            if slot // self.page_size in self.sealed:
                _bump(self.counters.reused_by_position, i)
                reused += 1
        self.counters.reused_pages += reused
        return reused

    # ---- daemon -------------------------------------------------------------------------
    def _start_daemon(self):
        from ..daemon.client import DaemonClient, SlotCopy

        per_layer = worst_page_bytes(self.cfg, self.head_num, self.head_dim, self.dense)
        bases = self.layer_num * 2 * self.head_num * self.head_dim * self.head_dim * 2
        # + the pickled skeleton (strategy objects, headers) and tensor alignment, a few KB per
        # layer; an overflow is reported by the worker and the page sealed here (counted)
        result_bytes = self.layer_num * (per_layer + 16384) + bases + 65536
        self._slot_copy = SlotCopy(self.k_buffer, self.v_buffer, self.page_size,
                                   self.store.pack_kernel, lambda page: int(self.hot_page_of[page]))
        # the boundary's two kernels compiled now, not in the step of the first page
        self._slot_copy.warm()
        self.store.prepare_adoption()
        return DaemonClient(self.cfg, self.layer_num, self.head_num, self.head_dim,
                            self.k_buffer[0].dtype, self.device, self.dense.spec, result_bytes,
                            self._slot_copy, self.store.reads_host)

    def cold_waiting(self) -> bool:
        """Are sealed pages waiting to be found cold (`recompress_cold`)?"""
        return bool(self._cold_queue)

    def recompress_cold(self, warm: set[int]) -> int:
        """Between steps (`cold.enabled`): up to `cold.pages_per_step` sealed pages not in
        `warm` (the pages a running request has within its last `cold.after_tokens` tokens)
        and past the sink segments, oldest seal first, re-encoded with cheaper cold candidates
        (codec/cold.py) and stored again: blocks freed, the new, smaller ones written, headers
        and page metadata rewritten, every byte re-counted. With the daemon running they go to
        its workers as one cold job (their results adopted at a later boundary, like sealed
        pages: `_finish_cold`); else here. The same pages on every TP rank (sealed sets and
        running requests agree; the layouts chosen are per rank, like sealing's). Returns pages
        recompressed here or sent."""
        if self._cold_cands is None:
            return 0
        chosen = self._cold_pages(warm)
        if chosen and self.daemon is not None and not self.daemon.broken:
            self.daemon.submit_cold(chosen, [self.page_gen[p] for p in chosen],
                                    [self.sealed[p].position for p in chosen],
                                    [self._cold_payload(p) for p in chosen])
            return len(chosen)
        return sum(self._recompress_page(page) for page in chosen)

    def _cold_payload(self, page: int):
        """A sealed page as a cold job carries it to a worker: arena-ready (its blocks as the
        store holds them), without bases (re-encoding stays in the SVD basis)."""
        sp = self.sealed[page]
        flat = SealedPage(sp.position, list(sp.segments), None, sp.nbytes)
        return pack_page(flat, self.cfg.page_tokens) or flat

    def _cold_pages(self, warm: set[int]) -> list[int]:
        """The pages `recompress_cold` takes now (marked done: taken once per seal)."""
        chosen, scanned = [], 0
        limit = self.cfg.cold.pages_per_step
        while self._cold_queue and len(chosen) < limit and scanned < 4 * limit:
            page, gen = self._cold_queue.popleft()
            scanned += 1
            if self.page_gen[page] != gen or page not in self.sealed or page in self.cold_done:
                continue
            if self.sealed[page].position < self.cfg.sink_segments * self.cfg.segment_tokens:
                continue  # attention sinks keep their own candidates and tight budget
            if page in warm or page in self.kept_hot:
                self._cold_queue.append((page, gen))  # not cold yet: later
                continue
            self.cold_done.add(page)
            chosen.append(page)
        return chosen

    def _recompress_page(self, page: int) -> int:
        sp = self.sealed[page]
        fresh = recompress_page(sp.position, sp.segments, sp.bases, self.cfg, *self._cold_cands)
        if fresh is None:
            self.counters.cold_kept += 1
            return 0
        for seg in fresh.segments:  # off the arena blocks about to be freed and rewritten
            own_storage(seg)
        self._adopt_cold(page, fresh)
        return 1

    def _adopt_cold(self, page: int, fresh) -> None:
        """A re-encoding of sealed `page` (here: a SealedPage; from a worker: an ArenaPage, or a
        SealedPage) in place of what the store holds: the old blocks freed, the new ones
        written, every byte re-counted."""
        sp = self.sealed[page]
        self._count_strategies(sp, -1)
        self._account(sp, -1)
        self.store.release(page)
        stored = self.store.store_pages([page], [fresh])[0]
        self.sealed[page] = SealedPage(sp.position, stored, sp.bases, fresh.nbytes)
        self._count_strategies(fresh, +1)
        self._account(self.sealed[page], +1)
        self.version += 1
        self.counters.cold_pages += 1
        self.counters.cold_saved_bytes += sp.nbytes - fresh.nbytes

    def _finish_cold(self, job, results: list | None) -> None:
        """A cold job leaves the daemon: each page still sealed as it was sent (same
        generation) takes its result (`_adopt_cold`; KEPT: counted); without results (a worker
        error, a broken daemon) the pages are re-encoded here. Pages freed or reused since are
        dropped (counted as discarded)."""
        from ..daemon.client import KEPT

        self.daemon.retire(job)
        for i, (page, gen) in enumerate(zip(job.pages, job.gens)):
            if self.page_gen[page] != gen or page not in self.sealed:
                self.daemon.counters.discarded_pages += 1
            elif results is None:
                self._recompress_page(page)
            elif results[i] is KEPT:
                self.counters.cold_kept += 1
            else:
                self._adopt_cold(page, results[i])

    def refresh_byte_gate(self, free_slots: int, tp_group=None) -> int:
        """Between steps (the scheduler hook, after the daemon's adoption): the free token slots
        the arena's bytes cannot back (`sizing.byte_deficit`), which the allocator's
        available_size subtracts. The same on every TP rank: ranks hold different bytes (per-head
        layouts), so the largest deficit is agreed on the CPU group, only when its inputs moved
        (the page table's version and the free slots change alike on every rank)."""
        key = (self.version, free_slots)
        if key == self._gate_version:
            return self.byte_deficit
        self._gate_version = key
        allocated = self.logical_size // self.page_size - free_slots // self.page_size
        # bases past their reserve are memory the plan gave the arena: the gate backs fewer
        # pages by them (a flood of short requests, each holding a whole pair for a few pages,
        # took 4.3 GB past the reserve on an H100 soak, 2026-12-07, outside any gate)
        deficit = byte_deficit(free_slots, max(0, allocated - len(self.sealed)),
                               self.store.page_fits(self.bases_over_reserve()), self.page_size)
        if tp_group is not None:
            import torch.distributed as dist

            agreed = torch.tensor([deficit], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=tp_group)
            deficit = int(agreed)
        if deficit and not self.byte_deficit:
            self.counters.byte_limited += 1
            if self.counters.byte_limited == 1:
                logger.info("MosaicKV: the packed arena's free bytes back fewer tokens than the "
                            "free slots (%d of %d): admission waits for bytes (counted in stats,"
                            " capacity.byte_limited)", max(0, free_slots - deficit), free_slots)
        self.byte_deficit = deficit
        return deficit

    def bases_over_reserve(self) -> int:
        """Bytes the sealed pages' distinct bases take past the start-up plan's reserve for them
        (one pair per `basis_block_tokens` of sealed tokens): short requests and partial blocks
        hold a whole pair for a few pages."""
        return max(0, self.bases_bytes - self.bases_reserve_bytes)

    def longest_request(self) -> int:
        """Tokens of the longest request the empty pool can always seal: every page at the
        largest layout in the arena (the slots may promise more)."""
        return int(self.store.capacity // self.page_bytes.worst) * self.page_size

    def capacity(self) -> dict:
        """Tokens: slots, the byte gate, and what fits at the bytes pages really took."""
        live = self.store.layer_live
        packed = self.store.packed.sum(1).numpy()  # pages packed per layer
        per_page = live / np.maximum(packed, 1)  # measured bytes of a page, per layer
        expected = np.where(packed > 0, per_page, self.page_bytes.expected)
        st = self.store  # per arena group: its bytes over a page's bytes in its layers
        need = st.by_group(expected)
        fits = int((st.group_layers * st.capacity // need).min()) * self.page_size
        return {"slots": self.logical_size,
                "hot_buffer_tokens": self.num_hot_pages * self.page_size,
                "arena_bytes_per_layer": self.store.capacity,
                "arena_layers_per_group": int(st.group_layers.max()),  # sharing one allocator
                "page_bytes": {"best": self.page_bytes.best, "worst": self.page_bytes.worst,
                               "expected": self.page_bytes.expected,
                               "measured": float(per_page.max()) if packed.any() else None,
                               "dense": self.page_bytes.dense},
                # sealed tokens the arena holds at the measured (else expected) layout mix,
                # + the hot buffer: what the memory serves (the slots are an upper bound)
                "tokens_that_fit": fits + self.num_hot_pages * self.page_size,
                "byte_deficit": self.byte_deficit,
                # segments kept in their own tensors (not packable), charged to the arena
                "outside_bytes": int(self.store.outside_bytes.sum()),
                # the distinct bases of the sealed pages (outside the arena, inside arena_bytes)
                # vs the start-up reserve for them
                "bases": {"count": len(self._basis_refs), "bytes": self.bases_bytes,
                          "reserve_bytes": self.bases_reserve_bytes},
                "over_capacity": self.store.over_capacity,
                "byte_limited": self.counters.byte_limited,
                "plan": None if self.memory_plan is None else self.memory_plan.__dict__}

    def step_boundary(self, tp_group=None) -> int:
        """Step boundary (the scheduler hook): install what every rank has ready, relieve the
        hot buffer if it runs low. Returns the number of pages installed."""
        if self.daemon is None:
            return 0
        from ..daemon.boundary import step_boundary

        return step_boundary(self, tp_group)

    def _finish(self, jobs: list, results: list[list] | None = None,
                keep_hot: bool | None = None) -> int:
        """Jobs leave the daemon: install their live pages in one batch (`results`: each job's
        daemon results, in job order; None: sealed here from the hot buffer), then submit the
        pages that waited for their bases. Cold jobs (`recompress_cold`) go to `_finish_cold`.
        Returns pages installed."""
        if any(job.cold for job in jobs):
            for k, job in enumerate(jobs):
                if job.cold:
                    self._finish_cold(job, None if results is None else results[k])
            keep = [k for k, job in enumerate(jobs) if not job.cold]
            jobs = [jobs[k] for k in keep]
            results = None if results is None else [results[k] for k in keep]
        pages, sealed, taken = [], [], set()
        for k, job in enumerate(jobs):
            self.daemon.retire(job)
            live = [i for i, (p, g) in enumerate(zip(job.pages, job.gens))
                    if self.page_gen[p] == g and p not in self.sealed and p not in taken]
            for p in job.pages:
                if self.pending.get(p) is job:
                    del self.pending[p]
            self.daemon.counters.discarded_pages += len(job.pages) - len(live)
            if not live:
                continue
            if results is not None:
                sealed += [results[k][i] for i in live]
            else:
                live_pages = [job.pages[i] for i in live]
                with self._worker_threads():
                    sealed += seal_group(
                        lambda idx: self._read_pages([live_pages[i] for i in idx]),
                        [job.positions[i] for i in live], job.bases if job.bases_given else None,
                        self.cfg, self.cands, self.dense, keep_rotated=self.store.pack_kernel)
            pages += [job.pages[i] for i in live]
            taken.update(job.pages[i] for i in live)
        if pages:
            t = time.perf_counter()
            # position rule: pages sealed before their request reads them compressed keep their
            # hot copy until then (_drop_kept_hot), whoever sealed them; not under backpressure
            self._install(pages, sealed,
                          keep_hot=self.position_rule if keep_hot is None else keep_hot)
            if results is not None:  # a daemon result (else sealed here: timed by the caller)
                self.daemon.budget.note("install_store", time.perf_counter() - t, len(pages))
        for job in jobs:
            waiting = [(pos, p, g) for pos, p, g in self.deferred.pop(job.first, ())
                       if self.page_gen[p] == g]
            for _, p, _ in waiting:
                self.pending.pop(p, None)
            if waiting:
                first = job.first if job.first in self.sealed else waiting[0][1]
                self._seal(waiting, self.sealed[first].bases if first in self.sealed else None,
                           first)
        return len(pages)

    def installable(self, job, with_pages=()) -> bool:
        """A job's pages may enter `sealed` once every page before them is sealed (or no longer
        on its way: freed, or among `with_pages`, installed in the same batch), which keeps each
        request's sealed pages a prefix whatever order the workers finish in. Deterministic in
        the pool's state: every TP rank decides alike."""
        return all(p in self.sealed or p not in self.pending or p in with_pages
                   for p in job.needs)

    def next_to_seal(self, jobs: list):
        """Of open `jobs` (oldest first), the one to seal on this thread next (backpressure, a
        broken daemon): the first installable one, so requests' sealed pages stay prefixes.
        While the bookkeeping holds there always is one (a job's earlier pages are sealed, freed
        or in an older job); if none is, the oldest is taken, which may seal out of request
        order: logged and counted (`out_of_order_seals`), never silent."""
        job = next((j for j in jobs if self.installable(j)), None)
        if job is not None:
            return job
        job = jobs[0]
        self.daemon.counters.out_of_order_seals += len(job.pages)
        logger.error("MosaicKV daemon: no open job can be sealed in request order (%d open; "
                     "the oldest, pages %s, waits on %s); sealing it anyway. Please report with "
                     "the server log.", len(jobs), job.pages,
                     [p for p in job.needs if p not in self.sealed and p in self.pending])
        return job

    def _relieve(self, want_free: int) -> int:
        """Backpressure: seal the oldest pending jobs on this thread until `want_free` hot pages
        are free (or nothing is pending). Counted and logged; returns pages sealed."""
        done = 0
        while len(self.free_hot_pages) < want_free:
            jobs = [j for j in self.daemon.open_jobs() if not j.cold]  # those free no hot page
            if not jobs:
                break
            job = self.next_to_seal(jobs)
            self.daemon.cancel(job)  # a result still on its way is dropped when it comes
            n = self._finish([job], keep_hot=False)  # frees hot pages: that is the point
            self.daemon.counters.sync_seals_backpressure += n
            done += n
        if done:
            logger.warning("MosaicKV daemon behind: %d pages sealed on the scheduler thread "
                           "(hot buffer %d/%d pages free)", done, len(self.free_hot_pages),
                           self.num_hot_pages)
        return done

    # ---- frees --------------------------------------------------------------------------
    def release_pages(self, pages: list[int]) -> None:
        """Called by the allocator when logical pages return to its free list."""
        self.version += 1
        if self.decode_sealing:
            self._drop_decode_pages(pages)
        for page in pages:
            self.page_gen[page] += 1  # a result still in flight for it will be discarded
            self.pending.pop(page, None)
            self.prev_page.pop(page, None)
            self.kept_hot.discard(page)
            self.cold_done.discard(page)
            sealed = self.sealed.pop(page, None)
            if sealed is not None:
                self.page_sealed[page] = False
                self.page_basis_addr[page] = 0
                self._account(sealed, -1)
                self.store.release(page)
                self.counters.freed_pages += 1
            hot = int(self.hot_page_of[page])
            if hot > 0:  # 0: the padding page, never a free one
                self.free_hot_pages.append(hot)
                self.hot_page_of[page] = -1

    def clear(self) -> None:
        """Every logical page is free again (the allocator was reset): drop all state."""
        self.version += 1
        self.counters.freed_pages += len(self.sealed)
        self.page_gen = [g + 1 for g in self.page_gen]
        self.pending.clear()
        self.deferred.clear()
        self.prev_page.clear()
        self.kept_hot.clear()
        self.decode_sealing.clear()
        self.cold_done.clear()
        self._cold_queue.clear()
        self.prompt_lens.clear()
        if self.daemon is not None:
            for job in self.daemon.open_jobs():
                self.daemon.cancel(job)
        self.sealed.clear()
        self.page_sealed[:] = False
        self.page_basis_addr[:] = 0
        self.store.clear()
        self.arena_bytes = 0
        self.bases_bytes = 0
        self._basis_refs.clear()
        self.hot_page_of.fill_(-1)
        self.hot_page_of[0] = 0  # the padding page (see __init__)
        self.free_hot_pages = list(range(self.num_hot_pages, 0, -1))

    # ---- accounting ---------------------------------------------------------------------
    def _account(self, page: SealedPage, sign: int) -> None:
        """Running total of packed bytes: page bytes, plus bases while any page uses them."""
        key = page.bases.key()
        refs = self._basis_refs.get(key, 0) + sign
        if (sign > 0 and refs == 1) or (sign < 0 and refs == 0):
            self.arena_bytes += sign * page.bases.nbytes()
            self.bases_bytes += sign * page.bases.nbytes()
        if refs:
            self._basis_refs[key] = refs
        else:
            self._basis_refs.pop(key, None)
        self.arena_bytes += sign * page.nbytes
        if sign > 0 and self.arena_bytes > self.arena_budget_bytes:
            if not self.counters.arena_over_budget:
                self._warn_over_budget()
            self.counters.arena_over_budget += 1

    def _warn_over_budget(self) -> None:
        """The first seal that leaves `arena_bytes` above `arena_budget_bytes`: which part is
        over its share, the pages' own bytes (the arena and the tables: only segments kept
        outside the arena, dense fallbacks, can pass them) or their bases (the reserve assumes
        one pair per basis_block_tokens of sealed tokens)."""
        pages = self.arena_bytes - self.bases_bytes
        page_share = self.arena_budget_bytes - self.bases_reserve_bytes
        n = len(self._basis_refs)
        if self.bases_bytes > self.bases_reserve_bytes:
            why = (f"the {n} distinct bases the {len(self.sealed)} sealed pages use "
                   f"({len(self.sealed) / max(n, 1):.1f} pages each) take {self.bases_bytes} "
                   f"bytes, above the {self.bases_reserve_bytes} reserved for them (one pair per "
                   f"{self.cfg.basis_block_tokens} sealed tokens: short requests and partial "
                   "basis blocks hold a whole pair for a few pages; bases are outside the arena, "
                   "and the byte gate takes the excess from its free bytes)")
        else:
            why = "the bases are within their reserve"
        if pages > page_share:
            why += (f"; the pages' own bytes {pages} are above the arena and tables' "
                    f"{page_share} (segments kept outside the arena, e.g. dense fallbacks: "
                    f"{int(self.store.outside_bytes.sum())} bytes)")
        logger.warning("MosaicKV: packed pages and their bases use %d bytes, above the %d bytes "
                       "start-up sizing assumed: %s; counted in stats (arena_over_budget, "
                       "capacity.bases)", self.arena_bytes, self.arena_budget_bytes, why)

    def _hot_capacity_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_buffer + self.v_buffer)

    def summary(self) -> str:
        """One log line: what is kept and how well it is compressed. Logged from the sealing
        path, so it uses the running byte total instead of re-walking every tensor (stats())."""
        tokens = len(self.sealed) * self.page_size
        dense = tokens * self.layer_num * 2 * self.head_num * self.head_dim * 2
        ratio = f"{dense / self.arena_bytes:.2f}x" if self.arena_bytes else "-"
        hot_used = (self.num_hot_pages - len(self.free_hot_pages)) * self.page_size
        return (f"MosaicKV: {len(self.sealed)} sealed pages ({tokens} tokens, "
                f"{ratio} vs bf16 incl. metadata), "
                f"hot {hot_used}/{self.num_hot_pages * self.page_size} tokens, "
                f"reused {self.counters.reused_pages}, over-budget {self.counters.over_budget}, "
                f"arena {self.arena_bytes / 1e6:.1f}/{self.arena_budget_bytes / 1e6:.1f} MB, "
                f"bases {len(self._basis_refs)} ({self.bases_bytes / 1e6:.1f}/"
                f"{self.bases_reserve_bytes / 1e6:.1f} MB reserved)"
                + (self.daemon.summary() if self.daemon is not None else ""))

    def stats(self) -> dict:
        """Physical bytes by kind, measured from the tensors, plus counters."""
        by_kind = {"values": 0, "indices": 0, "scales": 0, "headers": 0, "page_meta": 0}
        bases = {}
        for page in self.sealed.values():
            bases[page.bases.key()] = page.bases.nbytes()
            for seg in page.segments:
                for kind, n in segment_bytes(seg).items():
                    by_kind[kind] += n
        sealed_tokens = len(self.sealed) * self.page_size
        compressed = sum(by_kind.values()) + sum(bases.values())
        dense_equiv = sealed_tokens * self.layer_num * 2 * self.head_num * self.head_dim * 2
        hot_used = (self.num_hot_pages - len(self.free_hot_pages)) * self.page_size
        return {
            "bytes": {**by_kind, "bases": sum(bases.values()),
                      "hot_buffer_capacity": self._hot_capacity_bytes()},
            "sealed_tokens": sealed_tokens,
            "sealed_pages": len(self.sealed),
            "hot_tokens_in_use": hot_used,
            "hot_tokens_capacity": self.num_hot_pages * self.page_size,
            # decode_seal_layers: pages sealing in slices now (read dense, hot, until installed)
            "decode_seal_pending_pages": len(self.decode_sealing),
            "sealed_bytes_per_token": compressed / sealed_tokens if sealed_tokens else None,
            "dense_bytes_per_token": self.layer_num * 2 * self.head_num * self.head_dim * 2,
            "sealed_ratio": dense_equiv / compressed if compressed else None,
            "arena_bytes": self.arena_bytes,  # == compressed: kept incrementally
            # working memory outside the arena: open blocks' R^-1 kept between seals
            "write_transforms": self.write_cache.stats(),
            "arena_budget_bytes": self.arena_budget_bytes,
            "capacity": self.capacity(),
            "counters": {**self.counters.__dict__, "strategies": dict(self.counters.strategies),
                         "sealed_by_position": list(self.counters.sealed_by_position),
                         "reused_by_position": list(self.counters.reused_by_position)},
            "daemon": None if self.daemon is None else {
                **self.daemon.stats(), "swaps": self.swaps.stats(),
                # device bytes a page takes on its way to a slot (freed once copied)
                "staging_bytes_per_page": self._slot_copy.staging_bytes(),
                "slot_copies": "torch" if self._slot_copy.gather is None else "kernel"},
            # The kernel-readable arena: reserved at start-up for the worst layout on every
            # logical page (what the GPU holds) vs the blocks live now (inside arena_bytes).
            "decode": {**({} if self.decode_path is None else self.decode_path.stats()),
                       "selection_reference": self.reference_reads.stats()},
            "prefill": {"profile": self.prefill_timer.report(),
                        # the chunk attention's kernel and its (request, layer) calls
                        "attention": dict(self.prefill_attention)},
            "segment_store": {"reserved_bytes": self.store.reserved_bytes(),
                              "live_block_bytes": self.store.live_bytes,
                              "packed_segments": int(self.store.packed.sum()),
                              "unpacked_segments": len(self.sealed) * self.layer_num
                              - int(self.store.packed.sum()),
                              "arena_full_segments": self.store.arena_full,
                              # who wrote the blocks: the GPU pack kernel or torch copies
                              "pack_kernel": self.store.pack_kernel,
                              "packed_by": dict(self.store.pack_counts),
                              # block layouts seen, and the band decode kernel's variants
                              "layouts": len(self.store.layouts),
                              "decode_width_classes": len(self.store.width_classes)},
        }
