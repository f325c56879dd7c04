"""Host time of one decode step's plan (`PackedDecode.begin`) at a serving geometry, on the CPU.

The plan is pure host work: it reads each request's page ids, which pages are sealed (and their
basis blocks), the store's packed flags and the hot-page map, and builds the step's row tables
and, past the selection budget, its `RowSelection`. So it is measured here without sealing
anything: a stand-in pool holds those four things for B requests of CTX tokens (all pages
sealed but the last two, basis blocks of `basis_block_tokens`), and `begin` runs on it as the
server calls it. The H200 step profile's `host_plan` phase (4.8-6.4 ms per step at 3 x 128K,
2026-11-30) is this plus the transfers of the tables. The full decode graph's host tables
(`GraphDecode.prepare`) are timed the same way.

    python benchmarks/plan_bench.py --batch 3 --context 131072 --reps 20
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.packed_decode import PackedDecode, StepProfiler


def stand_in(batch: int, context: int, layers: int, page_size: int, cfg: MosaicConfig):
    """(PackedDecode over a stand-in pool, forward batch, req_to_token) for `begin`."""
    pages_per_req = -(-context // page_size)
    block_pages = cfg.basis_block_tokens // page_size
    basis_tensor = torch.zeros(2 * layers, 1, 16, 16, dtype=torch.bfloat16)
    total = batch * pages_per_req + 1
    sealed, hot_page_of = {}, torch.full((total + 1,), -1, dtype=torch.long)
    req_to_token = torch.zeros(batch + 1, pages_per_req * page_size, dtype=torch.int32)
    page = 1
    for r in range(batch):
        pages = list(range(page, page + pages_per_req))
        page += pages_per_req
        bases = None
        for j, p in enumerate(pages):
            if j < pages_per_req - 2:
                if j % block_pages == 0:  # a basis block: its identity, and its tensor's address
                    bases = SimpleNamespace(stacked=lambda: basis_tensor)
                sealed[p] = SimpleNamespace(bases=bases)
            else:
                hot_page_of[p] = p % 64
        slots = (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).flatten()
        req_to_token[r + 1, :len(slots)] = slots
    page_sealed = np.zeros(total + 1, dtype=bool)
    page_basis = np.zeros(total + 1, dtype=np.int64)
    for p, page in sealed.items():
        page_sealed[p], page_basis[p] = True, id(page.bases)

    def read_split_np(pages, position, prompt=None):  # the chunk rule: every sealed leading page
        flags = page_sealed[pages]
        return len(pages) if flags.all() else int(flags.argmin())

    pool = SimpleNamespace(page_size=page_size, sealed=sealed, hot_page_of=hot_page_of,
                           device="cpu", cfg=cfg, read_split_np=read_split_np,
                           prompt_split=False,
                           page_sealed=page_sealed, page_basis=page_basis, layer_num=layers,
                           head_num=8, start_layer=0,
                           store=SimpleNamespace(packed=torch.ones(layers, total + 1,
                                                                   dtype=torch.bool),
                                                 unreadable=set()))
    plan = object.__new__(PackedDecode)  # no kernels: only the planner's state
    plan.pool, plan.cfg, plan.timer = pool, cfg, StepProfiler(0, "cpu")
    plan.kernel_requests = plan.reference_requests = 0
    plan.always_select, plan.graph = False, None
    batch_ns = SimpleNamespace(batch_size=batch, seq_lens_cpu=torch.full((batch,), context - 100),
                               req_pool_indices=torch.arange(1, batch + 1))
    return plan, batch_ns, req_to_token


def time_ms(fn, reps: int) -> tuple[float, float]:
    """(median, min) wall ms of `fn` over `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the scheduler thread
    plan, batch, req_to_token = stand_in(args.batch, args.context, args.layers, args.page_size,
                                         MosaicConfig())
    med, low = time_ms(lambda: plan.begin(batch, req_to_token), args.reps)
    print(f"eager plan (PackedDecode.begin) of {args.batch} x {args.context} tokens "
          f"({len(plan.step.row_bases)} rows, selection "
          f"{'on' if plan.step.rows is not None else 'off'}): median {med:.2f} ms, min {low:.2f} ms "
          f"over {args.reps}")
    # the full decode graph's tables for the same batch (GraphDecode.prepare), the model's
    # context length being the request's (its rows per request)
    from mosaickv_sglang.serving.graph_decode import GraphDecode

    graph = GraphDecode(plan.pool, args.context, plan.timer)
    graph.bucket_for(args.batch)
    med, low = time_ms(lambda: graph.prepare(batch, req_to_token, args.batch), args.reps)
    print(f"graph tables (GraphDecode.prepare), {graph.width} rows per request: median "
          f"{med:.2f} ms, min {low:.2f} ms over {args.reps}")


if __name__ == "__main__":
    main()
