"""GPU time of selection's second stage (`page_rescore`) alone, per launch configuration, on the
candidate lists the decode graph gives it: which layout, candidates per program and prefetch;
and of the first stage's top-k (`select_page_list`) by its radix plan (bits or 8-bit digits)
and warps, each checked to keep the same pages.

The pool and backend of `decode_step_bench.py` (Llama-3.1-8B attention shape, the chooser's real
layout mix, the default config) at CTX x B, one step's tables, layer 0's queries, bounds and
first-stage candidates (`rescore_factor` x the budget) exactly as `GraphDecode.attend` builds
them; then each variant's `page_rescore` captured in a CUDA graph (`--reps` launches per replay)
and timed with CUDA events. Every variant's scores are compared with the first's (the same
products per candidate: equal up to the order of a candidate's channel sums across layouts).

    python benchmarks/page_rescore_bench.py --contexts 131072 --batches 1,8 --json /tmp/r.json

On the CPU (`TRITON_INTERPRET=1 ... --device cpu`, small shapes) it checks the variants' scores
and times nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mosaickv_sglang.config import MosaicConfig  # noqa: E402

VARIANTS = ("rows:16:1", "rows:16:0", "rows:4:1", "rows:8:1", "columns:16:1", "columns:4:1",
            "bands:16:1", "bands:16:0", "bands:4:1", "bands:8:1", "bands:2:1")


def candidates(ctx: int, bs: int, args, cfg: MosaicConfig):
    """(page_rescore's inputs, kwargs) for layer 0 of one decode step at ctx x bs."""
    from decode_step_bench import build
    from mosaickv_kernels.page_select import page_bounds, select_page_list

    dev = args.device
    backend, pool, req_to_token = build(ctx, bs, 1, args.kv_heads, args.head_dim, dev, cfg,
                                        args.chunk, args.seed)
    reqs = torch.arange(1, bs + 1)
    seq = torch.full((bs,), ctx + 1)
    fwd = SimpleNamespace(batch_size=bs, num_padding=0, req_pool_indices=reqs.to(dev),
                          seq_lens=seq.to(dev), seq_lens_cpu=seq,
                          out_cache_loc=req_to_token[reqs, ctx].long().to(dev))
    backend.init_cuda_graph_state(bs, bs)
    backend.init_forward_metadata_out_graph(fwd)
    g = backend.graph
    bk = g.bucket
    g.plan_bucket(bk, args.q_heads, args.head_dim ** -0.5)
    q = torch.randn(bs, args.q_heads, args.head_dim, device=dev, dtype=torch.bfloat16)
    q_rot, _ = bk.decoder.queries(q, bk.basis_ptrs, 0, bk.req_pages)
    bounds = page_bounds(q_rot, pool.store.meta[0], bk.seg_indptr, bk.seg_ids, g.row_pages,
                         out=bk.bounds, rows_per_out=g.width)
    factor, channels = cfg.select.rescore_factor, cfg.select.rescore_channels
    ids, counts = select_page_list(bounds, bk.req_pages, g.budget_pages * factor, g.sink_pages,
                                   g.recent_pages)
    store = pool.store
    inputs = (q_rot, store.data[0], store.headers[0], store.plans, bk.seg_indptr, bk.seg_ids,
              ids.clone(), counts.clone())
    kw = dict(rows_per_owner=g.width, row_pages=g.row_pages, pages_per_seg=g.pps,
              channels=channels)
    # the first stage's top-k on the bounds (a copy: page_rescore overwrites bk.bounds)
    select = (bounds.clone(), bk.req_pages, g.budget_pages * factor, g.sink_pages,
              g.recent_pages)
    return inputs, kw, bk.bounds.shape, int(counts.sum()), (backend, pool), select


def time_variant(fn, reps: int) -> float:
    """us per launch: `reps` launches captured in one graph, replayed 5 times after a warm-up."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (5 * reps)


def main() -> None:
    from mosaickv_kernels.page_rescore import page_rescore
    from mosaickv_kernels.page_select import select_page_list

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="layout:block:prefetch, comma-separated (the first is the reference)")
    ap.add_argument("--config", default="{}", help="MosaicConfig JSON over the default")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topk-only", action="store_true",
                    help="time the top-k plans alone on random bounds (no pool: no SGLang)")
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    cfg = MosaicConfig.from_dict({"decode_kernel": "triton", "decode_cuda_graph": "full",
                                  **json.loads(args.config)})
    variants = []
    for v in args.variants.split(","):
        layout, block, prefetch = v.split(":")
        variants.append((v, dict(layout=layout, block=int(block), prefetch=prefetch == "1")))
    rows = []
    for ctx in (int(x) for x in args.contexts.split(",")):
        for bs in (int(x) for x in args.batches.split(",")):
            if args.topk_only:  # random bounds of the decode graph's shape: no pool, no SGLang
                pages = ctx // cfg.page_tokens
                gen = torch.Generator(device=args.device).manual_seed(args.seed)
                bounds = torch.randn(bs, args.kv_heads, pages, generator=gen,
                                     device=args.device)
                select = (bounds, torch.full((bs,), pages, dtype=torch.int32,
                                             device=args.device),
                          cfg.select.budget_tokens // cfg.page_tokens * cfg.select.rescore_factor,
                          cfg.select.sink_tokens // cfg.page_tokens,
                          cfg.select.recent_tokens // cfg.page_tokens)
                variants_here, n_cand, keep = [], 0, None
            else:
                inputs, kw, shape, n_cand, keep, select = candidates(ctx, bs, args, cfg)
                variants_here = variants
            row = {"context": ctx, "batch": bs, "candidates": n_cand, "us": {},
                   "max_diff_vs_first": {}, "select_us": {}, "select_same": {}}
            # the top-k's radix select by bit (the default) and by 8-bit digit, warps
            want = select_page_list(*select)
            for digits in (False, True):
                for warps in (None, 4, 8, 16):
                    name = f"{'digits' if digits else 'bits'}:{warps or 'auto'}"

                    def top(digits=digits, warps=warps):
                        return select_page_list(*select, digits=digits, num_warps=warps)

                    got = top()
                    row["select_same"][name] = bool(torch.equal(got[0], want[0]) and
                                                    torch.equal(got[1], want[1]))
                    row["select_us"][name] = time_variant(top, args.reps) \
                        if args.device == "cuda" else 0.0
                    print(f"{ctx} x {bs}: top-k {name:10s} {row['select_us'][name]:8.1f} us "
                          f"(same pages: {row['select_same'][name]})", flush=True)
            first = None
            for name, extra in variants_here:
                out = torch.empty(shape, dtype=torch.float32, device=args.device)

                def fn(out=out, extra=extra):
                    page_rescore(*inputs, **kw, out=out, **extra)

                fn()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                got = out.clone()
                if first is None:
                    first = got
                fin = ~torch.isneginf(first)
                same_mask = torch.equal(torch.isneginf(got), ~fin)
                diff = float((got[fin] - first[fin]).abs().max()) if fin.any() else 0.0
                row["max_diff_vs_first"][name] = diff if same_mask else float("inf")
                row["us"][name] = time_variant(fn, args.reps) if args.device == "cuda" else 0.0
                print(f"{ctx} x {bs}: {name:14s} {row['us'][name]:8.1f} us "
                      f"({n_cand} candidates; max diff vs {variants[0][0]}: "
                      f"{row['max_diff_vs_first'][name]:.3g})", flush=True)
            rows.append(row)
            del keep
            if args.device == "cuda":
                torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (no timing)",
           "points": rows,
           "date": __import__("time").strftime("%Y-%m-%d %H:%M UTC", __import__("time").gmtime())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
