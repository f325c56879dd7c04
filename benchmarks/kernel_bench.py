"""Decode attention on packed band segments (mosaickv_kernels.band_decode) vs dense bf16 kernels.

For batch x context x head config: random K/V compressed with a default-like band layout (no
selection, and a page list of --select-budget tokens), timed with CUDA events (median of
--reps, L2 flushed between reps), against SGLang's dense Triton decode kernel at its best
num_kv_splits and FlashInfer's BatchDecodeWithPagedKVCacheWrapper when importable. Reports time,
speedup, the bytes our kernels read (codes, scales, headers, selection list, bases, q, hot
buffer, split workspace) and the bandwidth as a fraction of --peak-tbs. A correctness check vs
the torch reference (`codec.attention.decode_attention`) at a small shape runs first; a
mismatch or a NaN exits with status 1.

    python benchmarks/kernel_bench.py --json benchmarks/results/kernel_bench.json
    python benchmarks/kernel_bench.py --dry-run          # CPU, Triton interpreter, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from mosaickv_kernels.band_decode import BandDecodeWrapper  # noqa: E402
from mosaickv_kernels.band_unpack import decode_rotated_reference  # noqa: E402
from mosaickv_kernels.page_select import PackedPageMeta, pack_page_meta  # noqa: E402
from mosaickv_sglang.codec.arena import (ALIGN, HEADER_WIDTH, BlockLayout,  # noqa: E402
                                         PackedArena, pack_layer)
from mosaickv_sglang.codec.attention import decode_attention  # noqa: E402
from mosaickv_sglang.codec.layer import compress_layer  # noqa: E402
from mosaickv_sglang.codec.strategies import parse_strategy  # noqa: E402
from mosaickv_sglang.config import MosaicConfig, SelectionConfig  # noqa: E402

HEAD_CONFIGS = {"32q/8kv/d128": (32, 8, 128), "9q/3kv/d64": (9, 3, 64)}
# The default K/V candidates of config.py (band widths are per 64 channels: they scale with
# head_dim, so b8=4,b4=60 is 8 + 120 channels at D=128).
MIX = [("b8=4,b4=44,b2=16,group=128", "b8=0,b4=48,b2=16,group=128"),
       ("b8=4,b4=60,b2=0,group=128", "b8=4,b4=60,b2=0,group=128"),
       ("b8=16,b4=48,b2=0,group=64", "b8=16,b4=48,b2=0,group=64")]
SEGMENT, PAGE, HOT = 128, 32, 64
SGLANG_SPLITS = (8, 16, 32, 64)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--configs", nargs="+", default=list(HEAD_CONFIGS), choices=list(HEAD_CONFIGS))
    ap.add_argument("--band", default="b8=4,b4=60,b2=0,group=128",
                    help="band layout for K and V; widths per 64 channels (the default is "
                         "b8=8, b4=120 at D=128)")
    ap.add_argument("--mix", action="store_true",
                    help="cycle the three default chooser layouts per segment instead of --band")
    ap.add_argument("--select-budget", type=int, default=4096,
                    help="tokens per (request, KV head) in the selection run (0: skip it)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mem-cap-gb", type=float, default=100.0,
                    help="skip combos whose buffers would exceed this (GiB)")
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s (spec)")
    ap.add_argument("--read-tbs", type=float, default=4.4,
                    help="measured read bandwidth, TB/s (device-runtime.md: FlashInfer 4.39); "
                         "the run also measures a 4 GiB torch.sum")
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 between reps")
    ap.add_argument("--no-graph", action="store_true",
                    help="time eager launches instead of CUDA graph replays (adds host overhead)")
    ap.add_argument("--our-splits", type=int, nargs="+", default=None,
                    help="num_kv_splits values to try for our kernel (default: plan's heuristic)")
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4],
                    help="num_warps values to try for our stage 1 (best reported)")
    ap.add_argument("--precision", nargs="+", default=["exact"], choices=["exact", "fp16"],
                    help="our products: exact (two bf16 MMAs) and/or fp16 (one MMA); best "
                         "reported")
    ap.add_argument("--block-tokens", type=int, nargs="+", default=[None],
                    help="tokens per stage-1 iteration without selection (32/64/128; default: "
                         "the wrapper's choice by head_dim); several: best reported")
    ap.add_argument("--sglang-src", default=os.environ.get("MOSAICKV_SGLANG_SRC"),
                    help="folder holding SGLang's decode_attention.py and score_mod.py (from "
                         "sglang/kernels/ops/attention/), used when sglang is not importable; "
                         "default $MOSAICKV_SGLANG_SRC (scripts/device_env.sh sets it)")
    ap.add_argument("--meta-channels", type=int, default=8,
                    help="page metadata channels (config select.meta_channels)")
    ap.add_argument("--sink-tokens", type=int, default=64)
    ap.add_argument("--recent-tokens", type=int, default=256)
    ap.add_argument("--check-requests", type=int, default=2,
                    help="requests per shape checked against the torch arena reference")
    ap.add_argument("--json", default=None, help="write all rows here")
    ap.add_argument("--plot", default=None, help="speedup vs context png")
    ap.add_argument("--plot-from", nargs="+", default=None,
                    help="only plot (with --plot) the rows of these JSON files; no GPU needed")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU + Triton interpreter, tiny shapes, one rep (plumbing check)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.batches, args.contexts, args.reps, args.warmup = [2], [512], 1, 0
        args.select_budget = min(args.select_budget, 256)
    return args


def layouts_for(args) -> list[tuple[str, str]]:
    if args.mix:
        return [("band:" + k, "band:" + v) for k, v in MIX]
    spec = "band:" + args.band.removeprefix("band:")
    return [(spec, spec)]


# ---- data --------------------------------------------------------------------------------------

def synth_arena(batch: int, ctx: int, h: int, d: int, layouts, device) -> PackedArena:
    """Random K/V (decaying channel energy, as in the rotated basis) compressed segment by
    segment with Band.encode, written straight into an arena: segments of one layout share a
    region so the copies are strided slices (pack_layer's per-segment loop is too slow here)."""
    sealed = max((ctx - HOT) // SEGMENT, 0) * SEGMENT
    nseg, hot = sealed // SEGMENT, ctx - sealed
    bands = [(parse_strategy(k), parse_strategy(v)) for k, v in layouts]
    lays = [BlockLayout.of(kb, vb, SEGMENT, d) for kb, vb in bands]
    # (request, segment) -> layout i % L; region per layout, request-major inside it.
    members = [[(b, i) for b in range(batch) for i in range(nseg) if i % len(lays) == li]
               for li in range(len(lays))]
    region, pos = [], 0
    for li, lay in enumerate(lays):
        region.append(pos)
        pos += len(members[li]) * h * lay.head_bytes
    data = torch.empty(max(pos, ALIGN), dtype=torch.uint8, device=device)
    headers = torch.zeros(batch * nseg, HEADER_WIDTH, dtype=torch.int32)
    seg_ids = torch.zeros(batch, max(nseg, 1), dtype=torch.int32)
    spectrum = (torch.exp(-torch.linspace(0, 3, d)) * 2).to(device)
    codes_total = scales_total = 0
    gid = 0
    for li, lay in enumerate(lays):
        n = len(members[li])
        view = data[region[li]:region[li] + n * h * lay.head_bytes].view(n, h, lay.head_bytes)
        for j, (b, i) in enumerate(members[li]):
            headers[gid] = lay.header(region[li] + j * h * lay.head_bytes, li)
            seg_ids[b, i] = gid
            gid += 1
        codes, scales = lay.payload_bytes()
        codes_total, scales_total = codes_total + n * h * codes, scales_total + n * h * scales
        chunk = max(1, (1 << 28) // (h * SEGMENT * d * 4))  # ~256 MiB of float32 per kind
        for j0 in range(0, n, chunk):
            c = min(chunk, n - j0)
            for kind, band in (("k", lay.k), ("v", lay.v)):
                x = torch.randn(c * h, SEGMENT, d, device=device) * spectrum
                for name, t in band.encode(x, kind).items():
                    off, size = lay.offsets[f"{kind}.{name}"], lay.sizes[f"{kind}.{name}"]
                    view[j0:j0 + c, :, off:off + size] = t.view(torch.uint8).reshape(c, h, size)
    seg_indptr = torch.arange(batch + 1, dtype=torch.int32) * nseg
    basis = torch.linalg.qr(torch.randn(2, batch, h, d, d, device=device))[0]
    hot_k = torch.randn(batch, h, hot, d, device=device).to(torch.bfloat16)
    return PackedArena(
        data=data, headers=headers.to(device), seg_indptr=seg_indptr.to(device),
        seg_ids=seg_ids[:, :nseg].flatten().to(device), k_basis=basis[0].contiguous(),
        v_basis=basis[1].contiguous(), hot_k=hot_k, hot_v=torch.randn_like(hot_k),
        hot_lens=torch.full((batch,), hot, dtype=torch.int32, device=device),
        plans=torch.stack([lay.channel_plan() for lay in lays]).to(device),
        segment_tokens=SEGMENT, page_tokens=PAGE,
        payload={"codes": codes_total, "scales": scales_total},
        min_group=min(min(kb.group, vb.group) for kb, vb in bands))


def synth_page_meta(arena: PackedArena, m: int) -> PackedPageMeta:
    """Page metadata of the arena's shape (random bounds: the scoring cost does not depend on
    the values; the selection pipeline's correctness is checked on real metadata)."""
    s, h, dev = arena.headers.shape[0], arena.num_kv_heads, arena.device
    pps = arena.segment_tokens // arena.page_tokens
    chans = torch.rand(s, h, arena.head_dim, device=dev).topk(m, -1).indices.sort(-1).values
    lo = -torch.rand(s, h, pps, m, device=dev)
    return PackedPageMeta(chans.to(torch.int32), lo.half(), (lo + 2).half(),
                          torch.rand(s, h, pps, device=dev).half())


def arena_reference(q, arena: PackedArena, b: int, sm_scale: float, keep=None) -> torch.Tensor:
    """Torch oracle for request b straight from the arena bytes through the layout plans
    (`band_unpack.decode_rotated_reference`, independent of the kernel's header-driven band
    tiles): attend over the decoded K/V in the rotated bases (pages outside `keep` [H, P]
    masked) and the hot buffer, rotate back. float32, on the arena's device. -> [Hq, D]"""
    h, d = arena.num_kv_heads, arena.head_dim
    lo, hi = arena.seg_indptr[b:b + 2].tolist()
    hq = q.shape[0]
    g = hq // h
    qs = (q.float() * sm_scale).view(h, g, d)
    k_rot, v_rot = (x.permute(1, 0, 2, 3).reshape(h, -1, d) for x in  # [H, S*T, D]
                    decode_rotated_reference(arena, arena.seg_ids[lo:hi]))
    s_c = torch.einsum("hgd,htd->hgt", qs @ arena.k_basis[b], k_rot)
    if keep is not None:
        tok_keep = keep[:, :s_c.shape[2] // arena.page_tokens].repeat_interleave(
            arena.page_tokens, -1)
        s_c = s_c.masked_fill(~tok_keep[:, None, :], float("-inf"))
    n_hot = int(arena.hot_lens[b])
    s_h = torch.einsum("hgd,htd->hgt", qs, arena.hot_k[b, :, :n_hot].float())
    p = torch.cat([s_c, s_h], -1).softmax(-1)
    n_c = s_c.shape[2]
    o_rot = torch.einsum("hgt,htd->hgd", p[..., :n_c], v_rot)
    out = o_rot @ arena.v_basis[b].transpose(1, 2) + \
        torch.einsum("hgt,htd->hgd", p[..., n_c:], arena.hot_v[b, :, :n_hot].float())
    return out.reshape(hq, d)


def check_shape(q, arena, out, sm_scale, n_requests, keep=None, tol=2e-3) -> dict:
    """rel error of `out` [B, Hq, D] vs arena_reference on the first and last requests."""
    reqs = sorted({0, q.shape[0] - 1} if n_requests >= 2 else {0})
    errs = []
    for b in reqs:
        ref = arena_reference(q[b], arena, b, sm_scale, None if keep is None else keep[b])
        o = out[b].float()
        if not bool(torch.isfinite(o).all()):
            return {"rel_err": float("nan"), "finite": False, "ok": False, "requests": reqs}
        errs.append(float((o - ref).norm() / ref.norm()))
    err = max(errs)
    return {"rel_err": err, "finite": True, "ok": err < tol, "requests": reqs, "tol": tol}


def page_list(batch: int, h: int, pages: int, budget_pages: int, device):
    """Selected pages per (request, KV head): 2 sink pages, 8 recent, random others, sorted."""
    keep = torch.zeros(batch, h, pages, dtype=torch.bool)
    sink = min(2, budget_pages)
    recent = min(8, budget_pages - sink)
    keep[:, :, :sink] = True
    keep[:, :, pages - recent:] = True
    score = torch.rand(batch, h, pages).masked_fill(keep, -1.0)
    extra = max(budget_pages - int(keep[0, 0].sum()), 0)
    keep.scatter_(2, score.topk(min(extra, pages), dim=-1).indices, True)
    ids = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[:, :, :budget_pages]
    counts = keep.sum(-1, dtype=torch.int32)
    return keep, ids.to(torch.int32).contiguous().to(device), counts.to(device)


def estimate_bytes(batch, ctx, hq, h, d, layouts) -> int:
    lays = [BlockLayout.of(parse_strategy(k), parse_strategy(v), SEGMENT, d) for k, v in layouts]
    per_seg = sum(lay.head_bytes for lay in lays) / len(lays) * h
    ours = batch * (ctx // SEGMENT) * per_seg + 2 * batch * h * d * d * 4
    dense = 2 * batch * ctx * h * d * 2 + batch * ctx * 4
    work = batch * hq * max(SGLANG_SPLITS) * (d + 1) * 4 + (1 << 30)  # + encode chunks
    return int(ours + dense + work)


# ---- timing ------------------------------------------------------------------------------------

class Timer:
    def __init__(self, device, reps, warmup, flush, graph):
        self.device, self.reps, self.warmup = device, reps, warmup
        self.cuda = device.type == "cuda"
        self.graph = graph and self.cuda
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) \
            if flush and self.cuda else None

    def __call__(self, fn) -> float:
        """Median milliseconds of fn() (replayed from a CUDA graph unless --no-graph)."""
        if self.graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile and warm outside the capture
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            fn = graph.replay
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.flush is not None:
                self.flush.zero_()
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def load_sglang_decode(src: str | None):
    """sglang.kernels.ops.attention.decode_attention.decode_attention_fwd (sglang 0.5.17), or the
    same file loaded from `src` with stub parent modules where sglang is not installed (its only
    imports are triton, score_mod.py beside it and sglang.srt.utils.is_hip)."""
    try:
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        return decode_attention_fwd
    except Exception:  # noqa: BLE001
        if not src:
            raise
    import importlib.util
    import types
    for name in ("sglang", "sglang.srt", "sglang.kernels", "sglang.kernels.ops",
                 "sglang.kernels.ops.attention"):
        sys.modules.setdefault(name, types.ModuleType(name))
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_hip = lambda: False
    sys.modules["sglang.srt.utils"] = utils
    mod = None
    for short in ("score_mod", "decode_attention"):
        name = f"sglang.kernels.ops.attention.{short}"
        spec = importlib.util.spec_from_file_location(name, os.path.join(src, short + ".py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod.decode_attention_fwd


def sglang_dense(q, k_buf, v_buf, batch, ctx, sm_scale, timer, splits=SGLANG_SPLITS, src=None):
    """Best (ms, splits) of SGLang's dense Triton decode over SGLANG_SPLITS, or (None, reason)."""
    try:
        decode_attention_fwd = load_sglang_decode(src)
    except Exception as exc:  # noqa: BLE001 - any import failure means: no baseline
        return None, f"sglang import failed: {exc!r}"[:200]
    dev = q.device
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * ctx
    indices = torch.arange(batch * ctx, dtype=torch.int32, device=dev)
    o = torch.empty_like(q)
    best = None
    for s in splits:
        logits = torch.empty(batch, q.shape[1], s, q.shape[2], dtype=torch.float32, device=dev)
        lse = torch.empty(batch, q.shape[1], s, dtype=torch.float32, device=dev)
        nsplit = torch.full((batch,), s, dtype=torch.int32, device=dev)

        def fn():
            decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, logits, lse, nsplit, s,
                                 sm_scale, 1.0, 1.0)
        try:
            ms = timer(fn)
        except Exception as exc:  # noqa: BLE001
            return None, f"sglang kernel failed: {exc!r}"[:200]
        if best is None or ms < best[0]:
            best = (ms, s)
    return best


def flashinfer_dense(q, k_buf, v_buf, batch, ctx, sm_scale, timer):
    """ms of FlashInfer's paged decode (page 16, NHD, same buffers), or (None, reason)."""
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001
        return None, f"flashinfer not importable: {exc!r}"[:200]
    if q.device.type != "cuda":
        return None, "flashinfer needs CUDA"
    page = 16
    try:
        hq, h, d = q.shape[1], k_buf.shape[1], q.shape[2]
        dev = q.device
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=hq // h >= 4)
        npages = ctx // page
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * npages
        indices = torch.arange(batch * npages, dtype=torch.int32, device=dev)
        last = torch.full((batch,), page, dtype=torch.int32, device=dev)
        try:
            wrapper.plan(indptr, indices, last, hq, h, d, page, pos_encoding_mode="NONE",
                         sm_scale=sm_scale, q_data_type=q.dtype, kv_data_type=k_buf.dtype)
        except TypeError:
            wrapper.plan(indptr, indices, last, hq, h, d, page, pos_encoding_mode="NONE",
                         sm_scale=sm_scale, data_type=q.dtype)
        cache = (k_buf.view(-1, page, h, d), v_buf.view(-1, page, h, d))
        return timer(lambda: wrapper.run(q, cache)), None
    except Exception as exc:  # noqa: BLE001
        return None, f"flashinfer failed: {exc!r}"[:200]


# ---- correctness -------------------------------------------------------------------------------

def check_correctness(hq, h, d, layouts, device) -> dict:
    """Full pipeline at a small shape: compress_layer (band sink + chooser over `layouts`, page
    metadata), pack_layer + pack_page_meta, GPU page selection (must pick the reference
    selector's pages) and the kernel vs decode_attention."""
    torch.manual_seed(0)
    cfg = MosaicConfig(
        sink_candidates=["band:b8=64,b4=0,b2=0,group=32"],
        k_candidates=[k for k, _ in layouts], v_candidates=[v for _, v in layouts],
        k_error_budget=10.0, v_error_budget=10.0, sink_error_budget=10.0,
        select=SelectionConfig(budget_tokens=256, sink_tokens=32, recent_tokens=64))
    layers, keeps, refs = [], [], []
    q = (torch.randn(2, hq, d) * 2).to(torch.bfloat16)
    for b, t in enumerate((5 * 128 + 70, 4 * 128 + 100)):
        k = (torch.randn(h, t, d) * torch.exp(-torch.linspace(0, 2, d)) * 3).to(torch.bfloat16)
        layer = compress_layer(k, torch.randn(h, t, d).to(torch.bfloat16), cfg)
        out, info = decode_attention(q[b:b + 1].float(), layer, torch.tensor([t - 1]),
                                     cfg.select, PAGE)
        layers.append(layer)
        keeps.append(info.page_keep[0])
        refs.append(out[0])
    keep = torch.zeros(2, h, max(kp.shape[1] for kp in keeps), dtype=torch.bool)
    for b, kp in enumerate(keeps):
        keep[b, :, :kp.shape[1]] = kp
    arena = pack_layer(layers).to(device)
    meta = pack_page_meta([s.pages for layer in layers for s in layer.segments]).to(device)
    wrapper = BandDecodeWrapper()
    wrapper.plan(arena, hq, num_kv_splits=3)
    sel = cfg.select
    ids, counts = wrapper.select(q.to(device), arena, meta,
                                 budget_pages=sel.budget_tokens // PAGE,
                                 sink_pages=-(-sel.sink_tokens // PAGE),
                                 recent_pages=-(-sel.recent_tokens // PAGE))
    got_keep = torch.zeros_like(keep)
    for b in range(2):
        for hh in range(h):
            got_keep[b, hh, ids[b, hh, :int(counts[b, hh])].long().cpu()] = True
    out = wrapper.run(q.to(device), arena, page_ids=ids, page_counts=counts,
                      out_dtype=torch.float32)
    ref = torch.stack(refs)
    out = out.cpu().double()
    finite = bool(torch.isfinite(out).all())
    err = float((out - ref.double()).norm() / ref.double().norm()) if finite else float("nan")
    same = bool(torch.equal(got_keep, keep))
    return {"shape": f"B=2 Hq={hq} H={h} D={d} ctx~{5 * 128 + 70}", "rel_err": err,
            "finite": finite, "same_pages_as_reference": same,
            "ok": finite and err < 2e-3 and same}


# ---- main --------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        if not args.plot:
            print("--plot-from needs --plot PATH")
            return 2
        rows = [r for f in args.plot_from for r in json.load(open(f))["rows"]]
        plot(rows, args.plot, args.peak_tbs)
        print_table(rows, args.peak_tbs)
        return 0
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --dry-run for the CPU plumbing check")
        return 2
    timer = Timer(device, args.reps, args.warmup, not args.no_flush, not args.no_graph)
    if device.type == "cuda":  # a plain streaming read, the ceiling our bytes are held to
        x = torch.randn(1 << 30, device=device)  # 4 GiB fp32
        ms = timer(lambda: x.sum())
        args.measured_read_tbs = x.numel() * 4 / (ms * 1e-3) / 1e12
        print(f"[bw] torch.sum over 4 GiB: {ms:.3f} ms = {args.measured_read_tbs:.2f} TB/s",
              flush=True)
        del x
    peak = args.peak_tbs * 1e12
    cap = args.mem_cap_gb * 2**30
    rows, checks = [], []

    for cname in args.configs:
        hq, h, d = HEAD_CONFIGS[cname]
        layouts = layouts_for(args)
        chk = check_correctness(hq, h, d, layouts, device)
        chk["config"] = cname
        checks.append(chk)
        print(f"[check] {cname}: rel_err={chk['rel_err']:.2e} finite={chk['finite']} "
              f"-> {'ok' if chk['ok'] else 'FAIL'}", flush=True)
        if not chk["ok"]:
            continue
        for batch in args.batches:
            for ctx in args.contexts:
                need = estimate_bytes(batch, ctx, hq, h, d, layouts)
                base = {"config": cname, "batch": batch, "context": ctx,
                        "layouts": [list(x) for x in layouts]}
                if need > cap:
                    rows.append({**base, "skipped": f"needs ~{need / 2**30:.0f} GiB > cap"})
                    print(f"[skip] {cname} B={batch} ctx={ctx}: ~{need / 2**30:.0f} GiB",
                          flush=True)
                    continue
                rows += run_combo(base, batch, ctx, hq, h, d, layouts, device, timer, peak, args)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                write_json(args, device, checks, rows)  # after every combo: partial runs count

    write_json(args, device, checks, rows)
    if args.plot:
        plot(rows, args.plot, args.peak_tbs)
    print_table(rows, args.peak_tbs)
    bad = [c["config"] for c in checks if not c["ok"]] + \
        [f"{r['config']} B={r['batch']} ctx={r['context']} {r['mode']}"
         for r in rows if "check" in r and not r["check"]["ok"]]
    if bad:
        print(f"FAILED (mismatch vs reference or non-finite output): {bad}")
    return 1 if bad else 0


def write_json(args, device, checks, rows) -> None:
    if not args.json:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "args": vars(args), "checks": checks, "torch": torch.__version__}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def run_combo(base, batch, ctx, hq, h, d, layouts, device, timer, peak, args) -> list[dict]:
    torch.manual_seed(batch * 7 + ctx)
    sm_scale = d ** -0.5
    arena = synth_arena(batch, ctx, h, d, layouts, device)
    pages = arena.pages_per_request()[0]
    q = torch.randn(batch, hq, d, device=device).to(torch.bfloat16)
    out = []

    # Dense baselines on the same context, bf16 [tokens, H, D] (SGLang's layout).
    dense_bytes = 2 * batch * ctx * h * d * 2 + batch * ctx * 4
    k_buf = torch.randn(batch * ctx, h, d, device=device, dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    if batch * ctx * h * d >= 2**31:  # kv_loc * stride is int32 in SGLang's stage 1
        sg = (None, "SGLang's decode kernel computes KV offsets in int32: B*ctx*H*D >= 2^31 "
                    "overflows (illegal address)")
    else:
        sg = sglang_dense(q, k_buf, v_buf, batch, ctx, sm_scale, timer,
                          SGLANG_SPLITS[:1] if args.dry_run else SGLANG_SPLITS, args.sglang_src)
    fi = flashinfer_dense(q, k_buf, v_buf, batch, ctx, sm_scale, timer)
    del k_buf, v_buf
    if device.type == "cuda":
        torch.cuda.empty_cache()

    budget_pages = args.select_budget // PAGE
    modes = ["all"] + ([f"sel{args.select_budget}"] if args.select_budget and
                       budget_pages < pages else [])
    meta = synth_page_meta(arena, args.meta_channels) if len(modes) > 1 else None
    sink, recent = -(-args.sink_tokens // PAGE), -(-args.recent_tokens // PAGE)
    for mode in modes:
        best, timings = None, {}
        variants = [(s, w, p, bt) for s in args.our_splits or [None] for w in args.num_warps
                    for p in args.precision
                    for bt in (args.block_tokens if mode == "all" else [None])]
        for splits, warps, precision, block in variants:
            wrapper = BandDecodeWrapper()
            wrapper.plan(arena, hq, sm_scale=sm_scale, num_kv_splits=splits,
                         max_selected_pages=None if mode == "all" else budget_pages,
                         block_tokens=block, num_warps=warps, exact=precision == "exact")
            if mode == "all":
                def step(w=wrapper):
                    return w.run(q, arena)
            else:
                def step(w=wrapper):
                    ids, counts = w.select(q, arena, meta, budget_pages=budget_pages,
                                           sink_pages=sink, recent_pages=recent)
                    return w.run(q, arena, page_ids=ids, page_counts=counts)
            ms = timer(step)
            timings[f"{precision}/w{warps}/b{wrapper.block_n if mode == 'all' else PAGE}"
                    f"/s{wrapper.num_splits}"] = ms
            if best is None or ms < best[0]:
                best = (ms, wrapper, step)
        ms, wrapper, step = best
        row = {**base, "mode": mode, "ms": ms, "splits": wrapper.num_splits,
               "num_warps": wrapper.num_warps, "exact": wrapper.exact,
               "block_tokens": wrapper.block_n if mode == "all" else PAGE,
               "variant_ms": timings,
               "width_classes": len(wrapper.widths), "arena_bytes": arena.nbytes(),
               "dense_bytes": dense_bytes}
        keep = None
        if mode == "all":
            res = wrapper.run(q, arena, out_dtype=torch.float32)  # checked before bf16 rounding
        else:
            ids, counts = wrapper.select(q, arena, meta, budget_pages=budget_pages,
                                         sink_pages=sink, recent_pages=recent)
            keep = torch.zeros(batch, h, pages + 1, dtype=torch.bool, device=device)
            rank = torch.arange(ids.shape[2], device=device)
            keep.scatter_(2, torch.where(rank < counts[..., None], ids, pages).long(), True)
            keep = keep[:, :, :pages]
            res = wrapper.run(q, arena, page_ids=ids, page_counts=counts, out_dtype=torch.float32)
            row["select_ms"] = timer(lambda: wrapper.select(q, arena, meta,
                                                            budget_pages=budget_pages,
                                                            sink_pages=sink,
                                                            recent_pages=recent))
            row["decode_ms"] = timer(lambda: wrapper.run(q, arena, page_ids=ids,
                                                         page_counts=counts))
            row["pages_read"] = int(counts.sum())
        nbytes = wrapper.bytes_read(arena, None if keep is None else keep.cpu())
        if meta is not None and mode != "all":
            nbytes["page_meta"] = meta.nbytes()  # every page scored
            nbytes["bounds"] = 2 * batch * h * wrapper.max_pages * 4  # written, read by top-k
            nbytes["total"] = sum(v for k, v in nbytes.items() if k != "total")
        row.update(bytes=nbytes, bw_frac=nbytes["total"] / (ms * 1e-3) / peak,
                   bw_frac_read=nbytes["total"] / (ms * 1e-3) / (args.read_tbs * 1e12))
        chk = check_shape(q, arena, res, sm_scale, args.check_requests, keep,
                          5e-4 if wrapper.exact else 2e-3)  # fp32 sums over 128K tokens: ~1e-4
        row.update(check=chk, finite=chk["finite"])
        if sg[0] is not None:
            row.update(sglang_ms=sg[0], sglang_splits=sg[1], speedup_vs_sglang=sg[0] / ms,
                       sglang_bw_frac=dense_bytes / (sg[0] * 1e-3) / peak)
        else:
            row["sglang_skipped"] = sg[1]
        if fi[0] is not None:
            row.update(flashinfer_ms=fi[0], speedup_vs_flashinfer=fi[0] / ms,
                       flashinfer_bw_frac=dense_bytes / (fi[0] * 1e-3) / peak)
        else:
            row["flashinfer_skipped"] = fi[1]
        print(f"[run] {base['config']} B={batch} ctx={ctx} {mode}: {ms:.3f} ms "
              f"(splits {wrapper.num_splits}, warps {wrapper.num_warps}, "
              f"{'exact' if wrapper.exact else 'fp16'}, block {row['block_tokens']}) "
              f"({row['bw_frac']:.0%} of peak), sglang "
              f"{'%.3f ms' % sg[0] if sg[0] is not None else 'n/a'}, flashinfer "
              f"{'%.3f ms' % fi[0] if fi[0] is not None else 'n/a'}; check "
              f"{chk['rel_err']:.1e} {'ok' if chk['ok'] else 'FAIL'}"
              + (f"; select {row['select_ms']:.3f} + decode {row['decode_ms']:.3f} ms"
                 if "select_ms" in row else ""), flush=True)
        out.append(row)
    return out


def print_table(rows, peak_tbs):
    head = (f"{'config':<13} {'B':>4} {'ctx':>7} {'mode':<9} {'ours ms':>9} {'MB read':>9} "
            f"{'%peak':>6} {'sglang ms':>10} {'(splits)':>8} {'x sgl':>6} {'fi ms':>8} "
            f"{'x fi':>6} {'sel+dec ms':>11} {'%4.4':>6} {'check':>8}")
    print(f"\nband decode vs dense bf16 (peak {peak_tbs} TB/s)")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['config']:<13} {r['batch']:>4} {r['context']:>7} skipped: {r['skipped']}")
            continue
        sg = f"{r['sglang_ms']:>10.3f} {r['sglang_splits']:>8} {r['speedup_vs_sglang']:>6.2f}" \
            if "sglang_ms" in r else f"{'n/a':>10} {'':>8} {'':>6}"
        fi = f"{r['flashinfer_ms']:>8.3f} {r['speedup_vs_flashinfer']:>6.2f}" \
            if "flashinfer_ms" in r else f"{'n/a':>8} {'':>6}"
        parts = f"{r['select_ms']:.3f}+{r['decode_ms']:.3f}" if "select_ms" in r else ""
        chk = r.get("check", {})
        status = "NaN!" if not r["finite"] else ("ok" if chk.get("ok", True) else "FAIL")
        print(f"{r['config']:<13} {r['batch']:>4} {r['context']:>7} {r['mode']:<9} "
              f"{r['ms']:>9.3f} {r['bytes']['total'] / 1e6:>9.1f} {r['bw_frac']:>6.1%} "
              f"{sg} {fi} {parts:>11} {r.get('bw_frac_read', 0):>6.1%} {status:>8}")
    if not rows:
        print("(no rows)")


def plot(rows, path: str, peak_tbs: float) -> None:
    """Speedup over FlashInfer and SGLang vs context, one line per (config, batch, mode):
    color = batch, solid = every page read, dashed = with selection, o = D128, ^ = D64."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [r for r in rows if "ms" in r]
    colors = {1: "tab:blue", 8: "tab:red", 32: "tab:green", 128: "tab:purple"}  # by batch
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, (key, name) in zip(axes, (("speedup_vs_flashinfer", "FlashInfer decode"),
                                      ("speedup_vs_sglang", "SGLang Triton decode"))):
        lines = sorted({(r["config"], r["batch"], r["mode"]) for r in done if key in r})
        for cfg, b, mode in lines:
            pts = sorted((r["context"], r[key]) for r in done
                         if (r["config"], r["batch"], r["mode"]) == (cfg, b, mode) and key in r)
            ax.plot([c // 1024 for c, _ in pts], [v for _, v in pts],
                    ("-" if mode == "all" else "--") + ("o" if "d128" in cfg else "^"),
                    color=colors.get(b), label=f"{cfg} B={b} {mode}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_title(f"MosaicKV band decode vs {name}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speedup (dense ms / ours ms)")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
