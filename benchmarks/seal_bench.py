"""Sealing a prompt's worth of pages (what inline sealing, `daemon: off`, adds to time-to-first-
token), through the code the pool runs: `seal_group` (one gather, `fit_bases`, `seal_pages`)
per basis block and `SegmentStore.install_pages`, over a dense hot buffer of random K/V laid out
like SGLang's (one [rows, H, D] tensor per layer). Without SGLang.

Reported, per `pack_kernel` path (torch: the chooser's tensors staged and copied into the
arena; triton: the GPU pack kernel writes the blocks from the chooser's rotated K/V; default:
both on CUDA, torch on CPU): seconds per phase (read, fit_bases, gather, choose_encode,
page_meta, bookkeeping, install; on CUDA each phase is bracketed by synchronizations, which the
serving path does not pay), segments (page x layer) per second, peak transient device memory;
once: the basis fit of one block with each `fit_solver` (host: CPU LAPACK over host threads;
device: cuSOLVER) and whether the two agree bitwise, the torch ops per segment that launch work
(not views: the launch count on a GPU), and with --check that the batched path equals sealing
and installing one segment at a time, and that the two pack paths store the same bytes.

    python benchmarks/seal_bench.py --device cuda                  # Llama-3.1-8B shape, 32K
    python benchmarks/seal_bench.py --device cpu --layers 2 --tokens 2048 --check
    TRITON_INTERPRET=1 python benchmarks/seal_bench.py --device cpu --layers 2 --tokens 1024 \
        --pack-kernel both                                         # the kernel interpreted
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mosaickv_sglang.codec.layer import Candidates
from mosaickv_sglang.codec.seal import BasisPair, fit_bases, gather_pages, seal_group, seal_pages
from mosaickv_sglang.codec.strategies import parse_strategy
from mosaickv_sglang.codec.timing import PhaseTimer, phase
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.segment_store import SegmentStore

PHASES = ("read", "fit_bases", "gather", "choose_encode", "page_meta", "bookkeeping", "install")


class LaunchCount(TorchDispatchMode):
    """Aten ops that compute or copy (views and metadata ops excluded), by name."""
    VIEWS = {"view", "_unsafe_view", "select", "slice", "transpose", "t", "permute", "expand",
             "unsqueeze", "squeeze", "detach", "alias", "as_strided", "lift_fresh", "unbind",
             "split", "split_with_sizes", "tensor_split", "reshape", "flatten", "diagonal",
             "unflatten", "_reshape_alias", "view_as_real", "view_as_complex", "is_nonzero",
             "_local_scalar_dense", "item", "sym_size", "sym_stride", "sym_numel", "dim",
             "numel", "stride", "size", "is_contiguous", "t_", "set_", "_to_copy_cpu"}

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class Setup:
    """A hot buffer holding `pages` pages (page p at rows (p+1)*S: row page 0 is SGLang's
    padding page), channel energies spread like real K (a few strong channels)."""

    def __init__(self, args, cfg: MosaicConfig):
        self.cfg, self.args = cfg, args
        self.ps = cfg.segment_tokens
        self.pages = args.tokens // self.ps
        g = torch.Generator(args.device).manual_seed(args.seed)
        scale = torch.logspace(0.5, -1, args.head_dim, device=args.device)
        shape = ((self.pages + 1) * self.ps, args.heads, args.head_dim)
        self.k = [(torch.randn(shape, generator=g, device=args.device) * scale)
                  .to(torch.bfloat16) for _ in range(args.layers)]
        self.v = [(torch.randn(shape, generator=g, device=args.device) * scale.flip(0))
                  .to(torch.bfloat16) for _ in range(args.layers)]
        self.cands = Candidates.from_config(cfg)
        self.dense = parse_strategy("dense")
        self.block = cfg.basis_block_tokens // self.ps

    def store(self, pack: str = "torch") -> SegmentStore:
        a = self.args
        per_layer = 2 * a.tokens * a.heads * a.head_dim * 2  # dense bytes: room for any layout
        return SegmentStore(a.layers, self.pages + 1, a.heads, a.head_dim, self.ps,
                            self.cfg.page_tokens, a.device, self.cfg.select.meta_channels,
                            per_layer, pack)

    def read(self, pages: list[int]):
        return gather_pages(self.k, self.v, torch.tensor(pages) + 1, self.ps)

    def blocks(self, limit: int | None = None):
        """Page numbers per basis block, of the first `limit` pages (default: all)."""
        end = self.pages if limit is None else min(limit, self.pages)
        for first in range(0, end, self.block):
            yield list(range(first, min(first + self.block, end)))

    def seal(self, store: SegmentStore, timer=None, limit: int | None = None):
        """The pool's `_seal_now` for every basis block of the prompt -> sealed pages."""
        out = []
        for pages in self.blocks(limit):
            sealed = seal_group(lambda idx: self.read([pages[i] for i in idx]),
                                [p * self.ps for p in pages], None, self.cfg, self.cands,
                                self.dense, timer, keep_rotated=store.pack_kernel)
            with phase(timer, "install"):
                store.install_pages(pages, [sp.segments for sp in sealed])
            out += sealed
        return out


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def fit_solvers(setup: Setup) -> dict:
    """fit_bases of the first block with each solver: seconds, and bitwise agreement."""
    pages = next(setup.blocks())
    k, v = setup.read(pages)
    out, bases = {}, {}
    for solver in ("host", "device"):
        fit_bases(k, v, solver)  # warm-up (cuSOLVER handles, thread pool)
        sync(setup.args.device)
        t0 = time.perf_counter()
        bases[solver] = fit_bases(k, v, solver)
        sync(setup.args.device)
        out[f"{solver}_s"] = time.perf_counter() - t0
    out["bitwise_equal"] = all(torch.equal(a, b) for a, b in
                               zip(bases["host"].k + bases["host"].v,
                                   bases["device"].k + bases["device"].v))
    out["pages"] = len(pages)
    return out


def store_diff(a: SegmentStore, b: SegmentStore) -> int:
    """Mismatches between two stores filled alike: arena bytes (up to the bump pointer), header
    rows, page-metadata tensors, block tables."""
    n = int(a.blocks != b.blocks) + int(a.top != b.top)
    for layer in range(len(a.data)):
        top = a.top[layer]
        n += int((a.data[layer][:top] != b.data[layer][:top]).sum())
        n += int((a.headers[layer] != b.headers[layer]).any(-1).sum())
        if a.meta is not None:
            n += sum(not torch.equal(getattr(a.meta[layer], f), getattr(b.meta[layer], f))
                     for f in ("channels", "lo", "hi", "rest_norm"))
    return n


def check(setup: Setup, pages_limit: int, paths: list[str]) -> dict:
    """Batched (as served) vs one at a time: fit layer by layer, one chooser call per segment,
    one install per segment; and with both pack paths, the store the kernel fills vs the one
    torch fills from the same segments. Returns counts of mismatches (0 = bitwise equal)."""
    cfg, ps = setup.cfg, setup.ps
    pages = next(setup.blocks(pages_limit))
    k, v = setup.read(pages)
    positions = [p * ps for p in pages]
    bases = fit_bases(k, v, cfg.fit_solver)
    one = [fit_bases(k[:, i:i + 1], v[:, i:i + 1], cfg.fit_solver) for i in range(k.shape[1])]
    diff = Counter()
    for i, b in enumerate(one):
        diff["bases"] += (not torch.equal(bases.k[i], b.k[0])) + (not torch.equal(bases.v[i], b.v[0]))
    batched = seal_pages(k, v, positions, bases, cfg, setup.cands, setup.dense,
                         keep_rotated=True)
    for_kernel = copy.deepcopy(batched) if "triton" in paths else None
    single = []
    for j in range(len(pages)):
        segs = [seal_pages(k[j:j + 1, i:i + 1], v[j:j + 1, i:i + 1], [positions[j]],
                           BasisPair([bases.k[i]], [bases.v[i]]), cfg, setup.cands,
                           setup.dense)[0].segments[0] for i in range(k.shape[1])]
        single.append(segs)
    sa, sb = setup.store(), setup.store()
    sa.install_pages(pages, [sp.segments for sp in batched])
    for p, segs in zip(pages, single):
        for layer, seg in enumerate(segs):
            sb.install(layer, [p], [seg])
    for sp, segs in zip(batched, single):
        for a, b in zip(sp.segments, segs):
            diff["strategy"] += (a.k.strategy.spec, a.v.strategy.spec) != (b.k.strategy.spec,
                                                                           b.v.strategy.spec)
            for ca, cb in ((a.k, b.k), (a.v, b.v)):
                diff["encoded"] += sum(not torch.equal(ca.encoded.tensors[n], cb.encoded.tensors[n])
                                       for n in ca.encoded.tensors)
            diff["header"] += not torch.equal(a.header, b.header)
            diff["page_meta"] += sum(not torch.equal(x, y) for x, y in
                                     zip(a.pages.tensors().values(), b.pages.tensors().values()))
    for layer in range(k.shape[1]):
        diff["store_headers"] += not torch.equal(sa.headers[layer], sb.headers[layer])
        if sa.meta is not None:
            diff["store_meta"] += sum(not torch.equal(x, y) for x, y in
                                      zip(sa.meta[layer].__dict__.values(),
                                          sb.meta[layer].__dict__.values())
                                      if isinstance(x, torch.Tensor))
    diff["blocks"] += sa.blocks != sb.blocks
    if for_kernel is not None:
        sk = setup.store("triton")
        sk.install_pages(pages, [sp.segments for sp in for_kernel])
        diff["pack_paths"] = store_diff(sa, sk)
    return {"pages": len(pages), "segments": len(pages) * k.shape[1], **diff,
            "bitwise_equal": not any(diff.values())}


def run_path(setup: Setup, pack: str, segments: int) -> tuple[dict, list]:
    """Seal the prompt with one pack path: warm-up (one block), a run with synchronized
    phases, a run as served (no synchronization between phases, peak device memory)."""
    device = setup.args.device
    cuda = torch.device(device).type == "cuda"
    setup.seal(setup.store(pack), limit=setup.block)  # warm-up: allocator, cuSOLVER, kernels
    sync(device)
    timer = PhaseTimer(device)
    t0 = time.perf_counter()
    sealed = setup.seal(setup.store(pack), timer)
    sync(device)
    timed_total = time.perf_counter() - t0
    store = setup.store(pack)
    if cuda:
        base_mem = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    setup.seal(store)
    sync(device)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    with LaunchCount() as count:
        setup.seal(setup.store(pack), limit=setup.block)
    counted = min(setup.block, setup.pages) * setup.args.layers
    return {
        "total_s": total, "segments_per_s": segments / total,
        "ms_per_segment": total / segments * 1e3, "timed_total_s": timed_total,
        "process_cpu_s": cpu,  # this process's CPU time (all threads): steadier on a shared box
        # transient device memory of sealing a prompt: above what was allocated before (store
        # incl.); the kernel path keeps the chooser's rotated K/V until install
        "peak_transient_gib": (torch.cuda.max_memory_allocated() - base_mem) / 2**30
        if cuda else None,
        "phases_s": {p: timer.seconds.get(p, 0.0) for p in PHASES},
        # aten ops only: the pack kernel's Triton launches (2 per layout and layer) not included
        "launching_ops_per_segment": sum(count.ops.values()) / counted,
        "top_ops": dict(count.ops.most_common(10)),
        "packed_segments": int(store.packed.sum()), "arena_full": store.arena_full,
        "packed_by": dict(store.pack_counts),
    }, sealed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--solver", choices=("host", "device"), default=None,
                    help="fit_solver for the timed run (default: the config's default)")
    ap.add_argument("--pack-kernel", choices=("torch", "triton", "both"), default=None,
                    help="who writes the arena blocks (default: both on CUDA, torch elsewhere; "
                         "triton on a CPU needs TRITON_INTERPRET=1)")
    ap.add_argument("--check", action="store_true",
                    help="also compare batched against one-segment-at-a-time sealing, and the "
                         "two pack paths' stores (bitwise)")
    ap.add_argument("--check-pages", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--json", default=None, help="default: $OUT/seal_bench.json if $OUT is set")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    pack = args.pack_kernel or ("both" if cuda else "torch")
    paths = ["torch", "triton"] if pack == "both" else [pack]
    cfg = MosaicConfig(**({"fit_solver": args.solver} if args.solver else {}))
    setup = Setup(args, cfg)
    segments = setup.pages * args.layers
    runs, sealed = {}, None
    for path in paths:
        runs[path], sealed = run_path(setup, path, segments)
    result = {
        "shape": {"tokens": args.tokens, "layers": args.layers, "heads": args.heads,
                  "head_dim": args.head_dim, "pages": setup.pages, "segments": segments,
                  "basis_block_pages": setup.block},
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "host_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "fit_solver": cfg.fit_solver,
        "paths": runs,
        "fit_solvers": fit_solvers(setup),
        "strategies": dict(Counter(f"{s.k.strategy.spec} | {s.v.strategy.spec}"
                                   for sp in sealed for s in sp.segments)),
    }
    if args.check:
        result["check"] = check(setup, args.check_pages, paths)
    path = args.json or (os.path.join(os.environ["OUT"], "seal_bench.json")
                         if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    print(f"sealing {setup.pages} pages x {args.layers} layers = {segments} segments "
          f"({args.heads} KV heads, D={args.head_dim}) on {result['device']}, "
          f"fit_solver={cfg.fit_solver}")
    print("strategies:", result["strategies"])
    fs = result["fit_solvers"]
    print(f"fit_bases of one {fs['pages']}-page block: host {fs['host_s'] * 1e3:.1f} ms, "
          f"device {fs['device_s'] * 1e3:.1f} ms (bitwise equal: {fs['bitwise_equal']})")
    if args.check:
        print("check batched == one at a time (and pack paths):", result["check"])
    for p, r in runs.items():
        print(f"{p}: launching torch ops per segment {r['launching_ops_per_segment']:.1f}, "
              f"blocks written by {r['packed_by']}"
              + (f", peak device memory above store and cache {r['peak_transient_gib']:.2f} GiB"
                 if cuda else ""))
    head = "".join(f"{p + ' s':>11}{'ms/seg':>9}" for p in runs)
    print(f"\n{'phase (synchronized)':<22}{head}")
    for ph in PHASES + ("total (synchronized)", "total (as served)"):
        row = ""
        for r in runs.values():
            sec = {"total (synchronized)": r["timed_total_s"],
                   "total (as served)": r["total_s"]}.get(ph, r["phases_s"].get(ph))
            row += f"{sec:>11.3f}{sec / segments * 1e3:>9.3f}"
        print(f"{ph:<22}{row}")
    print("segments/s as served: " + ", ".join(f"{p} {r['segments_per_s']:.0f} (process CPU "
                                               f"{r['process_cpu_s']:.2f} s)"
                                               for p, r in runs.items()))


if __name__ == "__main__":
    main()
