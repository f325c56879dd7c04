"""Sealing a prompt's worth of pages (what inline sealing, `daemon: off`, adds to time-to-first-
token), through the code the pool runs: `seal_group` (one gather, `fit_bases`, `seal_pages`)
per basis block and `SegmentStore.install_pages`, over a dense hot buffer of random K/V laid out
like SGLang's (one [rows, H, D] tensor per layer). Without SGLang.

Reported per run, side by side on the same K/V: each `fit_solver` of --fit-solvers with the
first pack path, and each further `pack_kernel` path (--pack-kernel; torch: the chooser's tensors
staged and copied into the arena; triton: the GPU pack kernel writes the blocks from the
chooser's rotated K/V; default: both on CUDA, torch on CPU) with the first solver: seconds per
phase (read, fit_bases, gather, choose_encode, page_meta, bookkeeping, install; on CUDA each
phase is bracketed by synchronizations, which the serving path does not pay), segments (page x
layer) per second, peak transient device memory, the torch ops per segment that launch work (not
views: the launch count on a GPU); then the basis fit of one block with each solver (host: CPU
LAPACK over host threads; device: cuSOLVER; jacobi: batched GEMMs), whether host and device
agree bitwise, and the energy each solver's top-r axes capture over the exact top-r energy (min
over heads); and with --check that the batched path equals sealing and installing one segment at
a time, and that the two pack paths store the same bytes.

    python benchmarks/seal_bench.py --device cuda --fit-solvers host,device,jacobi  # Llama-8B, 32K
    python benchmarks/seal_bench.py --device cpu --layers 2 --tokens 2048 --check
    python benchmarks/seal_bench.py --device cuda --config '{"chooser": "cascade"}'  # A/B a knob
    python benchmarks/seal_bench.py --device cuda --tokens 8192 --chunk-layers  # the prefill's

`--chunk-layers` (alone): the position rule's prefill sealing, one layer at a time (a chunk's
own pages, every layer sealed before its attention, each block's bases fitted on its first
page), with the chunk's read-back of those pages each way: the codec's decode per segment
(`decoded_segment`, the former path) and one batched read-back per basis block
(`read_back_block`, the pool's): seconds for sealing and for each read-back over the layers,
their largest difference, and the torch ops that launch work per layer (sealing included).
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
from dataclasses import replace

import torch

from mosaickv_sglang.bench.basis_fit import energy_ratios, ranks_for
from mosaickv_sglang.bench.launches import LaunchCount
from mosaickv_sglang.codec.layer import Candidates
from mosaickv_sglang.codec.seal import BasisPair, decoded_segment, fit_bases, gather_pages, \
    read_back_block, seal_group, seal_pages
from mosaickv_sglang.codec.strategies import parse_strategy
from mosaickv_sglang.codec.timing import PhaseTimer, phase
from mosaickv_sglang.config import FIT_SOLVERS, MosaicConfig
from mosaickv_sglang.serving.segment_store import SegmentStore

PHASES = ("read", "fit_bases", "gather", "choose_encode", "page_meta", "bookkeeping", "install")


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


def fit_solvers(setup: Setup, solvers: list[str]) -> dict:
    """fit_bases of the first block with each solver: seconds, host == device bitwise, and per
    solver the energy its top-r axes capture / the exact top-r energy (min over heads)."""
    pages = next(setup.blocks())
    k, v = setup.read(pages)
    out, bases = {}, {}
    for solver in solvers:
        fit_bases(k, v, solver)  # warm-up (cuSOLVER handles, thread pool)
        sync(setup.args.device)
        t0 = time.perf_counter()
        bases[solver] = fit_bases(k, v, solver)
        sync(setup.args.device)
        out[f"{solver}_s"] = time.perf_counter() - t0
    if {"host", "device"} <= bases.keys():
        out["bitwise_equal"] = all(torch.equal(a, b) for a, b in
                                   zip(bases["host"].k + bases["host"].v,
                                       bases["device"].k + bases["device"].v))
    ranks = ranks_for(k.shape[-1])
    for kind, x in (("k", k), ("v", v)):
        flat = x.permute(1, 2, 0, 3, 4).flatten(2, 3).flatten(0, 1).float()  # [L*H, P*S, D]
        cov = flat.transpose(-1, -2) @ flat
        for solver, b in bases.items():
            axes = torch.stack(getattr(b, kind)).flatten(0, 1).float().transpose(-1, -2)
            ratios = energy_ratios(cov, axes, ranks)
            out[f"{solver}_{kind}_energy_ratio_min"] = {r: float(t.min()) for r, t in ratios.items()}
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


def timed_seal(setup: Setup, pack: str) -> dict:
    """Seal the prompt with setup.cfg and one pack path: warm-up (one block), a run with
    synchronized phases, a run as served (no synchronization between phases, peak device
    memory), the launch count of one block."""
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
    segments = setup.pages * setup.args.layers
    return {
        "fit_solver": setup.cfg.fit_solver, "pack_kernel": pack,
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
        "strategies": dict(Counter(f"{s.k.strategy.spec} | {s.v.strategy.spec}"
                                   for sp in sealed for s in sp.segments)),
        "packed_segments": int(store.packed.sum()), "arena_full": store.arena_full,
        "packed_by": dict(store.pack_counts),
    }


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
    kept = sa.install_pages(pages, [sp.segments for sp in batched])  # as the store keeps them
    for p, segs in zip(pages, single):
        for layer, seg in enumerate(segs):
            sb.install(layer, [p], [seg])
    for stored, segs in zip(kept, single):
        for a, b in zip(stored, segs):
            diff["strategy"] += (a.k.strategy.spec, a.v.strategy.spec) != (b.k.strategy.spec,
                                                                           b.v.strategy.spec)
            for ca, cb in ((a.k, b.k), (a.v, b.v)):
                diff["encoded"] += sum(not torch.equal(ca.encoded.tensors[n], cb.encoded.tensors[n])
                                       for n in ca.encoded.tensors)
            diff["header"] += not torch.equal(a.header, b.header)
            diff["page_meta"] += sum(not torch.equal(x, y) for x, y in
                                     zip(a.pages.tensors().values(), b.pages.tensors().values()))
    diff["store"] = store_diff(sa, sb)
    if for_kernel is not None:
        sk = setup.store("triton")
        sk.install_pages(pages, [sp.segments for sp in for_kernel])
        diff["pack_paths"] = store_diff(sa, sk)
    return {"pages": len(pages), "segments": len(pages) * k.shape[1], **diff,
            "bitwise_equal": not any(diff.values())}


def parse_solvers(text: str | None) -> list[str]:
    solvers = text.split(",") if text else [MosaicConfig().fit_solver]
    bad = [x for x in solvers if x not in FIT_SOLVERS]
    if bad or len(set(solvers)) != len(solvers):
        raise SystemExit(f"seal_bench: --fit-solvers={text!r}: a comma list of distinct names "
                         f"from {list(FIT_SOLVERS)}")
    return solvers


def chunk_layers(setup: Setup) -> dict:
    """The position rule's prefill sealing layer by layer and its read-back, each way."""
    device, ps, cfg = setup.args.device, setup.ps, setup.cfg
    blocks = list(setup.blocks())
    k, v = setup.read(list(range(setup.pages)))  # [P, L, H, S, D]
    bases = []
    for pages in blocks:  # basis_fit first_page: each block's bases from its first page
        kf, vf = setup.read(pages[:1])
        bases.append(fit_bases(kf, vf, cfg.fit_solver))
    positions = [p * ps for p in range(setup.pages)]

    def layer(local: int, how: str):
        per = [BasisPair([b.k[local]], [b.v[local]]) for b in bases]
        sync(device)
        t0 = time.perf_counter()
        sealed = seal_pages(k[:, local:local + 1], v[:, local:local + 1], positions,
                            [per[p // setup.block] for p in range(setup.pages)], cfg,
                            setup.cands, setup.dense, keep_decoded=how == "batched")
        sync(device)
        t1 = time.perf_counter()
        out = []
        for b, pages in enumerate(blocks):
            if how == "batched":
                refs = [sealed[p].segments.refs[0] for p in pages]
                kr, vr = read_back_block(refs, per[b].k[0], per[b].v[0], torch.bfloat16)
                out += [(kr[i], vr[i]) for i in range(len(pages))]
            else:
                out += [tuple(x.transpose(0, 1).to(torch.bfloat16) for x in
                              decoded_segment(sealed[p].segments[0], per[b].k[0], per[b].v[0]))
                        for p in pages]
        sync(device)
        return t1 - t0, time.perf_counter() - t1, out

    layer(0, "batched")  # warm-up
    layer(0, "per_segment")
    res = {"pages": setup.pages, "layers": setup.args.layers, "launching_ops_per_layer": {}}
    for how in ("batched", "per_segment"):  # torch ops that launch work (GPU launches), layer 0
        with LaunchCount() as count:
            layer(0, how)
        res["launching_ops_per_layer"][how] = sum(count.ops.values())
    seal_s = {"batched": 0.0, "per_segment": 0.0}
    read_s = dict(seal_s)
    diff = 0.0
    for local in range(setup.args.layers):
        outs = {}
        for how in ("batched", "per_segment"):
            a, b, outs[how] = layer(local, how)
            seal_s[how] += a
            read_s[how] += b
        diff = max(diff, max(float((x.float() - y.float()).abs().max()) for p, q in
                             zip(outs["batched"], outs["per_segment"]) for x, y in zip(p, q)))
    segs = setup.pages * setup.args.layers
    res.update({"seal_s": seal_s, "read_back_s": read_s, "max_abs_diff": diff,
                "ms_per_segment": {h: (seal_s[h] + read_s[h]) / segs * 1e3 for h in seal_s},
                "segments_per_s": {h: segs / (seal_s[h] + read_s[h]) for h in seal_s}})
    return res


def device_name(device) -> str:
    return torch.cuda.get_device_name() if torch.device(device).type == "cuda" else \
        platform.processor() or "cpu"


def write_json(path: str | None, name: str, obj: dict) -> None:
    """`obj` to --json, else to $OUT/`name` when $OUT is set."""
    path = path or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--fit-solvers", default=None,
                    help=f"comma list from {list(FIT_SOLVERS)}: each seals the prompt, side by "
                         "side on the same K/V (default: the config's default)")
    ap.add_argument("--pack-kernel", choices=("torch", "triton", "both"), default=None,
                    help="who writes the arena blocks (default: both on CUDA, torch elsewhere; "
                         "triton on a CPU needs TRITON_INTERPRET=1)")
    ap.add_argument("--check", action="store_true",
                    help="also compare batched against one-segment-at-a-time sealing (with the "
                         "first solver), and the two pack paths' stores (bitwise)")
    ap.add_argument("--check-pages", type=int, default=4)
    ap.add_argument("--chunk-layers", action="store_true",
                    help="only the position rule's layer-by-layer sealing and its read-back")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--json", default=None, help="default: $OUT/seal_bench.json if $OUT is set")
    ap.add_argument("--config", default=None,
                    help='MosaicConfig fields as JSON, e.g. \'{"chooser": "cascade"}\'')
    args = ap.parse_args()
    solvers = parse_solvers(args.fit_solvers)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    pack = args.pack_kernel or ("both" if cuda else "torch")
    paths = ["torch", "triton"] if pack == "both" else [pack]
    setup = Setup(args, MosaicConfig(**{**json.loads(args.config or "{}"),
                                        "fit_solver": solvers[0]}))
    segments = setup.pages * args.layers
    if args.chunk_layers:
        res = chunk_layers(setup)
        res["device"] = device_name(args.device)
        res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        write_json(args.json, "seal_chunk_layers.json", res)
        print(f"{res['device']}, {res['date']}: {setup.pages} pages x {args.layers} layers, "
              "sealed layer by layer, s (sealing, read-back): " + "; ".join(
                  f"{h} {res['seal_s'][h]:.3f} + {res['read_back_s'][h]:.3f} "
                  f"({res['segments_per_s'][h]:.0f} segments/s)" for h in res["seal_s"])
              + f"; largest difference {res['max_abs_diff']:.3g}; launching torch ops per layer "
              + ", ".join(f"{h} {n}" for h, n in res["launching_ops_per_layer"].items()))
        return
    runs = {}  # every solver with the first pack path, then the other paths with the first solver
    for solver, path in [(x, paths[0]) for x in solvers] + [(solvers[0], p) for p in paths[1:]]:
        setup.cfg = replace(setup.cfg, fit_solver=solver)
        runs[f"{solver}/{path}"] = timed_seal(setup, path)
    setup.cfg = replace(setup.cfg, fit_solver=solvers[0])
    result = {
        "shape": {"tokens": args.tokens, "layers": args.layers, "heads": args.heads,
                  "head_dim": args.head_dim, "pages": setup.pages, "segments": segments,
                  "basis_block_pages": setup.block},
        "device": device_name(args.device),
        "torch": torch.__version__, "host_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "config": json.loads(args.config or "{}"),
        "runs": runs,
        "fit_solvers": fit_solvers(setup, sorted(set(solvers) - {"auto"} | {"host", "device"},
                                                 key=FIT_SOLVERS.index)),
    }
    if args.check:
        result["check"] = check(setup, args.check_pages, paths)
    write_json(args.json, "seal_bench.json", result)

    print(f"sealing {setup.pages} pages x {args.layers} layers = {segments} segments "
          f"({args.heads} KV heads, D={args.head_dim}) on {result['device']}")
    for name, run in runs.items():
        print(f"{name}: strategies {run['strategies']}")
        print(f"  launching torch ops per segment: {run['launching_ops_per_segment']:.1f} "
              f"(top: {dict(list(run['top_ops'].items())[:5])})")
        if run["peak_transient_gib"] is not None:
            print(f"  peak device memory while sealing, above the store and the cache: "
                  f"{run['peak_transient_gib']:.2f} GiB")
    fs = result["fit_solvers"]
    print(f"fit_bases of one {fs['pages']}-page block: "
          + ", ".join(f"{x} {fs[x + '_s'] * 1e3:.1f} ms" for x in FIT_SOLVERS if x + "_s" in fs)
          + f" (host == device bitwise: {fs.get('bitwise_equal')})")
    for x in FIT_SOLVERS:
        if f"{x}_k_energy_ratio_min" in fs:
            print(f"  {x}: top-r energy / exact, min over heads, r=" + ",".join(
                str(r) for r in fs[f"{x}_k_energy_ratio_min"]) + ": K " + " ".join(
                f"{t:.4f}" for t in fs[f"{x}_k_energy_ratio_min"].values()) + ", V " + " ".join(
                f"{t:.4f}" for t in fs[f"{x}_v_energy_ratio_min"].values()))
    if args.check:
        print(f"check batched == one at a time (fit_solver={solvers[0]}) and pack paths:",
              result["check"])
    for name, r in runs.items():
        print(f"{name}: blocks written by {r['packed_by']}")
    head = "".join(f"{x + ' s':>20}{'ms/seg':>9}" for x in runs)
    print(f"\n{'phase (synchronized)':<22}{head}")
    for p in PHASES:
        print(f"{p:<22}" + "".join(f"{r['phases_s'][p]:>20.3f}{r['phases_s'][p] / segments * 1e3:>9.3f}"
                                   for r in runs.values()))
    print(f"{'total (synchronized)':<22}" + "".join(
        f"{r['timed_total_s']:>20.3f}{r['timed_total_s'] / segments * 1e3:>9.3f}" for r in runs.values()))
    print(f"{'total (as served)':<22}" + "".join(
        f"{r['total_s']:>20.3f}{r['ms_per_segment']:>9.3f}" for r in runs.values()))
    print(f"{'segments/s (served)':<22}" + "".join(f"{r['segments_per_s']:>29.0f}" for r in runs.values()))


if __name__ == "__main__":
    main()
