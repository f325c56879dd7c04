"""GPU time of MosaicKV's decode attention as SGLang's full decode CUDA graph records it, beside
dense attention over the same context, with a per-kernel breakdown.

No server and no model: a MosaicKVPool at an attention shape (default Llama-3.1-8B: 8 KV heads,
32 query heads, head_dim 128) with `--layers` layers, B requests of CTX tokens written (random K
with uneven channel scales, random V) and sealed chunk by chunk as a chunked prefill seals them,
the chooser's real layout mix, the default config with `decode_cuda_graph: full`. The backend is
driven as SGLang's decode graph runner drives it (state, capture-time tables, two warm-ups, the
capture of `--layers` attention calls, then per step the host work before the replay) and the
replay is timed with CUDA events:

* `mosaickv_ms_per_layer`: one replay / layers (the attention of one layer, inside a graph);
* `host_ms`: `init_forward_metadata_out_graph` of a step the device plans (nothing to seal or
  map: the tables built on the device), median; `host_step_ms`: the first such call, which does
  the host work (seal check, the new page mapped, the tables filled on the host);
* `dense_ms_per_layer`: torch SDPA (GQA, bf16, flash kernel) over a dense [B, 8, CTX, 128] cache,
  captured the same way; `dense_floor_ms`: its K and V bytes at `--hbm-tbs` (HBM speed);
* `flashinfer_ms_per_layer`: FlashInfer's paged decode (SGLang's dense FlashInfer backend's
  kernel) over the same shapes, captured the same way (`flashinfer_skipped` says why not);
* `kernels`: with `--profile`, each kernel's GPU time per layer and launches per layer, from
  torch.profiler over eager runs of the same forward (the kernels a replay launches).

    python benchmarks/decode_step_bench.py --contexts 32768,131072 --batches 1,4 --profile \
        --json /tmp/step.json

On the CPU (`TRITON_INTERPRET=1`, `--device cpu`, tiny shapes) it runs the same path without
timing the graph: a check that the script works, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mosaickv_sglang.config import MosaicConfig  # noqa: E402


def build(ctx: int, bs: int, layers: int, kv_heads: int, head_dim: int, device: str,
          cfg: MosaicConfig, chunk: int, seed: int):
    """(backend, pool, req_to_token) with `bs` requests of `ctx` tokens written and sealed."""
    from mosaickv_sglang.serving.backend import MosaicAttnBackend
    from mosaickv_sglang.serving.pool import MosaicKVPool
    from mosaickv_sglang.serving.sizing import auto_hot_tokens

    ps = cfg.segment_tokens
    width = -(-(ctx + 2 * ps) // ps) * ps  # token slots per request: the prompt and the decode
    size = bs * width + ps  # logical slots: every request's, and the padding page
    # the hot buffer a server with `chunk`-token prefill chunks sizes (built without it, a
    # pool's hot buffer is every slot: 8 x 128K did not fit an H100 beside the arenas)
    hot = auto_hot_tokens(cfg, ps, chunk, ctx + 2 * ps, cfg.hot_tokens)
    pool = MosaicKVPool(size, ps, torch.bfloat16, kv_heads, head_dim, layers, device, False,
                        mosaic_config=cfg, hot_tokens=hot)
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = (1 + torch.arange(head_dim, device=device) % 7).to(torch.float32)
    req_to_token = torch.zeros(bs + 1, width, dtype=torch.int32)
    for r in range(bs):  # request rows 1.. (row 0: SGLang's padding row), pages from 1
        slots = torch.arange(ps + r * width, ps + (r + 1) * width)
        req_to_token[r + 1] = slots.to(torch.int32)
        dev_slots = slots.to(device)
        for lo in range(0, ctx, chunk):
            hi = min(ctx, lo + chunk)
            for layer_id in range(layers):
                k = torch.randn(hi - lo, kv_heads, head_dim, generator=gen, device=device) * scale
                v = torch.randn(hi - lo, kv_heads, head_dim, generator=gen, device=device)
                pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), dev_slots[lo:hi],
                                   k.bfloat16(), v.bfloat16())
            pool.seal_request(dev_slots[:hi], hi)
    runner = SimpleNamespace(device=device, token_to_kv_pool=pool,
                             model_config=SimpleNamespace(context_len=ctx + 2 * ps),
                             req_to_token_pool=SimpleNamespace(
                                 req_to_token=req_to_token.to(device)))
    return MosaicAttnBackend(runner), pool, req_to_token


def time_graph(fn, reps: int, device: str) -> float:
    """ms of one replay of `fn` captured in a CUDA graph (median of `reps` event-timed)."""
    if device != "cuda":
        fn()
        return float("nan")
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def kernel_table(fn, layers: int, reps: int, device: str) -> list[dict]:
    """Per kernel name: GPU ms per layer and launches per layer, over `reps` eager calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if device == "cuda" and (not t or e.device_type != torch.autograd.DeviceType.CUDA):
            continue
        rows.append({"kernel": e.key[:90], "ms_per_layer": t / 1e3 / reps / layers,
                     "launches_per_layer": e.count / reps / layers})
    rows.sort(key=lambda r: -r["ms_per_layer"])
    return rows


def run_point(ctx: int, bs: int, args, cfg: MosaicConfig) -> dict:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    dev, hq, d, h = args.device, args.q_heads, args.head_dim, args.kv_heads
    t0 = time.perf_counter()
    backend, pool, req_to_token = build(ctx, bs, args.layers, h, d, dev, cfg, args.chunk, args.seed)
    built_s = time.perf_counter() - t0
    layers = [SimpleNamespace(layer_id=i, tp_q_head_num=hq, qk_head_dim=d, v_head_dim=d,
                              scaling=d ** -0.5) for i in range(args.layers)]
    fill = backend.get_cuda_graph_seq_len_fill_value()
    static = SimpleNamespace(
        batch_size=bs, req_pool_indices=torch.zeros(bs, dtype=torch.long, device=dev),
        seq_lens=torch.full((bs,), fill, device=dev), seq_lens_cpu=torch.full((bs,), fill),
        out_cache_loc=torch.zeros(bs, dtype=torch.long, device=dev),
        forward_mode=ForwardMode.DECODE)
    q = torch.randn(args.layers, bs, hq * d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(args.layers, bs, h, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def attention():  # the model's attention calls of one step (the graph records these)
        for j, layer in enumerate(layers):
            backend.forward_decode(q[j], k[j], v[j], layer, static)

    backend.init_cuda_graph_state(bs, bs)
    backend.init_forward_metadata_out_graph(static, in_capture=True)
    attention()  # the warm-ups (compiles every width class)
    # live steps: each request one token past its prompt (a host step: its new page mapped,
    # the tables filled on the host), then two past it, again and again (nothing to seal or
    # map: the tables built on the device, outside the graph)
    reqs = torch.arange(1, bs + 1)
    host = []
    planned0 = backend.graph.device_steps
    for i in range(1 + args.host_reps):
        seq = torch.full((bs,), ctx + 1 + min(i, 1))
        locs = req_to_token[reqs, ctx + min(i, 1)].long().to(dev)
        static.req_pool_indices.copy_(reqs.to(dev))
        static.seq_lens.copy_(seq.to(dev))
        static.seq_lens_cpu.copy_(seq)
        view = SimpleNamespace(batch_size=bs, num_padding=0,
                               req_pool_indices=static.req_pool_indices,
                               seq_lens=static.seq_lens, seq_lens_cpu=static.seq_lens_cpu,
                               out_cache_loc=locs)
        if dev == "cuda":  # the warm-ups' (or the previous step's) queued GPU work is not this
            torch.cuda.synchronize()  # step's host time; without this the first step's timing
            # could include it (8 x 128K: 19.65 ms vs 4.46 at 8 x 32K, H100, 2026-12-05)
        t = time.perf_counter()
        backend.init_forward_metadata_out_graph(view)
        if dev == "cuda":
            torch.cuda.synchronize()
        host.append((time.perf_counter() - t) * 1e3)
    mosaic_ms = time_graph(attention, args.reps, dev)
    row = {"context": ctx, "batch": bs, "layers": args.layers, "built_s": round(built_s, 1),
           "host_step_ms": host[0],  # seal check, writes mapped, tables filled on the host
           # the same step planned on the device (median)
           "host_ms": sorted(host[1:])[len(host[1:]) // 2],
           "device_planned_steps": backend.graph.device_steps - planned0,
           "mosaickv_ms_per_layer": mosaic_ms / args.layers,
           "layouts": len(pool.store.layouts),
           "rows_per_request": backend.graph.width,
           "sealed_ratio": pool.stats().get("sealed_ratio")}
    if args.profile:
        row["kernels"] = kernel_table(attention, args.layers, 5, dev)
    del backend, pool
    if dev == "cuda":
        torch.cuda.empty_cache()
    # dense: every layer's attention over its own [B, H, CTX, D] cache (torch SDPA, GQA)
    kd = torch.randn(args.dense_layers, bs, h, ctx, d, device=dev, dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    qd = torch.randn(bs, hq, 1, d, device=dev, dtype=torch.bfloat16)

    def dense():
        for j in range(args.dense_layers):
            torch.nn.functional.scaled_dot_product_attention(qd, kd[j], vd[j], enable_gqa=True)

    row["dense_ms_per_layer"] = time_graph(dense, args.reps, dev) / args.dense_layers
    row["dense_floor_ms"] = 2 * bs * h * ctx * d * 2 / (args.hbm_tbs * 1e12) * 1e3
    if args.profile:
        row["dense_kernels"] = kernel_table(dense, args.dense_layers, 5, dev)[:4]
    row["mosaickv_over_dense"] = row["mosaickv_ms_per_layer"] / row["dense_ms_per_layer"]
    del kd, vd
    fi, why = flashinfer_ms_per_layer(bs, ctx, hq, h, d, args.dense_layers, args.reps, dev)
    row["flashinfer_ms_per_layer"] = fi
    if fi is None:
        row["flashinfer_skipped"] = why
    else:
        row["mosaickv_over_flashinfer"] = row["mosaickv_ms_per_layer"] / fi
    return row


def flashinfer_ms_per_layer(bs: int, ctx: int, hq: int, h: int, d: int, layers: int, reps: int,
                            dev: str) -> tuple[float | None, str | None]:
    """FlashInfer's paged decode (what SGLang's dense FlashInfer backend runs: 16-token pages
    here, NHD, tensor cores for GQA groups >= 4) over `layers` bf16 caches of B x CTX tokens,
    captured in a CUDA graph: (ms per layer, None), or (None, why it did not run)."""
    if dev != "cuda":
        return None, "needs CUDA"
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 (reported in the row, never dropped)
        return None, f"flashinfer not importable: {exc!r}"[:200]
    page = 16
    try:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD",
                                                                use_tensor_cores=hq // h >= 4)
        pages = -(-ctx // page)
        indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * pages
        indices = torch.arange(bs * pages, dtype=torch.int32, device=dev)
        last = torch.full((bs,), ctx - (pages - 1) * page, dtype=torch.int32, device=dev)
        wrapper.plan(indptr, indices, last, hq, h, d, page, pos_encoding_mode="NONE",
                     sm_scale=d ** -0.5, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)
        caches = [tuple(torch.randn(bs * pages, page, h, d, device=dev, dtype=torch.bfloat16)
                        for _ in range(2)) for _ in range(layers)]
        q = torch.randn(bs, hq, d, device=dev, dtype=torch.bfloat16)

        def run():
            for cache in caches:
                wrapper.run(q, cache)

        ms = time_graph(run, reps, dev) / layers
        del caches
        torch.cuda.empty_cache()
        return ms, None
    except Exception as exc:  # noqa: BLE001
        return None, f"flashinfer failed: {exc!r}"[:300]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--layers", type=int, default=4, help="MosaicKV layers captured per replay")
    p.add_argument("--dense-layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=8192, help="tokens written between seals")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--host-reps", type=int, default=20)
    p.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM TB/s (H200: 4.8)")
    p.add_argument("--config", default="{}", help="MosaicKV config JSON over the defaults")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    cfg = MosaicConfig.from_dict({"decode_kernel": "triton", "decode_cuda_graph": "full",
                                  **json.loads(args.config)})
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = {"gpu": gpu, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "torch": torch.__version__, "config": json.loads(args.config), "rows": []}
    for ctx in map(int, args.contexts.split(",")):
        for bs in map(int, args.batches.split(",")):
            row = run_point(ctx, bs, args, cfg)
            out["rows"].append(row)
            print(f"ctx {ctx} batch {bs}: MosaicKV {row['mosaickv_ms_per_layer']:.4f} ms/layer "
                  f"(host {row['host_ms']:.2f} ms/step device-planned "
                  f"({row['device_planned_steps']} steps), {row['host_step_ms']:.2f} host step, "
                  f"{row['layouts']} layouts), "
                  f"dense SDPA {row['dense_ms_per_layer']:.4f} ms/layer "
                  f"(HBM floor {row['dense_floor_ms']:.4f}): {row['mosaickv_over_dense']:.2f}x; "
                  f"FlashInfer {row['flashinfer_ms_per_layer'] or float('nan'):.4f} ms/layer "
                  f"{row.get('flashinfer_skipped') or ''} [built in {row['built_s']} s]",
                  flush=True)
            for kr in row.get("kernels", [])[:12]:
                print(f"    {kr['ms_per_layer'] * 1e3:8.1f} us  x{kr['launches_per_layer']:.1f}"
                      f"  {kr['kernel']}")
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
