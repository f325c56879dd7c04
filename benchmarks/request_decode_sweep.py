"""Where the decode graph's stage 1 spends its time: `RequestDecode.run` (stage 1 + stage 2) on a
real sealed pool (decode_step_bench's build: the default config, the chooser's layout mix), timed
inside a CUDA graph for several plans (splits, warps, token units), with empty selections (the
fixed cost), the top-k's plans (warps, early exit) on the step's bounds, and
`band_unpack.unpack_segments` over the same number of (page, head) pairs (the
cost of dequantizing and rotating them in parallel programs, no softmax).

    python benchmarks/request_decode_sweep.py --contexts 32768 --batches 1,4 --json /tmp/sweep.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_step_bench import build, time_graph  # noqa: E402
from mosaickv_sglang.config import MosaicConfig  # noqa: E402


def timed(fn, reps: int) -> float:
    """us of one replay of `fn` captured in a CUDA graph (no launch overhead)."""
    return time_graph(fn, reps, "cuda") * 1e3


def point(ctx: int, bs: int, args) -> list[dict]:
    from mosaickv_kernels.band_unpack import unpack_segments
    from mosaickv_kernels.layout import PackedArena
    from mosaickv_kernels.page_select import page_bounds, select_page_list
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    cfg = MosaicConfig.parse(json.dumps({**json.loads(args.config),
                                         "decode_cuda_graph": "full"}))
    dev, hq, d, h = "cuda", 32, 128, 8
    backend, pool, req_to_token = build(ctx, bs, 1, h, d, dev, cfg, 8192, 0)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=hq, qk_head_dim=d, v_head_dim=d,
                            scaling=d ** -0.5)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    static = SimpleNamespace(  # as decode_step_bench: the capture-time batch, then a live step
        batch_size=bs, req_pool_indices=torch.zeros(bs, dtype=torch.long, device=dev),
        seq_lens=torch.full((bs,), fill, device=dev), seq_lens_cpu=torch.full((bs,), fill),
        out_cache_loc=torch.zeros(bs, dtype=torch.long, device=dev),
        forward_mode=ForwardMode.DECODE)
    backend.init_cuda_graph_state(bs, bs)
    backend.init_forward_metadata_out_graph(static, in_capture=True)
    q = torch.randn(bs, hq * d, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(bs, h, d, device=dev, dtype=torch.bfloat16)
    backend.forward_decode(q, kv, kv, layer, static)  # plans the bucket
    reqs = torch.arange(1, bs + 1)
    seq = torch.full((bs,), ctx + 1)
    static.req_pool_indices.copy_(reqs.to(dev))
    static.seq_lens.copy_(seq.to(dev))
    static.seq_lens_cpu.copy_(seq)
    view = SimpleNamespace(batch_size=bs, num_padding=0, req_pool_indices=static.req_pool_indices,
                           seq_lens=static.seq_lens, seq_lens_cpu=static.seq_lens_cpu,
                           out_cache_loc=req_to_token[reqs, ctx].long().to(dev))
    backend.init_forward_metadata_out_graph(view)
    g = backend.graph
    bk = g.bucket
    dec = bk.decoder
    q3 = q.view(bs, hq, d)
    q_rot, q_s = dec.queries(q3, bk.basis_ptrs, 0, bk.req_pages)
    bounds = page_bounds(q_rot, pool.store.meta[0], bk.seg_indptr, bk.seg_ids, g.row_pages,
                         out=bk.bounds, rows_per_out=g.width)
    ids, counts = select_page_list(bounds, bk.req_pages, g.budget_pages, g.sink_pages,
                                   g.recent_pages)
    # the top-k's plans on these bounds (every plan keeps the same pages: checked here too)
    rows = []
    for warps in (4, 8, 16):
        for early in (False, True):
            us = timed(lambda: select_page_list(bounds, bk.req_pages, g.budget_pages,
                                                g.sink_pages, g.recent_pages, num_warps=warps,
                                                early_exit=early), args.reps)
            got = select_page_list(bounds, bk.req_pages, g.budget_pages, g.sink_pages,
                                   g.recent_pages, num_warps=warps, early_exit=early)
            rows.append({"context": ctx, "batch": bs, "select_warps": warps,
                         "select_early_exit": early, "select_us": us,
                         "same_pages": bool(torch.equal(got[0], ids) and
                                            torch.equal(got[1], counts))})
            print(rows[-1], flush=True)
    tables = g.tables(bk, 0)
    v_off = pool.layer_num * h
    out = torch.empty(bs, hq, d, device=dev, dtype=torch.bfloat16)
    base = dict(splits=dec.num_splits, warps=dec.num_warps, block=dec.block_n, maxnreg=None,
                gather=dec.gather, early_v=dec.early_v, products=dec.products)
    other = "bf16" if dec.products == "exact" else "exact"
    # (8 warps, 16-token units: slower on the H200 in every run so far, 2026-12-04/05)
    variants = [base, {**base, "early_v": not dec.early_v},
                *({**base, "gather": g} for g in ("pairs", "tokens", "channels")
                  if g != dec.gather),
                {**base, "splits": min(1024, 2 * dec.num_splits)},
                {**base, "splits": min(1024, 4 * dec.num_splits)},
                {**base, "splits": max(1, dec.num_splits // 2)},
                # registers capped for three resident CTAs per SM (spills, if any, to local memory)
                {**base, "maxnreg": 168, "splits": dec.num_splits * 3 // 2},
                {**base, "maxnreg": 168},
                {**base, "maxnreg": 168, "early_v": not dec.early_v}]
    # the other products (`graph_products`), at the default split count, 1.5x and 2x (fewer
    # registers may fit a third CTA per SM), and capped for three CTAs
    variants += [{**base, "products": other},
                 {**base, "products": other, "splits": min(1024, dec.num_splits * 3 // 2)},
                 {**base, "products": other, "splits": min(1024, 2 * dec.num_splits)},
                 {**base, "products": other, "maxnreg": 168,
                  "splits": min(1024, dec.num_splits * 3 // 2)},
                 {**base, "products": other, "warps": 8}]
    if args.splits:  # only the default plan at these split counts
        variants = [base, *({**base, "splits": n} for n in map(int, args.splits.split(","))
                            if n != base["splits"])]
    if args.only_products:  # the default plan and the other products only
        variants = [v for v in variants if v == base or (
            v["products"] == other and v["block"] == base["block"]
            and v["gather"] == base["gather"] and v["early_v"] == base["early_v"])]
    ref = None
    for v in variants:
        dec.plan(batch=bs, rows_per_request=g.width, row_pages=g.row_pages, pages_per_seg=g.pps,
                 num_kv_heads=h, num_qo_heads=hq, head_dim=d, max_selected=ids.shape[2],
                 sm_scale=d ** -0.5, device=dev, num_splits=v["splits"], num_warps=v["warps"],
                 block_tokens=v["block"], hot_tokens=g.hot_cap, maxnreg=v["maxnreg"],
                 gather=v["gather"], early_v=v["early_v"], products=v["products"])
        us = timed(lambda: dec.run(q_rot, q_s, tables, bk.basis_ptrs, v_off, out, page_ids=ids,
                                   page_counts=counts), args.reps)
        empty = timed(lambda: dec.run(q_rot, q_s, tables, bk.basis_ptrs, v_off, out,
                                      page_ids=ids, page_counts=torch.zeros_like(counts)),
                      args.reps)
        dec.run(q_rot, q_s, tables, bk.basis_ptrs, v_off, out, page_ids=ids, page_counts=counts)
        got = out.float().clone()
        ref = got if ref is None else ref  # the first variant's output
        rows.append({"context": ctx, "batch": bs, **v, "run_us": us, "empty_us": empty,
                     "max_abs_diff_vs_first": float((got - ref).abs().max()),
                     "pages_heads": int(counts.sum()), "hot_tokens": bk.hot_lens.tolist()})
        print(rows[-1], flush=True)
    # the same (page, head) pairs dequantized + rotated by the prefill unpack kernel: segments
    # of 4 pages, one program per (segment, head, 16 tokens)
    n_seg = max(1, int(counts.sum()) // h // g.pps)
    seg_list = bk.seg_ids[:n_seg].contiguous()
    store = pool.store
    zero = torch.zeros(1, h, 1, d, dtype=torch.bfloat16, device=dev)
    arena = PackedArena(store.data[0], store.headers[0], torch.zeros(2, dtype=torch.int32,
                        device=dev), seg_list, torch.eye(d, device=dev).expand(1, h, d, d)
                        .contiguous(), torch.eye(d, device=dev).expand(1, h, d, d).contiguous(),
                        zero, zero, torch.zeros(1, dtype=torch.int32, device=dev), store.plans,
                        segment_tokens=pool.page_size, page_tokens=32, payload={})
    k_ws = torch.empty(n_seg * pool.page_size, h, d, dtype=torch.bfloat16, device=dev)
    v_ws = torch.empty_like(k_ws)
    seg_req = torch.zeros(n_seg, dtype=torch.int32, device=dev)
    us = timed(lambda: unpack_segments(arena, seg_list, seg_req, k_ws, v_ws), args.reps)
    rows.append({"context": ctx, "batch": bs, "unpack_us": us, "segments": n_seg,
                 "pages_heads": n_seg * g.pps * h})
    print(rows[-1], flush=True)
    del backend, pool
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="32768")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--splits", default=None,
                   help="comma-separated split counts: time only the default plan at these")
    p.add_argument("--only-products", action="store_true",
                   help="time only the default plan and the other `graph_products` variants")
    p.add_argument("--config", default="{}", help="MosaicKV config JSON over the defaults")
    args = p.parse_args()
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        for bs in map(int, args.batches.split(",")):
            rows += point(ctx, bs, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
