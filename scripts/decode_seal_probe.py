"""The decode step's seal phase, step by step, with `decode_seal_layers` 0 (every layer of a
page at once) against slices of a few layers per step: `--requests` requests decoding across
page boundaries on the same steps (equal lengths, as a batch of equal prompts) on a bare pool
(no model, no server), as `_prepare_decode` seals (`seal_request_pages(..., decode_step=True)`
per request, inside `batched_seals` unless `--unbatched`, then `advance_decode_seals`). Prints,
per setting, the longest step, the steps over 1 ms and the total: the peak a step pays, and
that the total work stays the same.

    python scripts/decode_seal_probe.py                         # CPU: 32 layers, 8 KV heads x 128
    python scripts/decode_seal_probe.py --device cuda --layers-per-step 0,1,4,8
    python scripts/decode_seal_probe.py --requests 16 --layers-per-step 0,0 --batched-vs-not
    python scripts/decode_seal_probe.py --device cuda --requests 16 --layers-per-step 0,0 \
        --config '{"write_transform_cache_mb": 0}'   # the open blocks' R^-1 not kept
    python scripts/decode_seal_probe.py --device cuda --requests 16 --layers-per-step 0,0 \
        --top-ops 15 [--profile-usual]   # where a seal step's time goes: torch.profiler, ops
                                         # by self time (--profile-usual: after the first seal)
    python scripts/decode_seal_probe.py --device cuda --requests 16 --layers-per-step 0,0 \
        --phases                         # the same by the seal path's own functions

With `--top-ops` the steps run under torch.profiler (their times then include its overhead):
the table ranks ops by self CUDA time on a GPU (then a second table by self CPU time: launches,
copies, and host syncs as `cudaStreamSynchronize` / `cudaMemcpyAsync` waits), self CPU time on
the CPU. With `--phases` each seal step's wall time is split by the seal path's functions
(`PHASES`: the basis fit, the write transforms, the gather, the rotation, each kind's chooser,
the page metadata, the store's install...), each timed inclusive of what it calls, the device
synced before and after every call (so the sum of a step's phases can exceed its own time when
phases nest, and the syncs add a little to it).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from mosaickv_sglang.bench.launches import LaunchCount
from mosaickv_sglang.codec import layer as codec_layer
from mosaickv_sglang.codec import seal as codec_seal
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving import pool as serving_pool
from mosaickv_sglang.serving import segment_store
from mosaickv_sglang.serving.graph_decode import band_pairs
from mosaickv_sglang.serving.pool import MosaicKVPool

# (phase name, the object whose attribute is the function, the attribute): every place the seal
# path looks the function up at call time (a module's global, or a class's method)
PHASES = (
    ("fit_groups", serving_pool, "fit_groups"),
    ("read_pages", MosaicKVPool, "_read_pages"),
    ("seal_pages", serving_pool, "seal_pages"),
    ("seal_group", serving_pool, "seal_group"),
    ("write_transforms", codec_seal.WriteTransformCache, "tables"),
    ("write_transforms", codec_seal, "write_transforms_of"),
    ("gather_batch", codec_seal, "_batch"),
    ("seal_segments", codec_seal, "seal_segments"),
    ("rotate", codec_layer, "_rotate"),
    ("choose", codec_layer, "_choose_batch"),
    ("page_meta", codec_layer, "build_page_meta"),
    ("install", MosaicKVPool, "_install"),
    ("store_pages", segment_store.SegmentStore, "store_pages"),
    ("install_batched", segment_store.SegmentStore, "_install_batched"),
    ("write_batched", segment_store.SegmentStore, "_write_batched"),
    ("pack", segment_store.SegmentStore, "_pack"),
)


class PhaseTimer:
    """Inclusive wall time per PHASES entry while active (`with timer:`), the device synced
    around each call; `take()` returns the times since the last take (ms, rounded)."""

    def __init__(self, device: str):
        self.sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        self.ms: Counter = Counter()
        self._saved = []

    def _wrap(self, name, fn):
        def timed(*a, **kw):
            self.sync()
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.sync()
                self.ms[name] += (time.perf_counter() - t) * 1e3
        return timed

    def __enter__(self):
        for name, owner, attr in PHASES:
            fn = owner.__dict__[attr]
            self._saved.append((owner, attr, fn))
            setattr(owner, attr, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved.clear()

    def take(self) -> dict:
        out = {k: round(v, 1) for k, v in self.ms.items() if v >= 0.05}
        self.ms.clear()
        return out


def run(n: int, args, batched: bool = True) -> dict:
    ps, h, d, layers, hot = 128, args.heads, args.head_dim, args.layers, 64
    per = args.pages + 1  # pages per request
    pool = MosaicKVPool((per * args.requests + 2) * ps, ps, torch.bfloat16, h, d, layers,
                        args.device, False,
                        mosaic_config=MosaicConfig(**{"hot_tokens": hot, **json.loads(
                            getattr(args, "config", None) or "{}"), "decode_seal_layers": n}))
    # the kernel variants a server compiles at start-up (backend.py), so a step's time is not
    # a first-use compile
    pairs = band_pairs(pool.cfg)
    pool.store.compile_pack_kernels(pairs, ps)
    pool.store.compile_chooser_kernels(pairs, ps, pool.cfg.chooser)
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(ps, ps + per * args.requests * ps)
    for layer in range(layers):
        k = torch.randn(len(slots), h, d, generator=gen) * (1 + torch.arange(d) % 7)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), slots.to(args.device),
                           k.bfloat16().to(args.device),
                           torch.randn(len(slots), h, d, generator=gen).bfloat16().to(args.device))
    pages = (slots[::ps] // ps).numpy().reshape(args.requests, per)
    times, ops = [], Counter()
    top = getattr(args, "top_ops", 0)
    cuda = args.device != "cpu"
    acts = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts) if top else None
    usual = top and getattr(args, "profile_usual", False)
    timer = PhaseTimer(args.device) if getattr(args, "phases", False) else None
    phases: list[dict] = []
    if prof is not None and not usual:
        prof.start()
    with timer if timer is not None else nullcontext():
        steps(pool, pages, args, batched, ps, hot, times, ops, prof if usual else None,
              timer, phases)
    if prof is not None and (not usual or prof.profiler is not None):
        prof.stop()
    table = None
    if top and prof.profiler is None:
        table = "(nothing profiled: no step sealed pages)"
    elif top:
        avg = prof.key_averages()
        table = avg.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                          row_limit=top)
        if cuda:  # the host's side too: launches, copies, and the waits of host syncs
            table += "\n" + avg.table(sort_by="self_cpu_time_total", row_limit=top)
    return {"decode_seal_layers": n, "batched": batched, "sealed_pages": len(pool.sealed),
            "max_ms": max(times) * 1e3,
            "seal_steps_ms": [round(x * 1e3, 1) for x in times if x > 1e-3],
            "steps_over_1ms": sum(x > 1e-3 for x in times),
            "total_ms": sum(times) * 1e3, "slices": pool.counters.decode_seal_slices,
            "torch_ops": sum(ops.values()) if args.count_ops else None, "profile": table,
            "write_transforms": pool.write_cache.stats(), "phases": phases}


def steps(pool, pages, args, batched, ps, hot, times, ops, start_after_first=None, timer=None,
          phases=None) -> None:
    """The decode steps from just before the first page boundary to past the last.
    `start_after_first`: a profiler started once a step has sealed pages (the steps after the
    one that opens the basis block: a decode step's usual seal, bases existing). `timer`: a
    PhaseTimer whose phases of each step that sealed are appended to `phases`."""
    for pos in range(ps + hot - 2, args.pages * ps + hot + 40):
        if start_after_first is not None and start_after_first.profiler is None and \
                pool.counters.sealed_pages:
            start_after_first.start()
        if args.device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with LaunchCount(ops) if args.count_ops else nullcontext():
            with pool.batched_seals() if batched else nullcontext():
                for req in pages:
                    pool.seal_request_pages(req, pos, decode_step=True)
            if pool.decode_sealing:
                pool.advance_decode_seals()
        if args.device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if timer is not None:
            got = timer.take()
            if got:
                phases.append({"step_ms": round(times[-1] * 1e3, 1), **got})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pages", type=int, default=3, help="page boundaries crossed")
    ap.add_argument("--requests", type=int, default=1, help="requests sealing on the same steps")
    ap.add_argument("--count-ops", action="store_true",
                    help="count the torch ops that launch work (not views) over all steps")
    ap.add_argument("--batched-vs-not", action="store_true",
                    help="each setting with and without `batched_seals`")
    ap.add_argument("--top-ops", type=int, default=0,
                    help="profile the steps (torch.profiler) and print this many ops by self time")
    ap.add_argument("--config", default=None,
                    help='MosaicConfig fields as JSON, e.g. \'{"write_transform_cache_mb": 0}\'')
    ap.add_argument("--profile-usual", action="store_true",
                    help="with --top-ops: profile only the steps after the first seal step "
                         "(whose basis fit would dominate the table)")
    ap.add_argument("--phases", action="store_true",
                    help="split each seal step's time by the seal path's functions (PHASES), "
                         "the device synced around each")
    ap.add_argument("--layers-per-step", default="0,0,1,4,8",
                    help="settings, in order (the first run warms up)")
    args = ap.parse_args()
    for n in (int(x) for x in args.layers_per_step.split(",")):
        for batched in (True, False) if args.batched_vs_not else (True,):
            report(run(n, args, batched))


def report(r: dict) -> None:
    print(f"decode_seal_layers={r['decode_seal_layers']}, "
          f"{'batched' if r['batched'] else 'request by request'}: "
          f"{r['sealed_pages']} pages sealed; "
          f"longest step {r['max_ms']:.1f} ms; {r['steps_over_1ms']} steps over 1 ms; "
          f"total {r['total_ms']:.1f} ms; {r['slices']} slices; steps over 1 ms: "
          f"{r['seal_steps_ms']} ms"
          + (f"; {r['torch_ops']} torch ops" if r["torch_ops"] is not None else "")
          + f"; write transforms {r['write_transforms']}", flush=True)
    for p in r["phases"]:
        print("  phases (ms, inclusive):", json.dumps(p), flush=True)
    if r["profile"]:
        print(r["profile"], flush=True)


if __name__ == "__main__":
    main()
