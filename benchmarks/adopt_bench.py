"""What adopting one finished daemon page costs the scheduler thread, per path, without workers:
one page sealed once (Llama-3.1-8B shape by default), written into a shared-memory-like result
region as the worker writes it (untimed), then read back (`channel.load`: one copy + unpickle)
and installed into a SegmentStore on --device, timed over --reps:

* per_tensor: the page as a SealedPage (~400 tensors pickled by reference), installed by
  `install_pages` (what every daemon result took before results came arena-ready);
* arena_ready: the page as `pack_page` makes it in the worker, installed by `SegmentStore.adopt`
  with torch slice copies;
* arena_ready_kernels: the same, its blocks, header rows and page metadata written by one
  `row_copy` launch (on CUDA, or on the CPU under TRITON_INTERPRET=1: what the pool does with
  `pack_kernel` auto on CUDA);
* in_place_kernels: the same launch reading the result where it lies, in a real shared-memory
  slot (pinned and mapped on CUDA, `SegmentStore.reads_host`): `load` unpickles views of the
  slot, no device copy (what the pool does where the store can read the slots in place);
* in_place_kernels_xN (--batch N > 1): N such pages, each in its own slot, installed by one
  `SegmentStore.adopt_pages` call (one launch), as a boundary installs a batch of pages
  (`daemon_install_batch`); per page times are the batch's divided by N.

Then the third operation a daemon page costs the scheduler thread: the boundary's copy of a hot
page (every layer's K/V, from a pool-like hot buffer, by the pool's `SlotCopy`: torch
`page_kv`, and the `page_gather` kernel where kernels run; on CUDA off the current stream) and
its bases into a real shared-memory slot (pinned on CUDA), `client.fill_slots`; host time only,
the device synchronized after it, the slot checked against `page_kv`. --profile prints the
torch ops with the most host time per operation.

All stores must end up with the same arena bytes, header rows (but the base) and page metadata
(checked after the reps; the test suite checks the same through the pool on the CPU).
daemon_bench.py measures the same cost inside the step loop, with workers competing for cores.

    python benchmarks/adopt_bench.py --device cuda --reps 50 [--profile]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mosaickv_kernels.common import interpreting
from mosaickv_sglang.codec.arena import HDR, META_FIELDS, pack_page
from mosaickv_sglang.codec.layer import Candidates
from mosaickv_sglang.codec.seal import BasisPair, page_kv, seal_group, worst_page_bytes
from mosaickv_sglang.codec.strategies import parse_strategy
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.daemon.channel import Channel, ChannelSpec, dump, load
from mosaickv_sglang.daemon.client import SlotCopy, fill_slots
from mosaickv_sglang.serving.segment_store import SegmentStore

SHAPES = {"small": (4, 2, 64), "llama8b": (32, 8, 128)}  # layers, KV heads, head_dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4,
                    help="pages of the batched in-place path (1: no batched path)")
    ap.add_argument("--json", type=Path, help="also write the medians here")
    ap.add_argument("--profile", action="store_true",
                    help="print the torch ops with the most host time in each timed operation")
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
    batch = max(args.batch, 1)
    capacity = (batch + 1) * (worst_page_bytes(cfg, heads, head_dim, dense) + heads * 4096)
    region = torch.zeros(64 << 20, dtype=torch.uint8)
    packed = pack_page(page, cfg.page_tokens)
    stores, out = {}, {}
    kernels = args.device.startswith("cuda") or interpreting()
    paths = [("per_tensor", page, "torch", 1), ("arena_ready", packed, "torch", 1)] + (
        [("arena_ready_kernels", packed, "triton", 1), ("in_place_kernels", packed, "triton", 1)]
        + [(f"in_place_kernels_x{batch}", packed, "triton", batch)] * (batch > 1)
        if kernels else [])
    slot = Channel.create(ChannelSpec(layers, heads, head_dim, tokens, "bfloat16", batch, 1,
                                      region.numel()))
    if args.device.startswith("cuda"):
        slot.pin()
    for name, obj, copies, k in paths:
        in_place = name.startswith("in_place")
        wheres = [slot.result(j) for j in range(k)] if in_place else [region]
        for where in wheres:
            off, n = dump(obj, where, {id(page.bases): "bases"})
        store = stores[name] = SegmentStore(layers, batch, heads, head_dim, tokens,
                                            cfg.page_tokens, args.device,
                                            cfg.select.meta_channels, capacity, pack_kernel=copies)
        if in_place and not store.reads_host(slot.result(0)[off + n:]):  # past the result
            print(f"{name}: skipped, the store cannot read the slot in place "
                  f"(pinned: {slot.pinned})")
            del stores[name]
            continue
        loads, installs = [], []
        pages = list(range(1, k + 1))
        with profiled(args.profile, f"{name} load + install"):
            for rep in range(args.reps + 1):  # rep 0: warm-up
                sync()
                t0 = time.perf_counter()
                got = [load(where, off, n, {"bases": page.bases},
                            None if in_place else args.device) for where in wheres]
                sync()
                t1 = time.perf_counter()
                if name == "per_tensor":
                    store.install_pages(pages, [g.segments for g in got])
                elif None in store.adopt_pages(pages, got):
                    raise RuntimeError(f"adopt_bench: the store has no room for {k} pages")
                sync()
                t2 = time.perf_counter()
                if rep:
                    loads.append((t1 - t0) * 1e3 / k)
                    installs.append((t2 - t1) * 1e3 / k)
                if rep < args.reps:
                    for p in pages:
                        store.release(p)
        out[name] = (statistics.median(loads), statistics.median(installs))
        print(f"{name}: {off / 1e6:.2f} MB of tensors + {n / 1e3:.1f} KB pickled; per page, "
              f"median of {args.reps} ms: load {out[name][0]:.2f}, install {out[name][1]:.2f}, "
              f"total {sum(out[name]):.2f}" + (f" (row table read from pinned host memory: "
                                               f"{store.host_rows})" if in_place else ""))
    slot.close(unlink=True)
    a = stores["per_tensor"]
    for name, b in stores.items():  # every page a path stored against per_tensor's page 1
        for layer, p in ((layer, p) for layer in range(layers) for p in range(1, batch + 1)
                         if (layer, p) in b.blocks):
            (ba, size), (bb, _) = a.blocks[(layer, 1)], b.blocks[(layer, p)]
            assert torch.equal(a.data[layer][ba:ba + size], b.data[layer][bb:bb + size]), name
            ha, hb = a.headers[layer][1].clone(), b.headers[layer][p].clone()
            ha[HDR["base16"]] = hb[HDR["base16"]] = 0
            assert torch.equal(ha, hb), (name, layer, p)
            for f in META_FIELDS:
                assert torch.equal(getattr(a.meta[layer], f)[1], getattr(b.meta[layer], f)[p]), f
    print(f"device {args.device}, shape {args.shape}: all paths stored the same bytes; "
          f"arena_ready/per_tensor total {sum(out['arena_ready']) / sum(out['per_tensor']):.3f}"
          + (f", kernels/torch install {out['arena_ready_kernels'][1] / out['arena_ready'][1]:.2f}"
             if kernels else ""))
    pump = {copies: pump_ms(args, cfg, layers, heads, head_dim, page.bases, sync,
                            kernel=copies == "kernel")
            for copies in ("torch", "kernel")[:1 + kernels]}
    for copies, p in pump.items():
        print(f"pump by {copies} (a hot page and its bases into a slot"
              f"{', pinned' if p['pinned'] else ''}): host ms median {p['median']:.2f}, "
              f"max {p['max']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "device": args.device, "shape": args.shape, "reps": args.reps, "same_bytes": True,
            "in_place": "in_place_kernels" in stores,
            "median_ms": {n: {"load": ld, "install": ins} for n, (ld, ins) in out.items()},
            "pump_host_ms": pump}, indent=2) + "\n")


def pump_ms(args, cfg: MosaicConfig, layers: int, heads: int, head_dim: int, bases,
            sync, kernel: bool) -> dict:
    """Host time of filling one slot as the boundary does: a hot page through `page_kv` (a
    pool-like hot buffer of 4 pages, one tensor per layer and kind) and the page's bases."""
    tokens = cfg.segment_tokens
    k_buffer, v_buffer = ([torch.randn(4 * tokens, heads, head_dim, device=args.device,
                                       dtype=torch.bfloat16) for _ in range(layers)]
                          for _ in range(2))
    slot_copy = SlotCopy(k_buffer, v_buffer, tokens, kernel, lambda page: page)  # as the pool's
    channel = Channel.create(ChannelSpec(layers, heads, head_dim, tokens, "bfloat16", 2, 1,
                                         1 << 16))
    pinned = args.device.startswith("cuda") and channel.pin()
    bases = BasisPair.of(bases.stacked().to(args.device))  # as a worker's result loads them
    times = []
    try:
        with profiled(args.profile, f"pump by {'kernel' if kernel else 'torch'}"):
            for rep in range(args.reps + 1):
                sync()
                t0 = time.perf_counter()
                fill_slots(channel, slot_copy, [rep % 4], [rep % 2], bases)
                t1 = time.perf_counter()
                sync()
                if rep:
                    times.append((t1 - t0) * 1e3)
                assert torch.equal(channel.kv(rep % 2), page_kv(k_buffer, v_buffer, rep % 4,
                                                                 tokens).cpu()), rep
    finally:
        channel.close(unlink=True)
    return {"median": statistics.median(times), "max": max(times), "pinned": bool(pinned)}


class profiled:
    """torch.profiler over a block (when on): prints the 10 ops with the most host self time."""

    def __init__(self, on: bool, what: str):
        self.prof = profile(activities=[ProfilerActivity.CPU]) if on else None
        self.what = what

    def __enter__(self):
        if self.prof is not None:
            self.prof.__enter__()

    def __exit__(self, *exc):
        if self.prof is None:
            return
        self.prof.__exit__(*exc)
        top = sorted(self.prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
        print(f"  profile of {self.what}: " + ", ".join(
            f"{e.key} {e.count}x {e.self_cpu_time_total / 1e3:.1f} ms" for e in top))


if __name__ == "__main__":
    main()
