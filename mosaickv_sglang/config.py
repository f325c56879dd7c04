"""MosaicKV configuration: one validated dataclass, built from a dict, JSON text or ``@file``.

Unknown keys and bad values are rejected with the offending key named: a typo must never turn
into a silently different (or dense) cache.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from .codec.strategies import parse_strategy

logger = logging.getLogger(__name__)

# Candidates the chooser may pick from, cheapest-first is decided by measured bytes, not order.
# Candidates for ordinary segments (the chooser takes the cheapest, by measured bytes, whose
# reconstruction error is within budget; order does not matter). Bands in the SVD basis: 3.75,
# 4.5 and 5.5 bits per scalar including scales. Measured on SmolLM2 KV: benchmarks/RESULTS.md.
DEFAULT_K_CANDIDATES = (
    "band:b8=4,b4=44,b2=16,group=128",
    "band:b8=4,b4=60,b2=0,group=128",
    "band:b8=16,b4=48,b2=0,group=64",
)
DEFAULT_V_CANDIDATES = (
    "band:b8=0,b4=48,b2=16,group=128",
    "band:b8=4,b4=60,b2=0,group=128",
    "band:b8=16,b4=48,b2=0,group=64",
)
# The attention-sink segment: 8 bits on every rotated channel (per channel per 32 tokens, as the
# packed kernel reads it) if that is within sink_error_budget, else dense bf16.
DEFAULT_SINK_CANDIDATES = ("band:b8=64,b4=0,b2=0,group=32",)
# Tried for a segment no candidate fits, before the dense fallback: an 8-bit band is ~2x smaller
# than bf16 and, unlike dense, readable by the decode kernel (a dense segment sends its whole
# request to the torch reference path on the GPU).
DEFAULT_RESCUE_CANDIDATES = ("band:b8=64,b4=0,b2=0,group=32",)


DECODE_KERNELS = ("auto", "triton", "reference")
PREFILL_ATTENTIONS = ("auto", "flashinfer", "sdpa")
PACK_KERNELS = ("auto", "triton", "torch")
ENCODE_KERNELS = ("torch", "triton")
ARENAS = ("shared", "per_layer")
CHOOSERS = ("auto", "cascade", "errors_first")
FIT_SOLVERS = ("auto", "host", "device", "jacobi", "jacobi_tf32", "identity")
READ_RULES = ("position", "chunk")
BASIS_FITS = ("first_page", "group")


# page_rescore's candidate layouts (`mosaickv_kernels.page_rescore.LAYOUTS`, the same tuple:
# tests/test_page_rescore_kernel.py; config does not import the kernels)
RESCORE_LAYOUTS = ("rows", "columns", "bands")


@dataclass
class SelectionConfig:
    """Sequence dimension: which compressed pages a decode step reads."""
    enabled: bool = True
    budget_tokens: int = 4096  # compressed tokens read per step (sink + recent included)
    sink_tokens: int = 64
    recent_tokens: int = 256
    meta_channels: int = 8  # channels with per-page min/max (the rest: one norm bound)
    # 0: pages chosen by their metadata bound. k > 0 (default 4): the bound keeps k x the
    # budget's pages as candidates, which are re-ranked by their best score on the compressed K
    # itself (the kernels' second stage, `page_rescore`; docs/evaluation.md). With the position
    # rule's first-page bases it took the 8K cells from 24 points lost to none (RULER, H100,
    # 2026-12-07: benchmarks/results/ruler_h100_2026-12-07_decide/)
    rescore_factor: int = 4
    # what the second stage scores a candidate page by: false = every channel of its compressed
    # K (reads the candidates' whole K); true = only its metadata channels' codes, exactly, plus
    # the page's rest-norm bound for the other channels (reads m channels of the candidates' K)
    rescore_meta_only: bool = False
    # > 0: the second stage scores a candidate page by the exact score on the leading this many
    # channels of its compressed K in the SVD basis (where K's energy is), nothing for the rest:
    # how much of K a second stage must read (default 32, the codec probe's best; 0 = every
    # channel)
    rescore_channels: int = 32
    # how the decode kernels' `page_rescore` (graph and eager) lays out one candidate: "bands"
    # (default: one warp, band by band from the segment's header, no plan entry loaded, a code
    # byte read once for its 2 or 4 channels), "columns" (one warp, channel by channel through
    # the layout's per-channel plan) or "rows" (four warps over a [G, 32, R] product reduced
    # over R). Measured alone in CUDA graphs on an H100 (2026-12-08, page_rescore_bench.py,
    # each at its best block): bands 11.5 / 60.1 / 112.4 us at 1 x 128K / 8 x 128K / 17 x 32K,
    # columns 16.7 / 86.5 / 170.6, rows 26.2 / 173.1 / 355.7 (rows with 16 candidates per
    # program, the former default: 33.7 / 188.9 / 373.3). The same scores up to the order of
    # the channel sums (tests/test_page_rescore_kernel.py).
    rescore_layout: str = "bands"

    def validate(self, page_tokens: int) -> None:
        if self.rescore_layout not in RESCORE_LAYOUTS:
            raise ValueError(f"mosaickv config: select.rescore_layout={self.rescore_layout!r} "
                             f"must be one of {RESCORE_LAYOUTS}")
        for key in ("budget_tokens", "sink_tokens", "recent_tokens", "meta_channels",
                    "rescore_factor", "rescore_channels"):
            if getattr(self, key) < 0:
                raise ValueError(f"mosaickv config: select.{key}={getattr(self, key)} must be >= 0")
        if self.rescore_channels and self.rescore_meta_only:
            raise ValueError("mosaickv config: select.rescore_channels and select.rescore_meta_only"
                             " are two different second stages: set one")
        if self.rescore_channels and not self.rescore_factor:
            raise ValueError("mosaickv config: select.rescore_channels scores the second stage, "
                             "which needs select.rescore_factor > 0")
        if self.budget_tokens < page_tokens:
            raise ValueError(f"mosaickv config: select.budget_tokens={self.budget_tokens} is "
                             f"smaller than one page ({page_tokens} tokens)")


@dataclass
class ColdConfig:
    """Recompression of cold pages (serving, read_rule "chunk"): a sealed page no running request
    has within its last `after_tokens` tokens is re-encoded, between scheduler steps, with the
    cheapest cold candidate whose error, added to the error it was sealed with, stays within the
    cold budget (a bound on its error against the original K/V); pages no cold candidate fits
    stay as they are (counted). docs/serving.md, capacity."""
    enabled: bool = False
    after_tokens: int = 2048
    # Real SmolLM2 K/V at 8K (pages past the second, 2026-12-04): sealed at 0.053 (K) and 0.091
    # (V) mean error; these add 0.112 and 0.160 for 0.234 of bf16 each (from ~0.28); 2-bit on
    # half the channels adds 0.139 (K) and 0.253 (V) for 0.219 / 0.203 (docs/serving.md)
    k_candidates: list[str] = field(default_factory=lambda: ["band:b8=4,b4=36,b2=24,group=128"])
    v_candidates: list[str] = field(default_factory=lambda: ["band:b8=0,b4=48,b2=16,group=128"])
    k_error_budget: float = 0.20
    v_error_budget: float = 0.30
    pages_per_step: int = 8  # pages recompressed at one step boundary, at most

    def validate(self, page_tokens: int) -> None:
        from .codec.strategies.band import Band

        for key in ("after_tokens", "pages_per_step"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"mosaickv config: cold.{key}={getattr(self, key)!r} must be an "
                                 "int >= 1")
        for key in ("k_error_budget", "v_error_budget"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"mosaickv config: cold.{key}={getattr(self, key)!r} must be >= 0")
        for key in ("k_candidates", "v_candidates"):
            for i, spec in enumerate(getattr(self, key)):
                strat = parse_strategy(spec)
                if not (isinstance(strat, Band) and strat.rot and strat.group % page_tokens == 0):
                    raise ValueError(f"mosaickv config: cold.{key}[{i}] '{spec}' must be a band "
                                     f"in the SVD basis with a token group that is a multiple of "
                                     f"page_tokens={page_tokens} (what the decode kernel reads)")


@dataclass
class MosaicConfig:
    segment_tokens: int = 128  # sealing / strategy granularity
    page_tokens: int = 32  # selection granularity (divides segment_tokens)
    basis_block_tokens: int = 4096  # one SVD basis per (layer, KV head) per this many tokens
    # The dense window: a decode token reads dense every page ending less than this many tokens
    # before it (docs/determinism.md); under read_rule "position" the window is anchored at the
    # prompt's end for prompt tokens (they read the prompt's last hot_tokens dense, and their
    # own page) and slides for generated ones (the radix tree holds a request's last
    # hot_tokens prompt tokens back from its matches and inserts: it computes them itself).
    # 0 (default, with the position rule): what RULER measured; the chunk rule used 64.
    hot_tokens: int = 0
    # Serving: the dense hot buffer. 0 (default): sized to what is in flight, one prefill chunk
    # plus the last page of `hot_buffer_requests` other running requests, carved out of the KV
    # memory; > 0: this fraction of the logical token slots, as its own share of every slot.
    hot_buffer_fraction: float = 0.0
    hot_buffer_requests: int = 64  # the auto hot buffer's running requests beside a chunk
    sink_segments: int = 1  # first segments (attention sinks): own candidates and a tight budget
    sink_candidates: list[str] = field(default_factory=lambda: list(DEFAULT_SINK_CANDIDATES))
    sink_error_budget: float = 0.01  # over it (or with no candidates) a sink segment stays dense
    k_candidates: list[str] = field(default_factory=lambda: list(DEFAULT_K_CANDIDATES))
    v_candidates: list[str] = field(default_factory=lambda: list(DEFAULT_V_CANDIDATES))
    # Segments that no K/V/sink candidate fits try these (same budget) before going dense; chosen
    # ones are counted as "rescued" (reason), the rest as over-budget.
    rescue_candidates: list[str] = field(default_factory=lambda: list(DEFAULT_RESCUE_CANDIDATES))
    # Max relative reconstruction error per segment. 0.12 / 0.20 (were 0.08 / 0.12): with the
    # second stage the looser budgets bought 3.69x vs 3.46x physical at no measured RULER cost
    # (1.85 points vs 2.10; benchmarks/results/ruler_h100_2026-12-07_decide/).
    k_error_budget: float = 0.12
    v_error_budget: float = 0.20
    select: SelectionConfig = field(default_factory=SelectionConfig)
    cold: ColdConfig = field(default_factory=ColdConfig)
    # "off": pages are compressed on the scheduler thread when the read rule first reads them
    # compressed. "process": CPU worker processes compress them (mosaickv_sglang/daemon/); under
    # the chunk rule pages are read hot until adopted between steps, under the position rule
    # full pages go to the workers daemon_lag_tokens ahead of need.
    daemon: str = "off"
    # daemon "process", read_rule "position" only: the workers' slack. Pages holding generated
    # tokens are read dense this many tokens longer (added to hot_tokens) and go to the workers
    # when full; prompt pages are read compressed by every later token, sealed inline (in the
    # prefill forward), never sent. A page still with the workers when its request reads it
    # compressed is sealed on the scheduler thread (counted: sync_seals_needed). Outputs stay
    # independent of the daemon's speed, and of who cached a reused prefix (prompt pages of
    # the request reusing it: read compressed as the cache holds them; docs/determinism.md).
    daemon_lag_tokens: int = 128
    # read_rule "chunk" with daemon "off" only: a page a decode step makes sealable is sealed
    # this many layers per decode step (between steps, where decode seals) and installed after
    # its last layer; until then it is read dense from the hot buffer, as the chunk rule reads
    # any page not sealed yet, so it only stays hot a few steps longer (ceil(layers / this)).
    # 0: every layer at once, in one step (sealing a Llama-8B page's 32 layers at once stalled
    # one decode step by ~60 ms on the H200: ITL p99 62 ms vs p50 6.5 ms). Ignored (logged)
    # under the daemon or the position rule. docs/serving.md, "Decode sealing in slices".
    decode_seal_layers: int = 0
    daemon_workers: int = 2  # worker processes per scheduler rank
    daemon_threads: int = 1  # torch intra-op threads per worker
    daemon_queue_segments: int = 64  # shared-memory page slots (pages in flight to the workers)
    # Backpressure: when fewer than this fraction of hot pages is free at a step boundary, the
    # oldest pending pages are sealed on the scheduler thread (counted, logged).
    daemon_hot_watermark: float = 0.125
    daemon_timeout_s: float = 120.0  # a busy worker silent this long is killed and restarted
    # Share of a step the daemon's work at a step boundary (copying pages into slots, reading
    # results not read in place, after the boundary's install batch) may take on the scheduler
    # thread; the first operation of a boundary always runs. Lower: flatter step times, fewer
    # pages adopted per second.
    daemon_boundary_share: float = 0.04
    # Pages installed together at one boundary (one adoption launch): ready pages wait until
    # this many are installable or the oldest waited this many boundaries. 1: one job a
    # boundary. 4 doubled the daemon's pages/s on the H200 (to its workers' bound); a lower
    # value trades pages/s for a shorter longest boundary (benchmarks/RESULTS.md, daemon).
    daemon_install_batch: int = 4
    # Niceness of the worker processes (0-19): they should only take cores the scheduler, the
    # tokenizer and the CUDA driver leave idle, never delay a decode step's host work.
    daemon_nice: int = 19
    # Decode over sealed pages: "triton" (the packed kernels), "reference" (the torch codec), or
    # "auto" (triton on CUDA, reference elsewhere). Segments the kernel cannot read (a dense
    # fallback, a non-band sink) send their request through the reference path, counted.
    decode_kernel: str = "auto"
    # A prefill chunk's attention over its request's whole sequence (the compressed prefix read
    # back, then its dense tokens): "flashinfer" (FlashInfer's single-request prefill kernel,
    # GQA and the bottom-right causal mask inside it; CUDA only, an error elsewhere), "sdpa"
    # (torch's scaled_dot_product_attention: its efficient kernel with a lower-right mask and
    # the KV heads repeated after a prefix), or "auto" (flashinfer on CUDA where it imports,
    # else sdpa; a CUDA server without FlashInfer logs that it runs sdpa). Same math, other
    # speed: stats()["prefill"]["attention"] names the kernel and counts its calls. Default
    # "auto": FlashInfer's kernel passed its GPU tests (H100, 2026-12-06), takes an 8192-token
    # chunk after a 24K-120K prefix in ~0.5x SDPA's time, and through the server a 1 x 128K
    # prompt's TTFT fell from 21.6 to 14.4 s, same greedy output (H100, 2026-12-06, one call:
    # benchmarks/results/h100_2026-12-06g_prefill_ab_fp8_gate/).
    prefill_attention: str = "auto"
    # Profiling: every Nth decode step on the kernels is timed phase by phase (host plan, bases,
    # hot gather, selection, kernels, merge, seal) with a device sync between phases, and, when
    # N > 0, every prefill step too (read prefix, attention, seal); 0 = off. The syncs slow the
    # sampled steps only; averages and the slowest steps are in stats()["decode"]["profile"]
    # and stats()["prefill"]["profile"].
    decode_profile_every: int = 0
    # Who writes a sealed segment's band codes and scales into the packed arena: "triton" (the
    # GPU pack kernel encodes them there from the chooser's rotated K/V, one launch per layout
    # and kind per install batch), "torch" (the chooser's encoded tensors staged and copied in),
    # or "auto" (triton on CUDA). The same choice moves the daemon's bytes on the scheduler
    # thread: a hot page into a slot (`page_gather`) and an adopted page into the store
    # (`row_copy`: blocks, headers, metadata), one launch each, or torch slices. Same bytes
    # either way; stats() counts segments per path.
    pack_kernel: str = "auto"
    # How the packed arena's bytes are shared: "shared" (every layer's blocks come from one
    # range and one allocator, as many layers as an int32 header addresses), or "per_layer" (an
    # equal range each). Layers compress unequally (the chooser picks per segment); with equal
    # ranges the fullest layer refused pages while others had bytes free (docs/serving.md).
    arena: str = "shared"
    # How the chooser finds each segment's cheapest candidate within budget: "cascade" encodes
    # the candidates cheapest first, each for the segments no cheaper one fitted (one host sync
    # per candidate tried); "errors_first" checks every candidate's error without encoding it
    # (`band_errors`, one Triton launch per candidate), brings the errors to the host once and
    # encodes each segment with its pick only; "auto": errors_first on CUDA when every
    # candidate is a band it reads (group a multiple of 32 tokens), else cascade. The same picks
    # but for a segment whose error is within float32 rounding of its budget (the kernel sums in
    # its own order). docs/codec.md, "The chooser on the GPU".
    chooser: str = "auto"
    # Who encodes a band candidate for the segments that picked it under the errors-first
    # chooser: "torch" (`Band.encode_decoded`, ~30 launches per band) or "triton" (one
    # `band_encode` launch per candidate and kind: the same bytes and reconstruction, bit for
    # bit on the CPU interpreter, tests/test_band_encode_kernel.py). Opt-in until its GPU tests
    # and the sealing bench have run on a GPU.
    encode_kernel: str = "torch"
    # How a basis block's bases are fitted: "host" (exact eigh/qr; GPU pages are copied to the
    # CPU, LAPACK over host threads), "device" (exact eigh/qr by cuSOLVER, one matrix at a time),
    # "jacobi" (codec/basis.jacobi_axes: batched GEMMs + one batched Cholesky, wherever the
    # pages are; top-r energy within 0.2% of eigh's, measured in docs/codec.md), or "auto" (jacobi
    # for pages on a GPU, where it fits a Llama-8B block 18x faster than host on the H200;
    # host for CPU pages, where LAPACK is 5x faster than jacobi). CPU pages are fitted on the
    # CPU with host and device alike. "identity" fits nothing: every basis is the identity, i.e.
    # no rotation (the no_rotation ablation; bands then take raw channels in index order).
    # "jacobi_tf32": jacobi with its rotation steps on TF32 tensor cores on a GPU (the same as
    # jacobi on a CPU); opt-in: on an H100 it fitted a prefill block 5% faster at slightly
    # lower top-r energy (docs/codec.md).
    fit_solver: str = "auto"
    # What a token reads compressed (docs/determinism.md). "position": every page of its
    # request's prompt ending at or before it, and every page holding generated tokens ending
    # >= the window (hot_tokens, + daemon_lag_tokens with the daemon) before it, whether the
    # token is a prompt or a generated one (pages a prefill chunk's own later tokens read are
    # sealed inside the forward): outputs independent of other traffic.
    # "chunk": a prefill chunk reads the pages sealed before it compressed and itself dense,
    # decode as "position": what a prompt token reads depends on where its chunk began.
    # Default "position" (with basis_fit "first_page", hot_tokens 0): traffic independent at the
    # old chunk-rule default's RULER (docs/determinism.md).
    read_rule: str = "position"
    # Which pages a basis block's bases are fitted on: "first_page" (a sealed page is then a
    # function of its own K/V and its block's first page) or "group" (the pages sealed with the
    # block's first one: depends on chunking and timing). Default "first_page".
    basis_fit: str = "first_page"
    # basis_fit "group", daemon off: a group of pages holding fewer than this many tokens (and
    # less than the whole block) that opens a basis block of a request whose previous block is sealed (a decode page starting a
    # block every basis_block_tokens, a prompt's short tail block) takes the previous block's
    # bases instead of a fit on its few pages: better bases on real SmolLM2 KV (docs/codec.md,
    # "Bases for a block opened by a few pages"), and the decode step that opens a block skips
    # the fit. 0 (default): always fit; 2048 is what was measured. Off by default until RULER
    # measures it. With it on, tests/test_packed_decode_server.py's selection case parts at
    # step 1 (0.28 in log-prob, tolerance 0.2): a page-score near tie at step 0 (bounds 1.3e-3
    # apart), not a fault of the inheritance (docs/codec.md). Counted: inherited_bases.
    basis_inherit_below_tokens: int = 0
    # Device memory (MiB) that keeps the write transforms (R^-1, fp32) of basis blocks still
    # taking pages between seals (codec/seal.WriteTransformCache): a decode step seals one page
    # of each request's open block, which otherwise inverts that block's bases again at every
    # page. 33.5 MiB per block at the Llama-8B shape (32 layers x 8 KV heads x 128^2 x 4 B x
    # K/V); a block that does not fit is inverted each time (counted). 0: never kept.
    write_transform_cache_mb: int = 1024
    # CUDA graphs for decode: "off" (every step eager); "breakable": SGLang's breakable decode
    # graph replays the model's own layers and runs each layer's MosaicKV attention eagerly
    # between the graph segments (docs/cuda_graphs.md); "full": SGLang's full decode graph with
    # MosaicKV attention recorded in it, static-shaped (graph_decode.py; the Triton decode path
    # only); "auto" (default): "full" on CUDA with the Triton decode path, else "off" (chosen
    # at start-up by the plugin, `plugin.resolve_config`). Measured on an H200 (2026-12-04, 32K,
    # Llama-8B shape): full 51.9 tok/s at batch 1 vs 11.6 eager, greedy outputs identical.
    decode_cuda_graph: str = "auto"
    # Under "full": the most hot (dense) tokens a request may read at a decode step (its hot-row
    # table's width): the read rule's window, the page being filled, the daemon's pages in
    # flight. A step over it stops with an error naming this key.
    graph_hot_tokens: int = 1024
    # Under "full": the decode graph's stage-1 products (`triton_kernels/request_decode.py`,
    # PRODUCTS): "exact" (three bf16 MMAs on hi/lo halves, ~2^-16 relative per product) or
    # "bf16" (one bf16 MMA: q and the dequantized page rounded to bf16, as FlashInfer's dense
    # decode over a bf16 cache; 2^-9 relative, far below the codec's own error).
    graph_products: str = "exact"

    def __post_init__(self):
        if isinstance(self.select, dict):
            self.select = _build(SelectionConfig, self.select, "select.")
        if isinstance(self.cold, dict):
            self.cold = _build(ColdConfig, self.cold, "cold.")
        self.validate()

    def validate(self) -> None:
        for key in ("segment_tokens", "page_tokens", "basis_block_tokens"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"mosaickv config: {key}={getattr(self, key)!r} must be an int >= 1")
        if self.segment_tokens % self.page_tokens:
            raise ValueError(f"mosaickv config: segment_tokens={self.segment_tokens} must be a "
                             f"multiple of page_tokens={self.page_tokens}")
        if self.basis_block_tokens % self.segment_tokens:
            raise ValueError(f"mosaickv config: basis_block_tokens={self.basis_block_tokens} must be "
                             f"a multiple of segment_tokens={self.segment_tokens}")
        for key in ("hot_tokens", "sink_segments"):
            if getattr(self, key) < 0:
                raise ValueError(f"mosaickv config: {key}={getattr(self, key)} must be >= 0")
        if self.hot_buffer_requests < 1:
            raise ValueError(f"mosaickv config: hot_buffer_requests={self.hot_buffer_requests} "
                             "must be >= 1")
        if not 0 <= self.hot_buffer_fraction <= 1:
            raise ValueError(f"mosaickv config: hot_buffer_fraction={self.hot_buffer_fraction} "
                             "must be in [0, 1] (0: sized to what is in flight)")
        for key in ("k_error_budget", "v_error_budget", "sink_error_budget"):
            if not 0 <= getattr(self, key):
                raise ValueError(f"mosaickv config: {key}={getattr(self, key)} must be >= 0")
        for key in ("k_candidates", "v_candidates", "sink_candidates", "rescue_candidates"):
            specs = getattr(self, key)
            may_be_empty = key in ("sink_candidates", "rescue_candidates")
            if not isinstance(specs, (list, tuple)) or (not specs and not may_be_empty):
                raise ValueError(f"mosaickv config: {key} must be a non-empty list of strategy specs")
            kinds = {"k_candidates": "k", "v_candidates": "v"}.get(key, "kv")
            for i, spec in enumerate(specs):
                try:  # parse, then encode dummy segments: catches specs that can never fit
                    check_encodable(spec, kinds, self.segment_tokens, MAX_HEAD_DIM)
                except ValueError as exc:
                    raise ValueError(f"mosaickv config: {key}[{i}] '{spec}': {exc}") from None
        self.select.validate(self.page_tokens)
        self.cold.validate(self.page_tokens)
        if self.cold.enabled and self.read_rule != "chunk":
            raise ValueError("mosaickv config: cold.enabled needs read_rule 'chunk' (under the "
                             "position rule, the default, what a token reads must not change "
                             "after it is sealed): add \"preset\": \"chunk_rule\"")
        for key, choices in (("decode_kernel", DECODE_KERNELS), ("pack_kernel", PACK_KERNELS),
                             ("arena", ARENAS),
                             ("prefill_attention", PREFILL_ATTENTIONS),
                             ("chooser", CHOOSERS), ("encode_kernel", ENCODE_KERNELS),
                             ("fit_solver", FIT_SOLVERS), ("daemon", DAEMON_MODES),
                             ("read_rule", READ_RULES), ("basis_fit", BASIS_FITS),
                             ("decode_cuda_graph", DECODE_CUDA_GRAPHS),
                             ("graph_products", GRAPH_PRODUCTS)):
            if getattr(self, key) not in choices:
                raise ValueError(f"mosaickv config: {key}={getattr(self, key)!r} must be one of "
                                 f"{list(choices)}")
        if not isinstance(self.decode_profile_every, int) or self.decode_profile_every < 0:
            raise ValueError(f"mosaickv config: decode_profile_every={self.decode_profile_every!r} "
                             "must be an int >= 0")
        if not isinstance(self.write_transform_cache_mb, int) or isinstance(
                self.write_transform_cache_mb, bool) or self.write_transform_cache_mb < 0:
            raise ValueError(f"mosaickv config: write_transform_cache_mb="
                             f"{self.write_transform_cache_mb!r} must be an int >= 0")
        if not isinstance(self.basis_inherit_below_tokens, int) or isinstance(
                self.basis_inherit_below_tokens, bool) or self.basis_inherit_below_tokens < 0:
            raise ValueError(f"mosaickv config: basis_inherit_below_tokens="
                             f"{self.basis_inherit_below_tokens!r} must be an int >= 0")
        if self.read_rule == "position" and self.basis_fit != "first_page":
            raise ValueError("mosaickv config: read_rule 'position' needs basis_fit 'first_page' "
                             "(it seals pages inside a prefill forward, layer by layer)")
        if not isinstance(self.graph_hot_tokens, int) or (
                self.decode_cuda_graph == "full" and
                self.graph_hot_tokens < self.hot_tokens + 2 * self.segment_tokens):
            raise ValueError(f"mosaickv config: graph_hot_tokens={self.graph_hot_tokens!r} must be "
                             f"an int >= hot_tokens + 2 * segment_tokens "
                             f"({self.hot_tokens + 2 * self.segment_tokens}) under "
                             f"decode_cuda_graph 'full'")
        if not isinstance(self.decode_seal_layers, int) or isinstance(
                self.decode_seal_layers, bool) or self.decode_seal_layers < 0:
            raise ValueError(f"mosaickv config: decode_seal_layers={self.decode_seal_layers!r} "
                             "must be an int >= 0 (layers of a page sealed per decode step; 0: "
                             "all at once)")
        if not isinstance(self.daemon_lag_tokens, int) or self.daemon_lag_tokens < 0:
            raise ValueError(f"mosaickv config: daemon_lag_tokens={self.daemon_lag_tokens!r} must "
                             "be an int >= 0")
        for key in ("daemon_workers", "daemon_threads", "daemon_queue_segments",
                    "daemon_install_batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"mosaickv config: {key}={getattr(self, key)} must be >= 1")
        block_pages = self.basis_block_tokens // self.segment_tokens
        if self.daemon_queue_segments < block_pages:
            raise ValueError(f"mosaickv config: daemon_queue_segments={self.daemon_queue_segments} "
                             f"must hold one basis block ({block_pages} pages = "
                             f"basis_block_tokens / segment_tokens)")
        if not 0 <= self.daemon_hot_watermark < 1:
            raise ValueError(f"mosaickv config: daemon_hot_watermark={self.daemon_hot_watermark} "
                             "must be in [0, 1)")
        if not 0 <= self.daemon_boundary_share < 1:
            raise ValueError(f"mosaickv config: daemon_boundary_share={self.daemon_boundary_share} "
                             "must be in [0, 1)")
        if not (isinstance(self.daemon_nice, int) and 0 <= self.daemon_nice <= 19):
            raise ValueError(f"mosaickv config: daemon_nice={self.daemon_nice!r} must be an int "
                             "in 0..19")
        if not self.daemon_timeout_s > 0:
            raise ValueError(f"mosaickv config: daemon_timeout_s={self.daemon_timeout_s} must be > 0")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MosaicConfig":
        """From JSON keys; `"preset": NAME` starts from a named set of keys (PRESETS), which the
        other keys override (nested ones, e.g. `select`, key by key)."""
        if "preset" in data:
            data = dict(data)
            name = data.pop("preset")
            if name not in PRESETS:
                raise ValueError(f"mosaickv config: unknown preset {name!r}; known: "
                                 f"{sorted(PRESETS)}")
            data = _merged(PRESETS[name], data)
        return _build(cls, data, "")

    @classmethod
    def parse(cls, text: str | None) -> "MosaicConfig":
        """JSON text, ``@path/to/file.json``, or None/empty for the defaults."""
        if not text:
            return cls()
        if text.startswith("@"):
            path = Path(text[1:])
            if not path.is_file():
                raise ValueError(f"mosaickv config file not found: {path}")
            text = path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"mosaickv config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("mosaickv config must be a JSON object")
        return cls.from_dict(data)


DAEMON_MODES = ("off", "process")
DECODE_CUDA_GRAPHS = ("auto", "off", "breakable", "full")
GRAPH_PRODUCTS = ("exact", "bf16")
MAX_HEAD_DIM = 256  # config-time check; the pool re-checks with the model's real head_dim


def check_encodable(spec: str, kinds: str, segment_tokens: int, head_dim: int) -> None:
    """Raise ValueError if `spec` cannot encode a [1, segment_tokens, head_dim] K and/or V."""
    strat = parse_strategy(spec)
    for kind in kinds:
        strat.encode(torch.zeros(1, segment_tokens, head_dim), kind)


def check_fits(cfg: "MosaicConfig", head_dim: int, segment_tokens: int | None = None) -> None:
    """Every candidate must encode this model's K/V: a clear error at start-up, naming the key.
    Rescue candidates are optional: `fit_rescue` drops those that do not fit, logged."""
    for key, kinds in (("k_candidates", "k"), ("v_candidates", "v"), ("sink_candidates", "kv")):
        for spec in getattr(cfg, key):
            try:
                check_encodable(spec, kinds, segment_tokens or cfg.segment_tokens, head_dim)
            except ValueError as exc:
                raise ValueError(f"mosaickv config: {key} '{spec}' does not fit this model "
                                 f"(head_dim {head_dim}): {exc}") from None
    if cfg.cold.enabled:
        for key, kinds in (("k_candidates", "k"), ("v_candidates", "v")):
            for spec in getattr(cfg.cold, key):
                try:
                    check_encodable(spec, kinds, segment_tokens or cfg.segment_tokens, head_dim)
                except ValueError as exc:
                    raise ValueError(f"mosaickv config: cold.{key} '{spec}' does not fit this "
                                     f"model (head_dim {head_dim}): {exc}") from None


def fit_rescue(cfg: "MosaicConfig", head_dim: int) -> "MosaicConfig":
    """`cfg` with only the rescue candidates that encode this model's head_dim (the default
    8-bit band needs a multiple of 64); a dropped one is logged once here, and its segments go
    dense as they would without it (counted as over-budget)."""
    keep = []
    for spec in cfg.rescue_candidates:
        try:
            check_encodable(spec, "kv", cfg.segment_tokens, head_dim)
            keep.append(spec)
        except ValueError as exc:
            logger.warning("MosaicKV: rescue candidate '%s' does not fit head_dim %d (%s): not "
                           "used; segments no candidate fits stay dense", spec, head_dim, exc)
    return cfg if keep == list(cfg.rescue_candidates) else replace(cfg, rescue_candidates=keep)


# the read rule of the default before 2026-12-07 (PRESETS "chunk_rule", below)
_CHUNK_RULE = {"read_rule": "chunk", "basis_fit": "group", "hot_tokens": 64}
# Named starting points for `--mosaickv-config '{"preset": NAME, ...}'`, each documented with the
# measurement that defines it.
PRESETS: dict[str, dict] = {
    # what a greedy request reads is a function of its own tokens, positions and prompt length,
    # not of other traffic, with the daemon off or on (docs/determinism.md; 12 of 12 in CI)
    "traffic_independent": {"read_rule": "position", "basis_fit": "first_page", "hot_tokens": 0},
    # the read rule of the default before 2026-12-07: prefill chunks read themselves dense, bases
    # fitted on the pages sealed together, a 64-token window. Traffic dependent; what
    # cold.enabled and decode_seal_layers need
    "chunk_rule": dict(_CHUNK_RULE),
    # the whole default before 2026-12-07 (the chunk rule, budgets 0.08 / 0.12, no second
    # stage): what every speed number before that date measured; RULER 2.10 points at 3.46x
    # (H200, 2026-11-30) against the default's 1.85 at 3.69x (H100, 2026-12-07)
    "former_default": {**_CHUNK_RULE, "k_error_budget": 0.08, "v_error_budget": 0.12,
                       "select": {"rescore_factor": 0, "rescore_channels": 0}},
}


def _merged(base: dict, over: dict) -> dict:
    """`base` with `over`'s keys on top; dict values merged key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


_FIELD_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "list[str]": (list, tuple),
                "SelectionConfig": (dict, SelectionConfig), "ColdConfig": (dict, ColdConfig)}


def _build(cls, data: dict, prefix: str):
    """Construct cls from a dict, naming the first unknown or mistyped key."""
    known = {f.name: f for f in fields(cls)}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"mosaickv config: unknown key '{prefix}{key}'; known: {sorted(known)}")
        expected = _FIELD_TYPES[known[key].type]
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise ValueError(f"mosaickv config: '{prefix}{key}' must be {known[key].type}, "
                             f"got {value!r}")
    return cls(**data)
