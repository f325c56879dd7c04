"""Tokens that fit at equal KV memory, measured by filling a MosaicKV pool with real SmolLM2 K/V.

The pool is built the way a server builds it with default flags (`serving/sizing.py`: slots at
the smallest layout, the hot buffer sized to what is in flight, the memory split by
`plan_memory`) for a KV memory of `--dense-tokens` dense bf16 tokens. Then requests of real
SmolLM2 K/V (the needle-in-a-haystack captures of `bench.capture`, cycled) are written and
sealed, each admitted only when the byte gate (`refresh_byte_gate`) lets all its pages in, until
it refuses one. With `cold.enabled` in `--config`, a finished request's pages are recompressed
(`recompress_cold`) before the next is admitted, as the step boundaries after it would. Reported: the tokens sealed (what the arena really holds at the chooser's layout
mix on this KV), against dense (`--dense-tokens`) and SGLang's FP8 KV cache (2x dense, its
bytes per token halved), the measured bytes per page by position and the layouts chosen.

Bytes are counted from the allocated tensors and do not depend on the device, so this runs on
the CPU; a server measurement on the GPU (Llama-8B shape) is `serving_bench.py`'s capacity.

    python benchmarks/capacity_bench.py --dense-tokens 131072 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mosaickv_sglang.bench.capture import capture  # noqa: E402
from mosaickv_sglang.config import MosaicConfig  # noqa: E402
from mosaickv_sglang.serving.pool import MosaicKVPool  # noqa: E402
from mosaickv_sglang.serving.sizing import (PageBytes, auto_hot_tokens, slot_fraction,  # noqa: E402
                                            window_tokens)


def build_pool(cfg: MosaicConfig, dense_tokens: int, layers: int, heads: int, head_dim: int,
               chunk: int, context: int) -> MosaicKVPool:
    """The pool a default-flags server builds for the memory of `dense_tokens` bf16 tokens."""
    ps = cfg.segment_tokens
    pb = PageBytes.of(cfg, heads, head_dim, 2)
    dense_token = layers * pb.dense // ps
    memory = dense_tokens * dense_token
    slots = int(memory // (slot_fraction(cfg, pb) * dense_token)) // ps * ps
    hot = min(auto_hot_tokens(cfg, ps, chunk, context, window_tokens(cfg)), slots // ps * ps)
    return MosaicKVPool(slots, ps, torch.bfloat16, heads, head_dim, layers, "cpu", False,
                        mosaic_config=cfg, hot_tokens=hot, memory_bytes=memory)


def fill(pool: MosaicKVPool, caps: list, max_requests: int, log_every: int = 8) -> dict:
    ps = pool.page_size
    free = list(range(1, pool.logical_size // ps + 1))
    requests, sealed_tokens, t0 = 0, 0, time.perf_counter()
    # page position -> its pages' arena blocks: (layer 0's bytes, mean bytes over the layers)
    positions: dict[int, list[tuple[int, float]]] = {}
    while requests < max_requests:
        cap = caps[requests % len(caps)]
        n = cap.k[0].shape[1] // ps * ps
        deficit = pool.refresh_byte_gate(len(free) * ps)
        if len(free) * ps - deficit < n:
            break  # the gate refuses this request: the pool is full
        pages = [free.pop(0) for _ in range(n // ps)]
        slots = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])
        for layer in range(pool.layer_num):
            k = cap.k[layer][:, :n].transpose(0, 1).contiguous()  # [T, H, D]
            v = cap.v[layer][:, :n].transpose(0, 1).contiguous()
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), slots, k, v)
        # as a server seals: after the prefill forward what the next token reads compressed
        # (under the position rule every page; the server does it inside the forward), then at
        # the request's end the rest (seal_finished)
        pool.seal_request(slots, n)
        pool.seal_finished(slots)
        if pool.cfg.cold.enabled:  # the request finished: its pages are cold at the next steps
            while pool.recompress_cold(set()):
                pass
        sealed_tokens += n
        requests += 1
        layers = range(pool.layer_num)
        for i, p in enumerate(pages):
            blocks = [pool.store.blocks.get((layer, p)) for layer in layers]
            if None not in blocks:
                positions.setdefault(min(i, 2), []).append(
                    (blocks[0][1], sum(b[1] for b in blocks) / len(blocks)))
        if requests % log_every == 0:
            print(f"  {requests} requests, {sealed_tokens} tokens sealed, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    return {"requests": requests, "tokens": sealed_tokens, "positions": positions,
            "fill_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense-tokens", type=int, default=131072,
                    help="the KV memory, in dense bf16 tokens of SmolLM2 (23 KB each)")
    ap.add_argument("--context", type=int, default=8192, help="tokens per request (a capture)")
    ap.add_argument("--seeds", default="0,1,2", help="captures cycled through")
    ap.add_argument("--chunk", type=int, default=8192, help="the server's chunked prefill size")
    ap.add_argument("--config", default=None, help="MosaicKV config JSON (default: defaults)")
    ap.add_argument("--max-requests", type=int, default=10_000)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    cfg = MosaicConfig.parse(args.config) if args.config else MosaicConfig()
    caps = [capture(n_tokens=args.context, seed=int(s)) for s in args.seeds.split(",")]
    layers, (heads, _, head_dim) = len(caps[0].k), caps[0].k[0].shape
    pool = build_pool(cfg, args.dense_tokens, layers, heads, head_dim, args.chunk, args.context)
    plan = pool.memory_plan
    print(f"memory {plan.total / 1e9:.2f} GB ({args.dense_tokens} dense tokens): "
          f"{pool.logical_size} slots, hot buffer {plan.hot_tokens} tokens "
          f"({plan.hot_bytes / 1e6:.0f} MB), arena {plan.arena_bytes * layers / 1e6:.0f} MB",
          flush=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    got = fill(pool, caps, args.max_requests)
    st = pool.stats()
    dense_page = pool.page_bytes.dense
    names = {0: "sink", 1: "second", 2: "rest"}
    # layers compress unequally: layer 0's blocks are the smallest in SmolLM2's fills
    by_pos = {names[k]: sum(m for _, m in v) / len(v) / dense_page
              for k, v in sorted(got["positions"].items())}
    layer0 = {names[k]: sum(b for b, _ in v) / len(v) / dense_page
              for k, v in sorted(got["positions"].items())}
    out = {
        "model": "SmolLM2-135M (real K/V, needle captures)", "device": "cpu (bytes only)",
        "date": time.strftime("%Y-%m-%d"), "config": args.config or "default",
        "dense_tokens": args.dense_tokens, "fp8_tokens": 2 * args.dense_tokens,
        "memory_bytes": pool.memory_plan.total, "slots": pool.logical_size,
        "hot_buffer_tokens": plan.hot_tokens, "requests": got["requests"],
        "tokens_sealed": got["tokens"],
        "x_dense": got["tokens"] / args.dense_tokens,
        "x_fp8": got["tokens"] / (2 * args.dense_tokens),
        "sealed_ratio": st["sealed_ratio"],
        "cold": {k: st["counters"][k] for k in ("cold_pages", "cold_kept", "cold_saved_bytes")},
        "arena_block_fraction_by_position": by_pos,  # mean over layers
        "arena_block_fraction_by_position_layer0": layer0,
        "strategies": st["counters"]["strategies"],
        "capacity": st["capacity"], "fill_s": got["fill_s"],
    }
    print(f"tokens that fit: {got['tokens']} = {out['x_dense']:.2f}x dense, "
          f"{out['x_fp8']:.2f}x FP8 (sealed pages {st['sealed_ratio']:.2f}x below bf16 incl. "
          f"bases and metadata; arena block / dense page by position, mean over layers: "
          + ", ".join(f"{k} {v:.3f}" for k, v in by_pos.items()) + "; layer 0: "
          + ", ".join(f"{k} {v:.3f}" for k, v in layer0.items()) + ")", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
