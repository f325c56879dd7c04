"""Compile every Triton kernel of triton_kernels/ for the H200 (sm_90) on a machine without a
GPU, in the variants the server launches, and report registers and spills per variant.

How: Triton's active driver is replaced by one that reports an sm_90 target (nothing else of a
GPU is needed to compile), and a `jit_cache_hook` stops every launch just before it compiles:
the kernel wrappers run on small CPU tensors (no TRITON_INTERPRET: the GPU code path, e.g.
EMULATE=False), each launch they make is recorded with the specialization the JIT computed
(signature, constexprs, 16-byte divisibility of pointers and ints, num_warps/num_stages) and
nothing runs. Each recorded variant is then compiled down to a cubin by Triton's own ptxas
(from its wheel), in parallel processes, with ptxas' `-v` log read for registers and spills.

    python scripts/sm90_compile.py [--jobs N] [--json FILE] [--only SUBSTRING] [--list]
                                   [--dump DIR]

`--dump DIR` writes each variant's TTGIR, PTX and SASS there (`cuobjdump -sass` from Triton's
wheel): what a kernel's loop really executes, read without a GPU.

MOSAICKV_SM90_REPORT=FILE writes the JSON report there too. Exit status 1 when a variant does
not compile or a scenario launches other kernels than it declares (`SCENARIOS`). The policy
(which kernels may spill) is tests/test_sm90_compile.py's. The target is GPUTarget("cuda", 90,
32): 32 is the warp size a real H200's driver reports (the NVIDIA backend takes the warp size
from its options, not from the target, so the code would be the same with any value).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

if __name__ in ("__main__", "__mp_main__"):  # this script or its compile workers (not a test
    os.environ.pop("TRITON_INTERPRET", None)  # importing it): the GPU path, before triton
REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# Shapes the server runs: SmolLM2-135M (9 query / 3 KV heads, head_dim 64) and Llama-3.1-8B
# (32 / 8, head_dim 128), the two models of benchmarks/ and the tests.
HEADS = {64: (9, 3), 128: (32, 8)}
SEGMENT = 128  # MosaicConfig.segment_tokens


class _Sm90Driver:
    """What the JIT asks its driver for before it compiles: the target, a device, a stream."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


# ---- scenarios: the wrappers called as the server calls them ------------------------------

def _pairs():
    """Every (K, V) band-strategy pair the chooser can store with the default config (as
    scripts/decode_compile_probe.py: K/V candidates plus the sink/rescue 8-bit band)."""
    from mosaickv_sglang.config import MosaicConfig

    cfg = MosaicConfig()
    extra = list(dict.fromkeys(cfg.sink_candidates + cfg.rescue_candidates))
    ks = list(dict.fromkeys(cfg.k_candidates + extra))
    vs = list(dict.fromkeys(cfg.v_candidates + extra))
    return [(k, v) for k in ks for v in vs]


def _layouts(d: int, pairs):
    from mosaickv_sglang.codec.arena import BlockLayout
    from mosaickv_sglang.codec.strategies import parse_strategy

    return [BlockLayout.of(parse_strategy(k), parse_strategy(v), SEGMENT, d) for k, v in pairs]


@functools.lru_cache(maxsize=None)
def _arena(d: int, min_group: int = 32):
    """A two-segment arena of the default first pair at head_dim d. min_group 32: the sink
    layout (group 32) is registered in any server that sealed a sink page, so stage 1 tiles
    32 tokens there (BandDecodeWrapper.plan)."""
    from kernel_bench import synth_arena

    hq, h = HEADS[d]
    arena = synth_arena(1, 2 * SEGMENT + 64, h, d, _pairs()[:1], torch.device("cpu"))
    return dataclasses.replace(arena, min_group=min_group), hq


def band_decode(d: int, select: bool, classes: str = "all", exact: bool = True):
    """PackedDecode.attend: plan (the store's width classes) then run, every class one stage-1
    launch (+ the hot buffer's dense partial and stage 2); `select`: the page-list form the
    GPU selector feeds (stage 1 reads 32-token pages). classes: "all" (every class of the
    default candidate set) or "diagonal" (the pairs (K_i, V_i) only)."""
    from mosaickv_kernels.band_decode import BandDecodeWrapper, band_width_classes

    pairs = _pairs()
    if classes == "diagonal":
        ks = list(dict.fromkeys(k for k, _ in pairs))
        vs = list(dict.fromkeys(v for _, v in pairs))
        pairs = list(zip(ks, vs))
    widths = band_width_classes(torch.stack([lay.channel_plan() for lay in _layouts(d, pairs)]))
    arena, hq = _arena(d)
    w = BandDecodeWrapper()
    w.plan(arena, hq, width_classes=widths, exact=exact)  # 4 warps, 2 stages: the server's
    q = torch.randn(arena.batch, hq, d)
    sel = {}
    if select:
        h, p = arena.num_kv_heads, w.max_pages
        sel = dict(page_ids=torch.arange(p, dtype=torch.int32).repeat(arena.batch, h, 1),
                   page_counts=torch.full((arena.batch, h), p, dtype=torch.int32))
    w.run(q, arena, out_dtype=torch.float32, **sel)


def server_decode_reads(d: int):
    """PackedDecode.attend's reads in place: each row's bases by address (into the K basis, back
    from the V basis with the hot part added) and the hot tokens through the step's row table."""
    from mosaickv_kernels.basis_rotate import rotate_rows
    from mosaickv_kernels.dense_decode import dense_decode_partial

    hq, h = HEADS[d]
    rows, t = 3, 40
    x = torch.randn(rows, h, hq // h, d)
    ptrs = torch.zeros(rows, dtype=torch.int64)
    rotate_rows(x, ptrs, 0, back=False)
    rotate_rows(x, ptrs, 0, back=True, add=torch.zeros_like(x))
    buf = torch.zeros(4 * SEGMENT, h, d, dtype=torch.bfloat16)
    dense_decode_partial(x, buf, buf, torch.full((rows,), t, dtype=torch.int32),
                         rows=torch.zeros(rows, t, dtype=torch.long))


def page_bounds(d: int):
    """BandDecodeWrapper.select's scoring launch (page metadata of meta_channels channels)."""
    from kernel_bench import synth_page_meta
    from mosaickv_kernels.band_decode import BandDecodeWrapper
    from mosaickv_kernels.page_select import page_bounds as bounds
    from mosaickv_sglang.config import SelectionConfig

    arena, hq = _arena(d)
    w = BandDecodeWrapper()
    w.plan(arena, hq)
    _, q_rot = w.queries(torch.randn(arena.batch, hq, d), arena)
    meta = synth_page_meta(arena, SelectionConfig().meta_channels)
    bounds(q_rot, meta, arena.seg_indptr, arena.seg_ids, w.max_pages)


def select_rows(context_tokens: int):
    """RowSelection.select for one request of `context_tokens` (rows of basis_block_tokens, the
    default budget/sink/recent): the top pages per request, then back to rows."""
    from mosaickv_kernels.page_select import RowSelection
    from mosaickv_sglang.config import MosaicConfig

    cfg = MosaicConfig()
    pt, sel = cfg.page_tokens, cfg.select
    row_pages = cfg.basis_block_tokens // pt
    rows = context_tokens // cfg.basis_block_tokens
    rs = RowSelection([0] * rows, [row_pages] * rows, "cpu")
    h = HEADS[128][1]
    rs.select(torch.randn(rows, h, row_pages), sel.budget_tokens // pt,
              -(-sel.sink_tokens // pt), -(-sel.recent_tokens // pt))


def graph_decode(d: int, select: bool, num_splits: int | None = None, products: str = "exact",
                 rescore_layout: str = "rows"):
    """GraphDecode.attend (the full decode graph): q into each reached row's K basis, the page
    bounds written request-major and the top pages per request (`select`: candidates, their
    second stage on the compressed K, the budget's pages), stage 1 over the
    selected pages (every layout through its plan) with the hot tokens as one more split,
    stage 2 into the layer's bf16 output. `num_splits`: stage 1's split count as the server's
    plan picks it on the GPU (None: as picked here, where the CPU device counts 4 SMs: 1 at
    head_dim 128, which Triton specializes as a constant); `products`: `graph_products`;
    `rescore_layout`: `select.rescore_layout`."""
    from kernel_bench import synth_page_meta
    from mosaickv_kernels.page_rescore import page_rescore
    from mosaickv_kernels.page_select import page_bounds as bounds, select_page_list
    from mosaickv_kernels.request_decode import DecodeTables, RequestDecode
    from mosaickv_sglang.config import MosaicConfig

    cfg = MosaicConfig()
    arena, hq = _arena(d)
    h, w, bs = arena.num_kv_heads, 2, 2
    pps = SEGMENT // cfg.page_tokens
    row_pages = cfg.basis_block_tokens // cfg.page_tokens
    dec = RequestDecode()
    dec.plan(batch=bs, rows_per_request=w, row_pages=row_pages, pages_per_seg=pps,
             num_kv_heads=h, num_qo_heads=hq, head_dim=d, max_selected=16 if select else None,
             sm_scale=d ** -0.5, device="cpu", num_splits=num_splits, products=products)
    i32 = dict(dtype=torch.int32)
    indptr = torch.tensor([0, 2, 2, 2, 2], **i32)
    seg_ids = torch.arange(2, **i32)
    req_pages = torch.tensor([2 * pps, 0], **i32)
    ptrs = torch.zeros(bs * w, dtype=torch.int64)
    q = torch.randn(bs, hq, d, dtype=torch.bfloat16)
    q_rot, q_s = dec.queries(q, ptrs, 0, req_pages)
    sel = {}
    if select:
        meta = synth_page_meta(arena, cfg.select.meta_channels)
        b = bounds(q_rot, meta, indptr, seg_ids, row_pages, rows_per_out=w)
        ids, counts = select_page_list(b, req_pages, 8, 1, 2)
        # the second stage (select.rescore_factor): candidates scored on 32 channels of K
        scores = page_rescore(q_rot, arena.data, arena.headers, arena.plans, indptr, seg_ids,
                              ids, counts, rows_per_owner=w, row_pages=row_pages,
                              pages_per_seg=pps, channels=32, out=torch.empty_like(b),
                              layout=rescore_layout)
        ids, counts = select_page_list(scores, req_pages, 4, 1, 2)
        sel = dict(page_ids=ids, page_counts=counts)
    buf = torch.zeros(4 * SEGMENT, h, d, dtype=torch.bfloat16)
    tables = DecodeTables(arena.data, arena.headers, arena.plans, indptr, seg_ids, req_pages,
                          buf, buf, torch.zeros(bs, 40, dtype=torch.long),
                          torch.full((bs,), 40, **i32))
    dec.run(q_rot, q_s, tables, ptrs, 0, torch.empty(bs, hq, d, dtype=torch.bfloat16), **sel)


def decode_tables():
    """build_decode_tables: the decode graph's per-step tables in one launch (a 128K-token
    context: 33 rows of 32 pages, 1024 hot tokens)."""
    from mosaickv_kernels.decode_tables import build_decode_tables

    bs, w, block, cap, ps = 4, 33, 32, 1024, 128
    i32, i64 = dict(dtype=torch.int32), dict(dtype=torch.int64)
    r2t = torch.zeros(bs + 1, w * block * ps, **i32)
    pages = r2t.shape[1] // ps * (bs + 1)
    out = {"seg_indptr": torch.zeros(bs * w + 1, **i32),
           "seg_ids": torch.zeros(bs * w * block, **i32), "hot_lens": torch.zeros(bs, **i32),
           "req_pages": torch.zeros(bs, **i32), "basis_ptrs": torch.zeros(bs * w, **i64),
           "hot_rows": torch.zeros(bs, cap, **i64)}
    build_decode_tables(r2t, torch.arange(1, bs + 1), torch.full((bs,), 1000, **i64), bs,
                        torch.zeros(pages, dtype=torch.bool), torch.zeros(pages, **i64),
                        torch.zeros(pages, **i64), out, page_size=ps, width=w,
                        block_pages=block, pages_per_seg=4, available=torch.zeros(1, **i64),
                        count_scale=256)


def band_pack(d: int):
    """SegmentStore's install with pack_kernel: one pack_layout per layout (every layer at
    once: per-segment offsets), two launches (K, V); the pairs (K_i, V_i) cover every K and every V width set of the default candidates."""
    from mosaickv_kernels.band_pack import pack_layout
    from mosaickv_sglang.codec.arena import HEADER_WIDTH

    pairs = _pairs()
    ks = list(dict.fromkeys(k for k, _ in pairs))
    vs = list(dict.fromkeys(v for _, v in pairs))
    h = HEADS[d][1]
    for lay in _layouts(d, list(zip(ks, vs))):
        n = 2
        x = torch.randn(n, h, SEGMENT, d)
        pack_layout(torch.zeros(1 << 16, dtype=torch.uint8),
                    torch.zeros(n, HEADER_WIDTH, dtype=torch.int32),
                    torch.arange(n, dtype=torch.int32), x, x.clone(),
                    lay.k.widths(d), lay.v.widths(d), torch.zeros(n, dtype=torch.int64))


def band_errors(d: int):
    """The chooser's error check (chooser errors_first): one launch per candidate, every
    default candidate, sink and rescue band."""
    from mosaickv_kernels.band_errors import band_errors as run
    from mosaickv_sglang.codec.strategies import parse_strategy
    from mosaickv_sglang.config import (DEFAULT_K_CANDIDATES, DEFAULT_RESCUE_CANDIDATES,
                                        DEFAULT_SINK_CANDIDATES, DEFAULT_V_CANDIDATES)

    x = torch.randn(2, SEGMENT, d)
    for spec in dict.fromkeys(DEFAULT_K_CANDIDATES + DEFAULT_V_CANDIDATES +
                              DEFAULT_SINK_CANDIDATES + DEFAULT_RESCUE_CANDIDATES):
        run(x, parse_strategy(spec).widths(d))


def band_encode(d: int):
    """The chooser's encode of its picks (encode_kernel triton): one launch per candidate,
    every default candidate, sink and rescue band."""
    from mosaickv_kernels.band_encode import band_encode as run
    from mosaickv_sglang.codec.strategies import parse_strategy
    from mosaickv_sglang.config import (DEFAULT_K_CANDIDATES, DEFAULT_RESCUE_CANDIDATES,
                                        DEFAULT_SINK_CANDIDATES, DEFAULT_V_CANDIDATES)

    x = torch.randn(2, SEGMENT, d)
    for spec in dict.fromkeys(DEFAULT_K_CANDIDATES + DEFAULT_V_CANDIDATES +
                              DEFAULT_SINK_CANDIDATES + DEFAULT_RESCUE_CANDIDATES):
        run(x, parse_strategy(spec).widths(d))


def band_unpack(d: int):
    """PackedDecode.unpack: a compressed prefix back to bf16 K/V for a prefill chunk."""
    from mosaickv_kernels.band_unpack import unpack_segments

    arena, _ = _arena(d)
    n, h = 2, arena.num_kv_heads
    out = [torch.empty(n * SEGMENT, h, d, dtype=torch.bfloat16) for _ in range(2)]
    unpack_segments(arena, torch.arange(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32),
                    *out)


def row_merge(d: int):
    """PackedDecode.attend for requests over several basis blocks: rows merged by lse."""
    from mosaickv_kernels.row_merge import merge_rows

    hq = HEADS[d][0]
    rows, reqs = 3, 2
    merge_rows(torch.randn(rows, hq, d), torch.randn(rows, hq),
               torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 1]),
               torch.empty(reqs, hq, d, dtype=torch.bfloat16))


def page_gather(d: int):
    """The daemon client copying a hot page of every layer into a slot (bf16 cache)."""
    from mosaickv_kernels.page_gather import PageGather

    h = HEADS[d][1]
    bufs = [torch.zeros(4 * SEGMENT, h, d, dtype=torch.bfloat16) for _ in range(4)]
    PageGather(bufs[:2], bufs[2:], SEGMENT)(1)


def row_copy():
    """SegmentStore adopting pages: every piece one row of one copy_rows launch."""
    from mosaickv_kernels.row_copy import copy_rows

    copy_rows(torch.zeros(8, 4, dtype=torch.int64), 4096)


@dataclasses.dataclass
class Scenario:
    name: str
    kernels: tuple[str, ...]  # module.function of every kernel it launches
    run: object  # callable, no arguments


STAGES = ("band_decode._band_decode_stage1", "band_decode._band_decode_stage2",
          "dense_decode._dense_decode_partial")
# with a page list and several width classes, the list is grouped by class first
SELECT_STAGES = STAGES + ("class_partition._class_partition",)
SCENARIOS = [
    Scenario("decode d128", STAGES, lambda: band_decode(128, False)),
    Scenario("decode d128 select", SELECT_STAGES, lambda: band_decode(128, True)),
    # head_dim 64 (the CPU demo's model): the diagonal pairs only, to keep CI short
    # exact=False (fp16 products, dot_fp16): plan()'s option the benchmarks compare; not the
    # server's default, so the diagonal pairs only
    Scenario("decode d128 fp16", STAGES,
             lambda: band_decode(128, False, "diagonal", exact=False)),
    Scenario("decode d64", STAGES, lambda: band_decode(64, False, "diagonal")),
    Scenario("decode d64 select", SELECT_STAGES, lambda: band_decode(64, True, "diagonal")),
    *(Scenario(f"reads in place d{d}", ("basis_rotate._rotate_rows",
                                        "dense_decode._dense_decode_partial"),
               lambda d=d: server_decode_reads(d)) for d in (128, 64)),
    Scenario("page bounds d128", ("page_select._page_bounds",), lambda: page_bounds(128)),
    Scenario("page bounds d64", ("page_select._page_bounds",), lambda: page_bounds(64)),
    *(Scenario(f"select {n // 1024}K", ("page_select._select_top_pages",
                                        "page_select._rows_from_requests"),
               lambda n=n: select_rows(n)) for n in (32768, 131072, 524288)),
    # stage 1's split count is a kernel argument Triton specializes (1: a constant; a multiple
    # of 16: divisible): on an H100/H200 (132 SMs, two programs per SM) `stage1_splits`
    # plans e.g. 28-32 splits at 1 x 32K, 16 at 2 (a multiple of 16), 8 at 4 (neither) and 1 at
    # 32 requests at head_dim 128; the three kinds are each their own compiled variant
    *(Scenario(f"graph decode d{d}{' select' if sel else ''}"
               f"{'' if splits is None else f' splits {splits}'}",
               ("request_decode._request_queries", "request_decode._request_decode_stage1",
                "request_decode._request_decode_stage2")
               + (("page_select._page_bounds", "page_select._select_top_pages",
                   "page_rescore._page_rescore") if sel else ()),
               lambda d=d, sel=sel, splits=splits: graph_decode(d, sel, splits))
      for d in (128, 64) for sel in (True, False) for splits in (None, 9, 32)),
    # `graph_products: bf16`: stage 1 with single bf16 MMAs (its own compiled variant)
    *(Scenario(f"graph decode d128 select bf16{'' if splits is None else f' splits {splits}'}",
               ("request_decode._request_queries", "request_decode._request_decode_stage1",
                "request_decode._request_decode_stage2", "page_select._page_bounds",
                "page_select._select_top_pages", "page_rescore._page_rescore"),
               lambda splits=splits: graph_decode(128, True, splits, "bf16"))
      for splits in (None, 32)),
    # `select.rescore_layout: columns`: the second stage channel by channel on one warp
    Scenario("graph decode d128 select rescore columns",
             ("request_decode._request_queries", "request_decode._request_decode_stage1",
              "request_decode._request_decode_stage2", "page_select._page_bounds",
              "page_select._select_top_pages", "page_rescore._page_rescore"),
             lambda: graph_decode(128, True, None, "exact", "columns")),
    # `select.rescore_layout: bands`: the second stage band by band from the header, one warp
    Scenario("graph decode d128 select rescore bands",
             ("request_decode._request_queries", "request_decode._request_decode_stage1",
              "request_decode._request_decode_stage2", "page_select._page_bounds",
              "page_select._select_top_pages", "page_rescore._page_rescore"),
             lambda: graph_decode(128, True, None, "exact", "bands")),
    Scenario("decode tables", ("decode_tables._decode_tables",), decode_tables),
    Scenario("pack d128", ("band_pack._pack_kind",), lambda: band_pack(128)),
    Scenario("pack d64", ("band_pack._pack_kind",), lambda: band_pack(64)),
    Scenario("errors d128", ("band_errors._band_errors",), lambda: band_errors(128)),
    Scenario("errors d64", ("band_errors._band_errors",), lambda: band_errors(64)),
    Scenario("encode d128", ("band_encode._band_encode",), lambda: band_encode(128)),
    Scenario("encode d64", ("band_encode._band_encode",), lambda: band_encode(64)),
    Scenario("unpack d128", ("band_unpack._unpack_segments",), lambda: band_unpack(128)),
    Scenario("unpack d64", ("band_unpack._unpack_segments",), lambda: band_unpack(64)),
    Scenario("merge d128", ("row_merge._merge_rows",), lambda: row_merge(128)),
    Scenario("merge d64", ("row_merge._merge_rows",), lambda: row_merge(64)),
    Scenario("gather d128", ("page_gather._gather_page_kernel",), lambda: page_gather(128)),
    Scenario("gather d64", ("page_gather._gather_page_kernel",), lambda: page_gather(64)),
    Scenario("copy rows", ("row_copy._copy_rows_kernel",), row_copy),
]


def covered_kernels() -> set[str]:
    return {k for s in SCENARIOS for k in s.kernels}


# ---- coverage: every @triton.jit function reached from a compiled kernel --------------------

def _is_jit(dec: ast.expr) -> bool:
    """@triton.jit, @jit, @triton.jit(...)"""
    dec = dec.func if isinstance(dec, ast.Call) else dec
    return (isinstance(dec, ast.Attribute) and dec.attr == "jit") or \
        (isinstance(dec, ast.Name) and dec.id == "jit")


def jit_call_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """{module: source} of the kernel package -> {"module.function": the package's jit
    functions it calls} for every @triton.jit function (calls by name, through `from .mod
    import f` / `from mosaickv_kernels.mod import f`, or `mod.f` after `from . import mod`)."""
    trees = {mod: ast.parse(src) for mod, src in sources.items()}
    jit = {mod: {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
                 and any(map(_is_jit, f.decorator_list))} for mod, tree in trees.items()}
    graph: dict[str, set[str]] = {}
    for mod, tree in trees.items():
        names = {f: f"{mod}.{f}" for f in jit[mod]}  # local name -> qualified jit function
        modules = {}  # local name -> package module
        for node in tree.body:
            if not isinstance(node, ast.ImportFrom):
                continue
            parts = (node.module or "").split(".")
            inside = node.level or parts[0] in ("mosaickv_kernels", "triton_kernels")
            for alias in node.names:
                local = alias.asname or alias.name
                if inside and alias.name in jit.get(parts[-1], ()):  # from .mod import f
                    names[local] = f"{parts[-1]}.{alias.name}"
                elif inside and alias.name in trees:  # from . import mod
                    modules[local] = alias.name
        for f in tree.body:
            if not (isinstance(f, ast.FunctionDef) and f.name in jit[mod]):
                continue
            calls = set()
            for node in ast.walk(f):
                if not isinstance(node, ast.Call):
                    continue
                fn = node.func
                if isinstance(fn, ast.Name) and fn.id in names:
                    calls.add(names[fn.id])
                elif isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and \
                        fn.value.id in modules and fn.attr in jit[modules[fn.value.id]]:
                    calls.add(f"{modules[fn.value.id]}.{fn.attr}")
            graph[f"{mod}.{f.name}"] = calls - {f"{mod}.{f.name}"}
    return graph


def uncovered(graph: dict[str, set[str]], covered: set[str]) -> list[str]:
    """jit functions neither compiled as a kernel nor called (transitively) by one."""
    seen, todo = set(), [k for k in covered if k in graph]
    while todo:
        k = todo.pop()
        if k not in seen:
            seen.add(k)
            todo += graph[k]
    return sorted(set(graph) - seen)


def kernel_sources(folder: Path = REPO / "triton_kernels") -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(folder.glob("*.py")) if p.stem != "__init__"}


# ---- capture ------------------------------------------------------------------------------

def _short(full_name: str) -> str:
    """mosaickv_kernels.band_decode._band_decode_stage1 -> band_decode._band_decode_stage1"""
    return full_name.split(".", 1)[1] if full_name.startswith("mosaickv_kernels.") else full_name


def capture(scenarios=SCENARIOS) -> tuple[list[dict], list[str]]:
    """Run every scenario with launches stopped before they compile. Returns (variants,
    errors): one variant per distinct (kernel, specialization), first scenario first."""
    driver.set_active(_Sm90Driver())
    seen: dict[tuple, dict] = {}
    errors: list[str] = []
    launched: list[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        data = json.loads(compile["specialization_data"])
        name = _short(data["name"])
        launched.append(name)
        seen.setdefault((name, str(key)), {"kernel": name, "scenario": current[0],
                                           "spec": compile["specialization_data"]})
        return True  # skip the compile and the launch

    current = [""]
    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        for sc in scenarios:
            current[0] = sc.name
            launched.clear()
            try:
                sc.run()
            except Exception as exc:  # report every scenario, then fail
                errors.append(f"{sc.name}: {type(exc).__name__}: {exc}")
                continue
            if set(launched) != set(sc.kernels):
                errors.append(f"{sc.name}: launched {sorted(set(launched))}, declares "
                              f"{sorted(sc.kernels)} (update SCENARIOS)")
    finally:
        knobs.runtime.jit_cache_hook = old
    return list(seen.values()), errors


# ---- compile ------------------------------------------------------------------------------

_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def parse_ptxas(log: str) -> dict:
    """Registers, stack frame and spill bytes from `ptxas -v` output (one entry function)."""
    out = {}
    for key, pat in _PTXAS.items():
        m = pat.search(log)
        out[key] = int(m.group(1)) if m else None
    return out


def _worker_init():
    driver.set_active(_Sm90Driver())
    knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v's log: read below


def _cpu_seconds() -> float:
    import resource

    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def compile_variant(variant: dict) -> dict:
    """Compile one recorded variant to a cubin (in a worker process)."""
    import importlib

    data = json.loads(variant["spec"])
    module, name = data["name"].rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name)
    t0, c0 = time.perf_counter(), _cpu_seconds()
    log = io.StringIO()
    row = {k: v for k, v in variant.items() if k != "spec"}
    try:
        with contextlib.redirect_stdout(log):
            kernel = fn.preload(variant["spec"])
        if variant.get("dump"):
            _dump(kernel, Path(variant["dump"]) / f"{name}_v{variant['index']}")
        row.update(parse_ptxas(log.getvalue()), ok="cubin" in kernel.asm,
                   shared=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                   num_stages=kernel.metadata.num_stages, cubin_bytes=len(kernel.asm["cubin"]))
        if row["registers"] is None:
            row.update(ok=False, error="no ptxas -v log (a cached compile?): " +
                       log.getvalue()[-500:])
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[-3000:])
    row["seconds"] = round(time.perf_counter() - t0, 2)
    row["cpu_seconds"] = round(_cpu_seconds() - c0, 2)  # this process + ptxas: load-independent
    names = list(data["signature"])  # constants: the declared constexprs (not ints == 1)
    row["constexprs"] = {names[k[0]]: v for k, v in zip(data["constant_keys"],
                                                        data["constant_vals"])
                         if data["signature"][names[k[0]]] == "constexpr"}
    return row


def _dump(kernel, stem: Path) -> None:
    """TTGIR, PTX and SASS of a compiled variant, as stem.ttgir / .ptx / .sass."""
    import subprocess

    stem.parent.mkdir(parents=True, exist_ok=True)
    for kind in ("ttgir", "ptx"):
        if kind in kernel.asm:
            stem.with_suffix(f".{kind}").write_text(kernel.asm[kind])
    cubin = stem.with_suffix(".cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True)
    stem.with_suffix(".sass").write_text(sass.stdout or sass.stderr)


def compile_all(variants: list[dict], jobs: int) -> list[dict]:
    # stage 1 of the band decode takes ~3 s a variant, the rest < 1.5 s: longest first
    order = sorted(range(len(variants)),
                   key=lambda i: "stage1" not in variants[i]["kernel"])
    with tempfile.TemporaryDirectory(prefix="sm90_cache_") as cache:
        # a fresh Triton cache: every variant goes through ptxas (whose log is the report)
        old = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"),
                                     initializer=_worker_init) as pool:
                rows = list(pool.map(compile_variant, [variants[i] for i in order]))
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old
    back = [None] * len(rows)
    for i, row in zip(order, rows):
        back[i] = row
    return back


# ---- report -------------------------------------------------------------------------------

def variant_label(row: dict, rows: list[dict]) -> str:
    """The constexprs (and warps) in which this variant differs from the kernel's others."""
    same = [r for r in rows if r["kernel"] == row["kernel"]]
    keys = [k for k in row["constexprs"]
            if len({json.dumps(r["constexprs"].get(k)) for r in same}) > 1]
    parts = [f"{k}={row['constexprs'][k]}" for k in keys]
    if len({r.get("num_warps") for r in same}) > 1:
        parts.append(f"warps={row.get('num_warps')}")
    return " ".join(parts)


def table(rows: list[dict]) -> str:
    lines = [f"{'kernel':<34} {'scenario':<19} {'regs':>4} {'spill st/ld':>11} {'stack':>5} "
             f"{'smem':>6} {'s':>5}  variant"]
    for r in sorted(rows, key=lambda r: (r["kernel"], r["scenario"])):
        if not r.get("ok"):
            lines.append(f"{r['kernel']:<34} {r['scenario']:<19} FAILED: "
                         f"{r.get('error', '')[:200]}")
            continue
        lines.append(f"{r['kernel']:<34} {r['scenario']:<19} {r['registers']:>4} "
                     f"{r['spill_stores']:>5}/{r['spill_loads']:<5} {r['stack']:>5} "
                     f"{r['shared']:>6} {r['seconds']:>5.1f}  {variant_label(r, rows)}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    """Per kernel: variants, most registers, most spill bytes (stores + loads)."""
    out = {}
    for r in rows:
        s = out.setdefault(r["kernel"], {"variants": 0, "failed": 0, "max_registers": 0,
                                          "max_spill_bytes": 0, "spilling_variants": 0})
        s["variants"] += 1
        if not r.get("ok"):
            s["failed"] += 1
            continue
        spill = r["spill_stores"] + r["spill_loads"]
        s["max_registers"] = max(s["max_registers"], r["registers"])
        s["max_spill_bytes"] = max(s["max_spill_bytes"], spill)
        s["spilling_variants"] += spill > 0
    return dict(sorted(out.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--only", default=None, help="scenarios whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the variants, compile nothing")
    ap.add_argument("--dump", default=None, help="write TTGIR, PTX and SASS per variant here")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("TRITON_INTERPRET is set: run this as a script (it compiles the GPU path)")
    t0 = time.perf_counter()
    scenarios = [s for s in SCENARIOS if args.only is None or args.only in s.name]
    variants, errors = capture(scenarios)
    print(f"captured {len(variants)} variants of {len({v['kernel'] for v in variants})} kernels "
          f"from {len(scenarios)} scenarios in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.list:
        for v in variants:
            print(f"{v['kernel']:<34} {v['scenario']}")
        for e in errors:
            print("ERROR", e)
        return 1 if errors else 0
    if args.dump:
        for i, v in enumerate(variants):
            v.update(dump=str(Path(args.dump).resolve()), index=i)
    rows = compile_all(variants, args.jobs)
    for r in rows:
        r.pop("dump", None)
    print(table(rows))
    report = {"target": {"backend": TARGET.backend, "arch": TARGET.arch,
                         "warp_size": TARGET.warp_size},
              "triton": triton.__version__, "torch": torch.__version__,
              "seconds": round(time.perf_counter() - t0, 1), "jobs": args.jobs,
              "scenarios": [{"name": s.name, "kernels": list(s.kernels)} for s in scenarios],
              "capture_errors": errors, "kernels": summary(rows), "variants": rows}
    for path in filter(None, (args.json, os.environ.get("MOSAICKV_SM90_REPORT"))):
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
    for e in errors:
        print("ERROR", e)
    failed = [r for r in rows if not r.get("ok")]
    print(f"{len(rows) - len(failed)}/{len(rows)} variants compiled for sm_90 in "
          f"{report['seconds']} s ({args.jobs} jobs)")
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
