"""The fixed point where daemon results enter the pool: once per scheduler loop iteration,
before the next batch is chosen (no forward is running in Python then).

Every tensor-parallel rank runs its own daemon, so results arrive at different times on
different ranks. The open jobs are the same list on every rank (sealing decisions are
deterministic), so the ranks agree on a ready bitmap over it (MIN all-reduce on the TP CPU
group) and install exactly the agreed jobs: every rank switches the same pages at the same step.
A switch is atomic for readers: all layers of a page change between two forwards. On the GPU,
results are copied onto the device on the current stream, so the next forward is ordered after
them, and a freed hot page is only rewritten by a later forward on the same stream.
"""
from __future__ import annotations

import math

import torch


def agree(ready: list[bool], group=None) -> list[bool]:
    """Jobs ready on every rank of `group` (a gloo/CPU process group; None or size 1: local)."""
    if group is None or not ready:
        return ready
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:
        return ready
    flags = torch.tensor(ready, dtype=torch.uint8)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return [bool(f) for f in flags.tolist()]


def adopt(pool, group=None) -> int:
    """Collect results, install the agreed ready jobs, then apply backpressure (see
    MosaicKVPool._relieve) if free hot pages fell under the watermark. Returns pages installed."""
    client = pool.daemon
    client.collect()
    jobs = client.open_jobs()
    installed = 0
    for job, ok in zip(jobs, agree([job.ready for job in jobs], group)):
        if not ok:
            continue
        if job.error is not None:
            client.counters.sync_seals_fallback += len(job.pages)
            installed += pool._finish(job, None)
        else:
            n = pool._finish(job, job.results)
            client.counters.adopted_pages += n
            installed += n
    if client.broken:  # restarting did not help: seal what is left here (logged by the client)
        for job in client.open_jobs():
            client.cancel(job)
            client.counters.sync_seals_fallback += len(job.pages)
            installed += pool._finish(job, None)
    watermark = math.ceil(pool.cfg.daemon_hot_watermark * pool.num_hot_pages)
    pool._relieve(watermark)
    client.pump()
    return installed
