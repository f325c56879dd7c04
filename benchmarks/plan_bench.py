"""Host time of one decode step's plan (`PackedDecode.begin`) at a serving geometry, on the CPU.

The plan is pure host work: it reads each request's page ids, which pages are sealed (and their
basis blocks), the store's packed flags and the hot-page map, and builds the step's row tables
and, past the selection budget, its `RowSelection`. So it is measured here without sealing
anything: a stand-in pool holds those four things for B requests of CTX tokens (all pages
sealed but the last two, basis blocks of `basis_block_tokens`), and `begin` runs on it as the
server calls it. The H200 step profile's `host_plan` phase (4.8-6.4 ms per step at 3 x 128K,
session 8) is this plus the transfers of the tables.

    python benchmarks/plan_bench.py --batch 3 --context 131072 --reps 20
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.packed_decode import PackedDecode, StepProfiler


def stand_in(batch: int, context: int, layers: int, page_size: int, cfg: MosaicConfig):
    """(PackedDecode over a stand-in pool, forward batch, req_to_token) for `begin`."""
    pages_per_req = -(-context // page_size)
    block_pages = cfg.basis_block_tokens // page_size
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
                if j % block_pages == 0:
                    bases = SimpleNamespace()  # a basis block: only its identity is read
                sealed[p] = SimpleNamespace(bases=bases)
            else:
                hot_page_of[p] = p % 64
        slots = (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).flatten()
        req_to_token[r + 1, :len(slots)] = slots
    def read_split(pages, position):  # the chunk rule: every sealed leading page
        return next((i for i, p in enumerate(pages) if p not in sealed), len(pages))

    pool = SimpleNamespace(page_size=page_size, sealed=sealed, hot_page_of=hot_page_of,
                           device="cpu", cfg=cfg, read_split=read_split,
                           store=SimpleNamespace(packed=torch.ones(layers, total + 1,
                                                                   dtype=torch.bool)))
    plan = object.__new__(PackedDecode)  # no kernels: only the planner's state
    plan.pool, plan.cfg, plan.timer = pool, cfg, StepProfiler(0, "cpu")
    plan.kernel_requests = plan.reference_requests = 0
    batch_ns = SimpleNamespace(batch_size=batch, seq_lens_cpu=torch.full((batch,), context - 100),
                               req_pool_indices=torch.arange(1, batch + 1))
    return plan, batch_ns, req_to_token


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
    plan.begin(batch, req_to_token)  # warm-up
    times = []
    for _ in range(args.reps):
        t = time.perf_counter()
        plan.begin(batch, req_to_token)
        times.append((time.perf_counter() - t) * 1e3)
    print(f"plan of {args.batch} x {args.context} tokens ({len(plan.step.row_bases)} rows, "
          f"selection {'on' if plan.step.rows is not None else 'off'}): median "
          f"{statistics.median(times):.2f} ms, min {min(times):.2f} ms over {args.reps}")


if __name__ == "__main__":
    main()
