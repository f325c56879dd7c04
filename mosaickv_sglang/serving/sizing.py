"""Pool sizing and the byte gate: how a MosaicKV pool's memory is split at start-up, and how many
more tokens its free packed bytes admit while it serves.

Start-up (`PageBytes`, `slot_fraction`, `plan_memory`): SGLang divides the KV memory by a bytes
per token cell; MosaicKV's cell is the bytes a logical token slot costs when its page is sealed
at the *smallest* candidate layout (plus the per-page tables every slot pays, and the hot
buffer's share when `hot_buffer_fraction` is set), so logical slots are an upper bound and the
packed arena's bytes, not the slot count, decide how many tokens fit. The memory then splits
into the dense hot buffer (by default sized to what is in flight: one prefill chunk plus the
last page of `hot_buffer_requests` running requests, `auto_hot_tokens`), the per-page tables,
a reserve for the SVD bases, and the arena (the rest, shared by the layers).

Serving (`byte_deficit`): every sealed page takes the bytes its chosen layout needs and gives
them back when freed. Between scheduler steps the pool turns its arena's free bytes into the
tokens they still admit, priced at the *largest* layout a page can take, with every allocated
page not sealed yet (hot, or about to be) priced the same: a page admitted can always be sealed
into the arena. The slots the bytes cannot back are the pool's `byte_deficit`; the allocator's
`available_size` (what SGLang's admission, prefix eviction and decode retraction read) is the
free slots minus that deficit, so when the bytes run out requests wait or are retracted and
resumed by SGLang's own scheduler, never an OOM or a lost request (docs/serving.md, capacity).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..codec.arena import ALIGN, HEADER_WIDTH, _align, band_parts
from ..codec.pages import build_page_meta
from ..codec.seal import worst_encoded_bytes
from ..codec.strategies import parse_strategy
from ..codec.strategies.band import Band
from ..config import MosaicConfig, check_encodable


def _kind_bytes(spec: str, kind: str, heads: int, tokens: int, head_dim: int) -> int:
    """Bytes one candidate keeps for one layer's K or V of a page: a band as the arena lays it
    out (aligned parts per head), any other strategy as its encoded tensors."""
    strategy = parse_strategy(spec)
    if isinstance(strategy, Band):
        return heads * sum(_align(n) for _, n in band_parts(strategy, tokens, head_dim))
    return worst_encoded_bytes([spec], kind, heads, tokens, head_dim)


def _encodable(specs, tokens: int, head_dim: int) -> list[str]:
    """The rescue candidates the pool keeps (`config.fit_rescue`, which logs the others)."""
    out = []
    for spec in specs:
        try:
            check_encodable(spec, "kv", tokens, head_dim)
            out.append(spec)
        except ValueError:
            pass
    return out


@dataclass(frozen=True)
class PageBytes:
    """Bytes of one page (`segment_tokens` tokens) in one layer, by what holds them."""
    best: int  # the smallest K + V candidate pair: what sizes the logical slots
    expected: float  # mean K candidate + mean V candidate: an estimate before pages are sealed
    worst: int  # the largest any candidate can take (K/V, sink, rescue): what admission prices
    table: int  # per logical page, sealed or not: header row, page metadata, flags
    bases: float  # the K and V bases of a basis block, amortized per page
    dense: int  # the same page at the cache's dtype (K and V)

    @classmethod
    def of(cls, cfg: MosaicConfig, heads: int, head_dim: int,
           dtype_bytes: int = 2) -> "PageBytes":
        s = cfg.segment_tokens

        def sizes(specs, kind):
            return [_kind_bytes(spec, kind, heads, s, head_dim) for spec in specs]

        k, v = sizes(cfg.k_candidates, "k"), sizes(cfg.v_candidates, "v")
        extra = [*cfg.sink_candidates, *_encodable(cfg.rescue_candidates, s, head_dim)]
        worst = max(max(k), *sizes(extra, "k")) + max(max(v), *sizes(extra, "v")) \
            if extra else max(k) + max(v)
        meta = build_page_meta(torch.randn(heads, s, head_dim), cfg.page_tokens,
                               cfg.select.meta_channels).nbytes() if cfg.select.enabled else 0
        return cls(best=min(k) + min(v), expected=float(np.mean(k) + np.mean(v)), worst=worst,
                   table=HEADER_WIDTH * 4 + meta + 1 + 8,
                   bases=2 * heads * head_dim * head_dim * 2 * s / cfg.basis_block_tokens,
                   dense=2 * heads * s * head_dim * dtype_bytes)


def slot_fraction(cfg: MosaicConfig, pb: PageBytes) -> float:
    """Bytes per logical token slot / dense bytes per token: a page sealed at the smallest
    layout with its tables and bases' share, plus the hot buffer's share when it is a fixed
    fraction of the slots (`hot_buffer_fraction` > 0; by default the hot buffer is carved out
    of the memory instead, `plan_memory`)."""
    return cfg.hot_buffer_fraction + (pb.best + pb.table + pb.bases) / pb.dense


def window_tokens(cfg: MosaicConfig) -> int:
    """The read rule's dense window as start-up sizing must see it (the pool's `dense_window`):
    `hot_tokens`, plus `daemon_lag_tokens` under the position rule with the daemon. Under
    either rule a page ending less than the window before a request's next token stays hot
    beside its last page (`compressed_pages`): up to ceil(window / page) more pages per
    request. (Sizing the chunk rule with no window let 65 running RULER requests, each holding
    two pages, exhaust a 16384-token buffer on an H100, 2026-12-07.)"""
    lag = cfg.daemon_lag_tokens if cfg.daemon == "process" and cfg.read_rule == "position" else 0
    return cfg.hot_tokens + lag


def auto_hot_tokens(cfg: MosaicConfig, page_size: int, chunked_prefill_size: int | None,
                    context_len: int, window_tokens: int) -> int:
    """The hot buffer that holds what is in flight: one prefill chunk's pages (a chunk is at
    most context - 1 tokens) plus the read rule's dense window, and one page (+ its window) for
    each of `hot_buffer_requests` other running requests (`hot_buffer_requests` in pool.py caps
    the scheduler to what fits)."""
    need, extra = in_flight_pages(page_size, chunked_prefill_size, context_len, window_tokens)
    return (need + cfg.hot_buffer_requests * (1 + extra)) * page_size


def in_flight_pages(page_size: int, chunked_prefill_size: int | None, context_len: int,
                    window_tokens: int) -> tuple[int, int]:
    """(hot pages one prefill chunk needs, its dense window included; the window's pages, which
    every other running request keeps hot beside its last page)."""
    chunk = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 \
        else context_len
    extra = -(-window_tokens // page_size)
    return -(-min(chunk, context_len - 1) // page_size) + extra, extra


def slot_memory(cfg: MosaicConfig, pb: PageBytes, slots: int, layers: int,
                page_size: int) -> int:
    """The memory SGLang sizes `slots` with (`slot_fraction` of dense per slot)."""
    return int(slots * slot_fraction(cfg, pb) * pb.dense / page_size * layers)


def hot_buffer_bytes(pb: PageBytes, hot_tokens: int, layers: int, page_size: int) -> int:
    """The dense hot buffer's bytes (K and V, every layer, + SGLang's padding page)."""
    return (hot_tokens + page_size) * pb.dense // page_size * layers


@dataclass(frozen=True)
class MemoryPlan:
    """How a pool of `slots` logical token slots spends its memory (bytes)."""
    slots: int
    hot_tokens: int
    hot_bytes: int  # the dense hot buffer (K and V, every layer, + SGLang's padding page)
    table_bytes: int  # per-page tables of every logical page, every layer
    bases_bytes: int  # reserved for the SVD bases (not in the arena)
    arena_bytes: int  # per layer
    total: int  # what the plan spends (== the memory the cell gave, to alignment)


def plan_memory(cfg: MosaicConfig, pb: PageBytes, slots: int, layers: int, page_size: int,
                hot_tokens: int, memory: int | None = None) -> MemoryPlan:
    """Split `memory` bytes (default: what SGLang gave for `slots` at `slot_fraction`) into the
    hot buffer, the tables, the bases reserve and per-layer arenas. Raises ValueError, naming
    the knobs, when the hot buffer and the tables leave no arena."""
    if memory is None:
        memory = slot_memory(cfg, pb, slots, layers, page_size)
    pages = slots // page_size + 1
    hot = hot_buffer_bytes(pb, hot_tokens, layers, page_size)
    tables = pages * pb.table * layers
    rest = memory - hot - tables
    if rest <= 0:
        raise ValueError(
            f"MosaicKV: the hot buffer ({hot_tokens} tokens, {hot / 1e6:.1f} MB dense) and the "
            f"page tables ({tables / 1e6:.1f} MB) take all of the {memory / 1e6:.1f} MB the KV "
            f"cache has for {slots} token slots: give the cache more memory (--max-total-tokens,"
            f" --mem-fraction-static), lower --chunked-prefill-size or hot_buffer_requests "
            f"(now {cfg.hot_buffer_requests}), or set a smaller hot_buffer_fraction")
    # bases come with sealed pages: their share of what the rest holds at the expected layout
    bases = int(rest * pb.bases / (pb.bases + pb.expected))
    arena = (rest - bases) // layers // ALIGN * ALIGN
    return MemoryPlan(slots, hot_tokens, hot, tables, bases, arena,
                      hot + tables + bases + arena * layers)


def byte_deficit(free_slots: int, unsealed_pages: int, page_fits: np.ndarray,
                 page_size: int) -> int:
    """Free token slots the arena's bytes cannot back (>= 0): per arena group (the layers
    sharing one allocator, `SegmentStore.page_fits`), the pages of the largest layout its free
    bytes hold for sure less the allocated pages not sealed yet (`unsealed_pages`, priced the
    same); the fullest group decides."""
    admit = (int(np.min(page_fits)) - unsealed_pages) * page_size
    return max(0, free_slots - max(admit, 0))
