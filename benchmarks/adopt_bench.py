"""What adopting one finished daemon page costs the scheduler thread, per path, without workers:
one page sealed once (Llama-3.1-8B shape by default), written into a shared-memory-like result
region as the worker writes it (untimed), then read back (`channel.load`: one copy + unpickle)
and installed into a SegmentStore on --device, timed over --reps:

* per_tensor: the page as a SealedPage (~400 tensors pickled by reference), installed by
  `install_pages` (what every daemon result took before results came arena-ready);
* arena_ready: the page as `pack_page` makes it in the worker, installed by `SegmentStore.adopt`.

Both stores must end up with the same arena bytes, header rows (but the base) and page metadata
(checked on every rep; the test suite checks the same through the pool on the CPU).
daemon_bench.py measures the same cost inside the step loop, with workers competing for cores.

    python benchmarks/adopt_bench.py --device cuda --reps 50
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mosaickv_sglang.codec.arena import HDR, META_FIELDS, pack_page
from mosaickv_sglang.codec.layer import Candidates
from mosaickv_sglang.codec.seal import seal_group, worst_page_bytes
from mosaickv_sglang.codec.strategies import parse_strategy
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.daemon.channel import dump, load
from mosaickv_sglang.segment_store import SegmentStore

SHAPES = {"small": (4, 2, 64), "llama8b": (32, 8, 128)}  # layers, KV heads, head_dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, help="also write the medians here")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the scheduler thread
    layers, heads, head_dim = SHAPES[args.shape]
    cfg = MosaicConfig()
    tokens = cfg.segment_tokens
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(layers, 2, heads, tokens, head_dim, generator=g)
          * torch.logspace(0.5, -1, head_dim)).bfloat16()
    dense = parse_strategy("dense")
    page = seal_group(lambda idx: (kv[None, :, 0], kv[None, :, 1]), [tokens * 5], None, cfg,
                      Candidates.from_config(cfg), dense)[0]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    capacity = 2 * (worst_page_bytes(cfg, heads, head_dim, dense) + heads * 4096)
    region = torch.zeros(64 << 20, dtype=torch.uint8)
    stores, out = {}, {}
    for name, obj in (("per_tensor", page), ("arena_ready", pack_page(page, cfg.page_tokens))):
        off, n = dump(obj, region, {id(page.bases): "bases"})
        store = stores[name] = SegmentStore(layers, 2, heads, head_dim, tokens, cfg.page_tokens,
                                            args.device, cfg.select.meta_channels, capacity)
        loads, installs = [], []
        for rep in range(args.reps + 1):  # rep 0: warm-up
            sync()
            t0 = time.perf_counter()
            got = load(region, off, n, {"bases": page.bases}, args.device)
            sync()
            t1 = time.perf_counter()
            if name == "per_tensor":
                store.install_pages([1], [got.segments])
            elif store.adopt(1, got) is None:
                raise RuntimeError("adopt_bench: the store has no room for one page")
            sync()
            t2 = time.perf_counter()
            if rep:
                loads.append((t1 - t0) * 1e3)
                installs.append((t2 - t1) * 1e3)
            if rep < args.reps:
                store.release(1)
        out[name] = (statistics.median(loads), statistics.median(installs))
        print(f"{name}: {off / 1e6:.2f} MB of tensors + {n / 1e3:.1f} KB pickled; per page, "
              f"median of {args.reps} ms: load {out[name][0]:.2f}, install {out[name][1]:.2f}, "
              f"total {sum(out[name]):.2f}")
    a, b = stores["per_tensor"], stores["arena_ready"]
    for layer in range(layers):
        (ba, size), (bb, _) = a.blocks[(layer, 1)], b.blocks[(layer, 1)]
        assert torch.equal(a.data[layer][ba:ba + size], b.data[layer][bb:bb + size]), layer
        ha, hb = a.headers[layer][1].clone(), b.headers[layer][1].clone()
        ha[HDR["base16"]] = hb[HDR["base16"]] = 0
        assert torch.equal(ha, hb), layer
        for f in META_FIELDS:
            assert torch.equal(getattr(a.meta[layer], f)[1], getattr(b.meta[layer], f)[1]), f
    print(f"device {args.device}, shape {args.shape}: both paths stored the same bytes; "
          f"arena_ready/per_tensor total {sum(out['arena_ready']) / sum(out['per_tensor']):.3f}")
    if args.json:
        args.json.write_text(json.dumps({
            "device": args.device, "shape": args.shape, "reps": args.reps, "same_bytes": True,
            "median_ms": {n: {"load": ld, "install": ins} for n, (ld, ins) in out.items()}},
            indent=2) + "\n")


if __name__ == "__main__":
    main()
