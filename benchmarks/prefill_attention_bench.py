"""A prefill chunk's attention over a request's prefix, per layer, with the server's own code
(`prefill_attention.ChunkAttention`: planned once, then per layer the compressed prefix and the
dense tokens gathered into its paged buffer and one run) for each kernel ("flashinfer": one
batch prefill launch; "flashinfer_single": FlashInfer's single prefill per run, the former
path; "sdpa"), side by side on the same inputs; and
FlashInfer's prefill over one contiguous K/V with nothing joined (what a dense server's extend
costs at least, the floor). The inputs are laid out as the pool returns them (token-major
[S, H, D], passed as head-major views), Llama-8B heads by default, one 8192-token chunk after
prefixes of --prefixes tokens. CUDA only.

    python benchmarks/prefill_attention_bench.py --out prefill_attention.json
    python benchmarks/prefill_attention_bench.py --prefixes 0,24576,122880 --chunk 8192

Printed per prefix: ms per layer for each path (best of --reps; gather + run, the plan timed
apart as `<kernel>_plan_ms`: the server plans once per forward) and the ratio to the floor; a
chunk of a 32-layer model costs 32 times that (plus its linear layers, the prefix's read-back
and the sealing).
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from mosaickv_sglang.bench.basis_fit import timed
from mosaickv_sglang.serving.prefill_attention import ChunkAttention, gather_chunks


def time_ms(fn, reps: int) -> float:
    """Best of `reps` synchronized wall-clock runs, in ms (`bench.basis_fit.timed`)."""
    return timed(fn, reps, "cuda") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", default="0,24576,57344,122880",
                    help="tokens before the chunk (multiples of --page)")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", default="flashinfer,flashinfer_single,sdpa")
    ap.add_argument("--position-rule", action="store_true",
                    help="also time the position read rule's chunk (`per_page` runs: each page's "
                         "queries read the pages before theirs compressed, the chunk's own "
                         "included, and their own page dense), as a server with the default "
                         "config runs it")
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_attention_bench: needs CUDA")
    import flashinfer  # noqa: PLC0415

    dev, dt, d = "cuda", torch.bfloat16, args.head_dim
    hq, hk, n, ps = args.q_heads, args.kv_heads, args.chunk, args.page
    scale = d ** -0.5
    rows = []
    print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f", {hq}q/{hk}kv/d{d}, chunk {n}, ms per layer")
    for prefix in (int(x) for x in args.prefixes.split(",")):
        if prefix % ps:
            raise SystemExit(f"--prefixes: {prefix} is not a multiple of --page {ps}")
        g = torch.Generator(dev).manual_seed(prefix)
        nhd = lambda t, h: torch.randn(t, h, d, device=dev, dtype=dt, generator=g)  # noqa: E731
        q = nhd(n, hq)
        kc, vc, kd, vd = nhd(prefix, hk), nhd(prefix, hk), nhd(n, hk), nhd(n, hk)
        j = prefix // ps
        read = torch.full((n,), j, dtype=torch.int64)
        row = {"prefix": prefix, "chunk": n}

        def layer_ms(kernel, kc, vc, read, per_page, name):
            """Plan (timed once), then gather + run per layer (best of --reps)."""
            runner = ChunkAttention(kernel)
            spec = [(prefix, n, read, j, kc.shape[0] // ps)]
            t0 = time.perf_counter()
            plan = runner.plan(spec, ps, per_page, (hq, hk, d), dt, scale, dev)
            torch.cuda.synchronize()
            row[f"{name}_plan_ms"] = (time.perf_counter() - t0) * 1e3

            def step():
                k = gather_chunks(plan, [kc], [kd])
                v = gather_chunks(plan, [vc], [vd])
                return runner.run(plan, q, k, v, scale)
            row[name] = time_ms(step, args.reps)
            row[f"{name}_runs"] = len(plan.runs)

        for kernel in args.kernels.split(","):
            layer_ms(kernel, kc, vc, read, False, kernel)
        if args.position_rule:  # the chunk's own pages compressed too, read page by page
            kcp, vcp = nhd(prefix + n, hk), nhd(prefix + n, hk)
            read_p = (prefix + torch.arange(n)) // ps
            for kernel in args.kernels.split(","):
                layer_ms(kernel, kcp, vcp, read_p, True, f"{kernel}_position_rule")
            del kcp, vcp
        k_all, v_all = torch.cat([kc, kd]), torch.cat([vc, vd])
        row["floor_flashinfer_contiguous"] = time_ms(
            lambda: flashinfer.single_prefill_with_kv_cache(  # noqa: B023
                q, k_all, v_all, causal=True, sm_scale=scale), args.reps)
        flops = 4 * n * (prefix + (n + 1) / 2) * d * hq
        for key in [*args.kernels.split(","), "floor_flashinfer_contiguous"]:
            row[f"{key}_tflops"] = flops / row[key] / 1e9
        rows.append(row)
        print(f"prefix {prefix:>7}: " + ", ".join(
            f"{k} {row[k]:.2f} ({row[k] / row['floor_flashinfer_contiguous']:.2f}x floor, "
            f"{row[k + '_tflops']:.0f} TFLOP/s)" for k in
            [*args.kernels.split(","), "floor_flashinfer_contiguous"]) +
            "".join(f", {k}_position_rule {row[k + '_position_rule']:.2f}"
                    for k in args.kernels.split(",") if k + "_position_rule" in row))
        del q, kc, vc, kd, vd, k_all, v_all
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                       "host": platform.node(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
