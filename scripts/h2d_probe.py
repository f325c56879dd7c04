"""Host time of the small device operations a step boundary issues, with the stream idle and
with it busy (a forward in flight): does any of them wait for the device?

Measured on CUDA, median of --reps, microseconds of host time per call:
* a result's 4 MB blob onto the device from a shared-memory slot registered with
  cudaHostRegister (what `channel.load` does), from a torch pinned tensor and from pageable memory
  (a copy from pageable memory returns only once the bytes are staged, so on a busy stream it can
  wait for the work ahead of it);
* a small pinned upload (AdoptRows' row table), a flag write with a Python scalar
  (`packed[:, page] = True`), an event record and query.

    python scripts/h2d_probe.py --json h2d.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from multiprocessing import shared_memory

import torch


def host_us(fn, reps: int, busy: torch.Tensor | None) -> float:
    """Median host microseconds of fn(); with `busy`, ~20 ms of GEMMs queued before each call."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if busy is not None:
            for _ in range(20):
                busy @ busy
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=4 << 20, help="the result blob's size")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("h2d_probe: needs CUDA")
    dev = torch.device("cuda", torch.cuda.current_device())
    shm = shared_memory.SharedMemory(create=True, size=args.bytes * 2)
    try:
        region = torch.frombuffer(shm.buf, dtype=torch.uint8, count=args.bytes * 2)
        rc = int(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region.numel(), 1))
        sources = {"registered shm": region[:args.bytes],
                   "torch pinned": torch.empty(args.bytes, dtype=torch.uint8, pin_memory=True),
                   "pageable": torch.empty(args.bytes, dtype=torch.uint8)}
        small = torch.zeros(512, dtype=torch.int64, pin_memory=True)
        small_dev = torch.empty_like(small, device=dev)
        packed = torch.zeros(32, 4096, dtype=torch.bool, device=dev)
        event = torch.cuda.Event()
        ops = {f"4 MB blob .to(cuda, non_blocking) from {k}":
               (lambda s=s: s.to(dev, non_blocking=True)) for k, s in sources.items()}
        ops["4 KB pinned row table up (copy_, non_blocking)"] = \
            lambda: small_dev.copy_(small, non_blocking=True)
        ops["packed[:, page] = True"] = lambda: packed.__setitem__((slice(None), 7), True)
        ops["Event.record"] = lambda: event.record(torch.cuda.current_stream(dev))
        ops["Event.query"] = lambda: event.query()
        busy = torch.randn(4096, 4096, device=dev)
        for fn in ops.values():  # warm
            host_us(fn, 2, None)
        rows = {name: {"idle_us": host_us(fn, args.reps, None),
                       "busy_us": host_us(fn, args.reps, busy)} for name, fn in ops.items()}
        if rc != 0:
            rows["note"] = f"cudaHostRegister returned {rc}"
        torch.cuda.cudart().cudaHostUnregister(region.data_ptr())
    finally:
        try:
            shm.close()
        except BufferError:  # views of it are still alive: the mapping goes at exit
            pass
        shm.unlink()
    gemm = host_us(lambda: torch.cuda.synchronize(), 3, busy)
    print(f"{torch.cuda.get_device_name(dev)}; busy = ~{gemm / 1e3:.1f} ms of GEMMs queued ahead")
    print("| operation | host us, stream idle | host us, stream busy |\n|---|---|---|")
    for name, r in rows.items():
        if isinstance(r, dict):
            print(f"| {name} | {r['idle_us']:.1f} | {r['busy_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(dev), "busy_ms": gemm / 1e3,
                       "ops": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
