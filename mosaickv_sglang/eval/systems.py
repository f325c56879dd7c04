"""The named systems an accuracy run compares, each as SGLang server arguments.

Every MosaicKV variant differs from the default in one thing, so a score difference is what that
thing buys:

* ``dense``: ``--kv-backend default`` (the reference every loss is measured against);
* ``fp8``: SGLang's own FP8 KV cache (``--kv-cache-dtype fp8_e4m3``), 2x below bf16 by construction;
* ``mosaickv``: the default config (rotated banded quantization chosen per segment, page selection
  with a 4096-token budget and its second stage, the position read rule; since 2026-12-07 the
  same config as ``mosaickv_position_rescore_b12``). Systems measured against the default before
  it (``mosaickv_chunk_rule``: chunk read rule, group bases, budgets 0.08 / 0.12, no second
  stage) set its keys (``FORMER_DEFAULT``), so their names keep meaning what was measured;
* ``no_rotation``: the default with identity bases (``fit_solver: identity``): no SVD rotation,
  bands on raw channels in index order (what rot=0 candidates store), same budgets, read by the
  packed kernel (rot=0 candidates are not: the reference path made that ablation ~100x slower on
  the H200);
* ``global_mask``: a ThinK-like shared channel mask, r chosen so its bytes match the default's
  middle band candidate, taken for every segment;
* ``channel_only``: the default without page selection (every page read);
* ``selection_only``: near-lossless values (8 bits on every rotated channel, the sink's band: the
  packed kernel reads bands only, not bf16) and page selection reading 2048 tokens per step,
  about the bytes the default reads per step (4096 tokens at ~4.6 bits); selection saves reads,
  not memory, so "equal bytes" is equal bytes read;
* ``mosaickv_sel1k``: the default with the same 1024-token selection budget;
* ``mosaickv_sel512``, ``mosaickv_sel512_rescore`` / ``mosaickv_sel1024_rescore``,
  ``quest_sel512`` / ``quest_sel1024``: selection at 1/8 of 4K and of 8K: the bound alone, the
  bound's 4x candidates re-ranked on 32 leading channels of their compressed K (the kernels'
  second stage), and a Quest-like baseline (near-lossless 8-bit values on raw channels, every
  channel's min/max per 32-token page: kernel-readable, unlike bf16 values);
* ``mosaickv_rescore`` / ``mosaickv_position_rescore``: the former default's budgets with the
  second stage, under its chunk rule and under the traffic-independent one (``read_rule: position``,
  ``basis_fit: first_page``, ``hot_tokens: 0``): the position rule's RULER loss is page
  selection's, and at codec level the second stage puts it below the default's error
  (docs/determinism.md);
* ``mosaickv_rescore_b12`` / ``mosaickv_position_rescore_b12``: the same with looser chooser
  budgets (k 0.12, v 0.20): at codec level the second stage buys ~10% more compression at the
  former default's attention error; on RULER (H100, 2026-12-07) both lost 1.85 points at 3.81x /
  3.69x, and the second became the default;
* ``mosaickv_compact_c20`` / ``mosaickv_compact_c25``: compact candidates (the rotated tail
  dropped, more 2-bit channels) with the second stage and looser chooser budgets, chunk read
  rule: candidate compact presets at >= 4.5x (codec level at 8K: 4.06x / 4.43x; c20 on RULER,
  H100, 2026-12-07: 6.95 points at 4.63x);
* ``mosaickv_cold`` / ``mosaickv_cold_compact``: the former default (cold needs the chunk rule)
  with ``cold.enabled`` (pages past
  a request's last 2048 tokens re-encoded between steps), with the default cold candidates and
  with the compact ones: the accuracy cost of the capacity those buy;
* ``mosaickv_window128``: the default with ``hot_tokens: 128``, the read rule's window anchored at
  the prompt's end (the first answer token reads the prompt's last 128+ tokens dense);
* ``mosaickv_k4``: the default without its 2-bit K candidate (K at >= 4.5 bits/scalar): the
  rotated chooser sends more K segments to 2 bits than the raw-basis one (18% vs 2% on the CPU);
* ``mosaickv_hi`` / ``mosaickv_lo`` / ``mosaickv_xlo``: fixed band layouts at ~5.5 / 3.5 / 2.9
  bits per scalar (every segment takes it), points of the accuracy/memory curve.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..config import PRESETS, MosaicConfig, check_fits

ACCEPT_ALL = 1e9  # an error budget every segment meets: the (single) candidate is always taken
SELECTION_BUDGET = 1024  # tokens read per decode step by the smaller-budget default
SELECTION_ONLY_BUDGET = 2048  # 8-bit tokens read per step by selection_only: ~ the default's bytes
NEAR_LOSSLESS = "band:b8=64,b4=0,b2=0,group=32"  # 8 bits on every channel (the default sink)
MASK_MATCH = "band:b8=4,b4=60,b2=0,group=128"  # the default's middle candidate (4.5 bits/scalar)
SMOLLM2_HEAD_DIM = 64
EIGHTH_BUDGETS = (512, 1024)  # 1/8 of 4K and of 8K
RESCORE_FACTOR, RESCORE_CHANNELS = 4, 32  # the codec probe's best (docs/codec.md)
LOOSE_BUDGETS = (0.12, 0.20)  # chooser k/v error budgets a candidate default spends on bytes
# The default before 2026-12-07 (chunk read rule, group bases, 64-token window, budgets 0.08 /
# 0.12, no second stage): the systems measured against it keep their meaning through these keys
CHUNK_RULE = PRESETS["chunk_rule"]
FORMER_DEFAULT = {**PRESETS["former_default"],
                  "select": {"enabled": True, **PRESETS["former_default"]["select"]}}
POSITION_RULE = PRESETS["traffic_independent"]
SECOND_STAGE = {"enabled": True, "rescore_factor": RESCORE_FACTOR,
                "rescore_channels": RESCORE_CHANNELS}
NO_SECOND_STAGE = {"rescore_factor": 0, "rescore_channels": 0}
# compact candidates (codec probe, benchmarks/results/compact_cpu_2026-12-06/): bands dropping the
# rotated tail and more 2-bit channels before the default's, cheapest first
COMPACT_K = ["band:b8=4,b4=20,b2=32,group=128", "band:b8=4,b4=28,b2=24,group=128",
             "band:b8=4,b4=44,b2=16,group=128", "band:b8=4,b4=60,b2=0,group=128"]
COMPACT_V = ["band:b8=0,b4=16,b2=40,group=128", "band:b8=0,b4=32,b2=24,group=128",
             "band:b8=0,b4=48,b2=16,group=128", "band:b8=4,b4=60,b2=0,group=128"]
COMPACT_BUDGETS = {"c20": (0.20, 0.30), "c25": (0.25, 0.35)}  # codec: 4.06x / 4.43x at 8K
# cold candidates of the compact capacity fill (capacity_cpu_2026-12-07_shared_arena/): the two
# cheapest compact bands, then the default cold band
COLD_COMPACT_K = [*COMPACT_K[:2], "band:b8=4,b4=36,b2=24,group=128"]
COLD_COMPACT_V = [*COMPACT_V[:2], "band:b8=0,b4=48,b2=16,group=128"]


@dataclass(frozen=True)
class System:
    name: str
    description: str
    kv_backend: str = "mosaickv"  # or "default"
    config: dict | None = None  # MosaicConfig fields that differ from the defaults
    extra_args: tuple[str, ...] = ()
    nominal_ratio: float | None = None  # bf16 bytes / bytes kept, for systems without stats
    family: str = "mosaickv"  # reference | baseline | mosaickv | ablation | budget

    def server_args(self) -> list[str]:
        args = ["--kv-backend", self.kv_backend]
        if self.config:
            args += ["--mosaickv-config", json.dumps(self.config, sort_keys=True)]
        return args + list(self.extra_args)

    def mosaic_config(self) -> MosaicConfig | None:
        """The validated config the server will run (None for the dense backend)."""
        if self.kv_backend != "mosaickv":
            return None
        return MosaicConfig.parse(json.dumps(self.config)) if self.config else MosaicConfig()


def _segment_bytes(spec: str, head_dim: int) -> int:
    import torch

    from ..codec.strategies import Encoded, parse_strategy

    shape = (1, MosaicConfig().segment_tokens, head_dim)
    return Encoded("k", shape, parse_strategy(spec).encode(torch.zeros(shape), "k")).nbytes()


def matched_mask_r(target_spec: str = MASK_MATCH, head_dim: int = SMOLLM2_HEAD_DIM) -> int:
    """The mask width r whose bytes per segment are nearest those of `target_spec`."""
    target = _segment_bytes(target_spec, head_dim)
    return min(range(1, head_dim + 1),
               key=lambda r: abs(_segment_bytes(f"mask:r={r}", head_dim) - target))


def _fixed(spec_k: str, spec_v: str) -> dict:
    return {"k_candidates": [spec_k], "v_candidates": [spec_v],
            "k_error_budget": ACCEPT_ALL, "v_error_budget": ACCEPT_ALL}


def build_systems() -> dict[str, System]:
    d = MosaicConfig()
    no_select = {"select": {"enabled": False}}
    sel_budget = {"select": {"enabled": True, "budget_tokens": SELECTION_BUDGET}}
    r = matched_mask_r()
    systems = [
        System("dense", "SGLang's dense KV cache (--kv-backend default)", kv_backend="default",
               nominal_ratio=1.0, family="reference"),
        System("fp8", "SGLang FP8 KV cache (--kv-cache-dtype fp8_e4m3)", kv_backend="default",
               extra_args=("--kv-cache-dtype", "fp8_e4m3"), nominal_ratio=2.0, family="baseline"),
        System("mosaickv", "MosaicKV default config", family="mosaickv"),
        System("no_rotation", "default with identity bases (no SVD rotation: bands on raw "
               "channels), same candidates and budgets", config={"fit_solver": "identity"},
               family="ablation"),
        System("global_mask", f"ThinK-like global channel mask mask:r={r} (bytes of {MASK_MATCH}) "
               "for every segment", config=_fixed(f"mask:r={r}", f"mask:r={r}"), family="ablation"),
        System("channel_only", "default without page selection (channel/value compression only)",
               config=no_select, family="ablation"),
        System("selection_only", f"near-lossless values ({NEAR_LOSSLESS}), page selection "
               f"reading {SELECTION_ONLY_BUDGET} tokens per step (~ the default's bytes read)",
               config={**_fixed(NEAR_LOSSLESS, NEAR_LOSSLESS),
                       "select": {"enabled": True, "budget_tokens": SELECTION_ONLY_BUDGET}},
               family="ablation"),
        System("mosaickv_sel1k", f"default with a {SELECTION_BUDGET}-token selection budget",
               config=sel_budget, family="budget"),
        # selection at 1/8 of the context (512 tokens at 4K, 1024 at 8K): the bound alone, the
        # second stage on the compressed K, and a Quest-like baseline at the same budget
        *(System(f"mosaickv_sel{b}_rescore", f"default with a {b}-token selection budget and "
                 f"the second stage: {RESCORE_FACTOR}x candidates re-ranked on "
                 f"{RESCORE_CHANNELS} leading channels of their compressed K",
                 config={"select": {"enabled": True, "budget_tokens": b,
                                    "rescore_factor": RESCORE_FACTOR,
                                    "rescore_channels": RESCORE_CHANNELS}}, family="budget")
          for b in EIGHTH_BUDGETS),
        *(System(f"quest_sel{b}", f"Quest-like at a {b}-token budget: 8 bits on every raw "
                 f"channel ({NEAR_LOSSLESS}, identity bases), every channel's min/max per "
                 f"32-token page", config={**_fixed(NEAR_LOSSLESS, NEAR_LOSSLESS),
                                          "fit_solver": "identity",
                                          "select": {"enabled": True, "budget_tokens": b,
                                                     "meta_channels": SMOLLM2_HEAD_DIM,
                                                     **NO_SECOND_STAGE}},
                 family="baseline")
          for b in EIGHTH_BUDGETS),
        System("mosaickv_sel512", "default with a 512-token selection budget, the bound alone",
               config={"select": {"enabled": True, "budget_tokens": 512, **NO_SECOND_STAGE}},
               family="budget"),
        System("mosaickv_k4", "default without the 2-bit K candidate (K >= 4.5 bits/scalar)",
               config={"k_candidates": [c for c in d.k_candidates if ",b2=0," in c]},
               family="budget"),
        System("mosaickv_hi", "fixed band b8=16,b4=48 (5.5 bits/scalar)",
               config=_fixed("band:b8=16,b4=48,b2=0,group=64", "band:b8=16,b4=48,b2=0,group=64"),
               family="budget"),
        System("mosaickv_lo", "fixed band b8=4,b4=28,b2=32 (3.5 bits/scalar)",
               config=_fixed("band:b8=4,b4=28,b2=32,group=128", "band:b8=4,b4=28,b2=32,group=128"),
               family="budget"),
        System("mosaickv_xlo", "fixed band b8=4,b4=8,b2=52 (2.9 bits/scalar)",
               config=_fixed("band:b8=4,b4=8,b2=52,group=128", "band:b8=4,b4=8,b2=52,group=128"),
               family="budget"),
        # the read rule's parts (docs/determinism.md), each against the rule before it, at the
        # former default's budgets; every key set: the defaults moved under these ablations
        # (they would then measure another config than they say)
        System("mosaickv_chunk_rule", "the default before 2026-12-07: a prefill chunk reads "
               "itself dense, bases fitted on the block's first sealed group, a 64-token hot "
               "window, budgets k 0.08 / v 0.12, no second stage", config=FORMER_DEFAULT,
               family="ablation"),
        System("mosaickv_chunk_first_page", "chunk read rule, 64-token hot window, bases fitted "
               "on the block's first page", config={**FORMER_DEFAULT, "basis_fit": "first_page"},
               family="ablation"),
        System("mosaickv_chunk_hot0", "chunk read rule, bases fitted on the block's first page, "
               "no hot window", config={**FORMER_DEFAULT, "basis_fit": "first_page",
                                        "hot_tokens": 0}, family="ablation"),
        # the second stage at the former default's budgets, and with it the traffic-independent
        # config
        System("mosaickv_rescore", f"the former default with the second stage: {RESCORE_FACTOR}x "
               f"candidates re-ranked on {RESCORE_CHANNELS} leading channels of their compressed K",
               config={**FORMER_DEFAULT, "select": SECOND_STAGE}, family="ablation"),
        System("mosaickv_position_rescore", "the former default's budgets under the "
               "traffic-independent config (position read rule, bases fitted on the block's "
               "first page, no hot window) with the second stage",
               config={**FORMER_DEFAULT, **POSITION_RULE, "select": SECOND_STAGE},
               family="ablation"),
        # a candidate default: the second stage's accuracy spent on bytes (looser chooser
        # budgets); codec level, 8K: 3.49x vs 3.17x at the former default's error (docs/codec.md)
        System("mosaickv_rescore_b12", "the chunk read rule with the second stage and chooser "
               f"budgets k 0.12 / v 0.20 (former default 0.08 / 0.12): cheaper layouts", config={
                   **CHUNK_RULE, "k_error_budget": LOOSE_BUDGETS[0],
                   "v_error_budget": LOOSE_BUDGETS[1], "select": SECOND_STAGE}, family="budget"),
        # the default since 2026-12-07, every key set (RULER, H100: 1.85 points at 3.69x)
        System("mosaickv_position_rescore_b12", "the traffic-independent config with the second "
               "stage and chooser budgets k 0.12 / v 0.20 (the default since 2026-12-07)", config={
                   **POSITION_RULE, "k_error_budget": LOOSE_BUDGETS[0],
                   "v_error_budget": LOOSE_BUDGETS[1], "select": SECOND_STAGE}, family="budget"),
        # the default with the read rule's window anchored at the prompt's end (128 tokens):
        # the first answer token reads the prompt's last 128+ tokens dense wherever the prompt
        # ends in a page (codec level at a boundary: 0.113 -> 0.042,
        # benchmarks/results/prompt_window_cpu_2026-12-07/)
        System("mosaickv_window128", "the default with a 128-token window anchored at the "
               "prompt's end (hot_tokens 128 under the position rule)", config={
                   **POSITION_RULE, "hot_tokens": 128, "k_error_budget": LOOSE_BUDGETS[0],
                   "v_error_budget": LOOSE_BUDGETS[1], "select": SECOND_STAGE}, family="ablation"),
    ]
    # compact presets at >= 4.5x (the accuracy issue): the compact candidates with the second
    # stage, chooser budgets k/v 0.20/0.30 and 0.25/0.35 (codec, 8K: 4.06x at attention error
    # 0.121 / 4.43x at 0.146; mosaickv_lo, 0.129 there, lost 4.1 points at 4.32x)
    for tag, (kb, vb) in COMPACT_BUDGETS.items():
        systems.append(System(
            f"mosaickv_compact_{tag}", f"compact candidates (tail channels dropped, more 2-bit), "
            f"the second stage, chooser budgets k {kb} / v {vb}, chunk read rule", config={
                **CHUNK_RULE, "k_candidates": COMPACT_K, "v_candidates": COMPACT_V,
                "k_error_budget": kb, "v_error_budget": vb, "select": SECOND_STAGE},
            family="budget"))
    # cold recompression (the capacity issue): pages no running request has within its last
    # 2048 tokens re-encoded between steps, with the default cold pair and with the compact cold
    # candidates (CPU fills, shared arena: 3.42x / 3.49x dense); its accuracy cost. Every cold
    # page at the first boundary it is cold at (pages_per_step far above a RULER batch's pages):
    # with the default 8 per step, 64 concurrent short answers would mostly finish before their
    # pages were recompressed, and the run would price less than it claims
    cold = {"enabled": True, "pages_per_step": 1 << 16}
    # (cold recompression needs the chunk rule: the former default's keys)
    systems.append(System("mosaickv_cold", "the former default with cold pages recompressed "
                          "(default cold candidates)", config={**FORMER_DEFAULT, "cold": cold},
                          family="budget"))
    systems.append(System("mosaickv_cold_compact", "the former default with cold pages "
                          "recompressed to the compact cold candidates", config={
                              **FORMER_DEFAULT, "cold": {
                                  **cold, "k_candidates": COLD_COMPACT_K,
                                  "v_candidates": COLD_COMPACT_V}},
                          family="budget"))
    return {s.name: s for s in systems}


SYSTEMS = build_systems()
DEFAULT_SYSTEMS = ("dense", "mosaickv")
FULL_SYSTEMS = tuple(SYSTEMS)


def get(names) -> list[System]:
    """Systems by name, in the order given; an unknown name is an error listing the known ones."""
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {list(SYSTEMS)}")
    return [SYSTEMS[n] for n in names]


def validate(system: System, head_dim: int = SMOLLM2_HEAD_DIM) -> None:
    """What the server checks at start-up, without a server: the config parses and fits head_dim."""
    cfg = system.mosaic_config()
    if cfg is not None:
        check_fits(cfg, head_dim)

