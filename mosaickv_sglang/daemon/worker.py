"""The recompression worker: a bare process (torch + the codec, no SGLang) that seals pages.

Started by `client.DaemonClient` as ``python -m mosaickv_sglang.daemon.worker '<json>'`` so it
never shares the scheduler's GIL and starts without importing SGLang. It reads jobs (slot ids and
positions; the page K/V and, for reuse jobs, the bases are in the shared-memory slots), runs the
same `codec.seal` code the synchronous path runs, writes each sealed page into its slot's result
region and sends back only offsets. A page the serving arena can hold goes out arena-ready
(`codec.arena.pack_page`: the store's own block layout), so the scheduler adopts it with a few
bulk copies; any other page goes out as its SealedPage (the per-tensor path, counted there). It
beats a heartbeat in shared memory between pages and exits when its parent scheduler is gone or
the job pipe closes.

A cold job (`cold.enabled`, `DaemonClient.submit_cold`) brings sealed pages instead, pickled
into the slots' K/V regions as the store holds them; the worker re-encodes each with the cold
candidates (`codec.cold.recompress_page`, what the scheduler thread runs without a daemon)
and sends it back arena-ready, or says "kept" when nothing got smaller.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection

import torch

from ..codec.arena import pack_page
from ..codec.cold import cold_candidates, recompress_page
from ..codec.layer import Candidates
from ..codec.seal import BasisPair, fit_bases, fit_block_bases, seal_pages, write_transforms
from ..codec.strategies import parse_strategy
from ..config import MosaicConfig
from .channel import Channel, ChannelSpec, dump, load

POLL_S = 0.5  # how often an idle worker beats and checks its parent


class Worker:
    def __init__(self, args: dict):
        self.index = args["worker"]
        self.parent = args["parent"]
        self.channel = Channel.attach(ChannelSpec(**args["channel"]))
        self.cfg = MosaicConfig.from_dict(args["config"])
        self.cands = Candidates.from_config(self.cfg)
        self.dense = parse_strategy(args["dense"])
        self.cold = cold_candidates(self.cfg) if self.cfg.cold.enabled else None
        self.jobs = Connection(args["fd_in"], writable=False)
        self.results = Connection(args["fd_out"], readable=False)

    def beat(self) -> None:
        self.channel.heartbeats[self.index] = time.monotonic()

    def serve(self) -> int:
        while True:
            self.beat()
            if os.getppid() != self.parent:
                return 0
            if not self.jobs.poll(POLL_S):
                continue
            try:
                job = self.jobs.recv()
            except EOFError:
                return 0
            if job is None:
                return 0
            try:
                self.run(job)
            except Exception:  # noqa: BLE001 - reported; the scheduler seals the job itself
                self.results.send({"id": job["id"], "error": traceback.format_exc()})

    def run(self, job: dict) -> None:
        """Seal the job's pages; one result message per page, as soon as it is done."""
        if "cold" in job:
            return self.run_cold(job)
        slots = job["slots"]

        t0 = time.perf_counter()
        if job["fit"]:
            if self.cfg.basis_fit == "first_page":  # [1, L, 2, H, S, D]: the block's first page
                kv = self.channel.kv(slots[0])[None]
                bases = fit_block_bases(kv[:, :, 0], kv[:, :, 1], self.cfg.fit_solver)
            else:  # the job's pages, [P, L, 2, H, S, D]
                kv = torch.stack([self.channel.kv(slot) for slot in slots])
                bases = fit_bases(kv[:, :, 0], kv[:, :, 1], self.cfg.fit_solver)
            del kv
        else:
            b = self.channel.bases(slots[0])
            bases = BasisPair.of(b.view(-1, *b.shape[2:]))
        write = write_transforms(bases)  # once per job, however many pages it seals
        for i, position in enumerate(job["positions"]):
            kv = self.channel.kv(slots[i])[None]  # one page at a time: each result goes out
            page = seal_pages(kv[:, :, 0], kv[:, :, 1], [position], bases, self.cfg, self.cands,
                              self.dense, write=write)[0]
            # the bases travel once (first page of a fit job); elsewhere the scheduler has them
            refs = {} if job["fit"] and i == 0 else {id(bases): "bases"}
            offset, length = dump(pack_page(page, self.cfg.page_tokens) or page,
                                  self.channel.result(slots[i]), refs)
            t1 = time.perf_counter()
            self.results.send({"id": job["id"], "index": i, "offset": offset, "length": length,
                               "seconds": t1 - t0})
            t0 = t1
            self.beat()


    def run_cold(self, job: dict) -> None:
        """Re-encode sealed pages with the cold candidates, as `MosaicKVPool._recompress_page`
        does on the scheduler thread (the same `recompress_page`): each page comes pickled in
        its slot's K/V region; it goes back arena-ready (no bases: the pool keeps the page's),
        or as "kept" when no layer's K or V got smaller."""
        if self.cold is None:
            raise RuntimeError("a cold job came, but this worker's config has cold.enabled off")
        t0 = time.perf_counter()
        for i, (slot, (offset, length)) in enumerate(zip(job["slots"], job["cold"])):
            page = load(self.channel.kv(slot).view(-1).view(torch.uint8), offset, length)
            segs = page.segments() if hasattr(page, "specs") else page.segments
            fresh = recompress_page(page.position, segs, None, self.cfg, *self.cold)
            msg = {"id": job["id"], "index": i}
            if fresh is None:
                msg["kept"] = True
            else:
                msg["offset"], msg["length"] = dump(
                    pack_page(fresh, self.cfg.page_tokens) or fresh, self.channel.result(slot))
            t1 = time.perf_counter()
            msg["seconds"] = t1 - t0
            t0 = t1
            self.results.send(msg)
            self.beat()


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    os.nice(MosaicConfig.from_dict(args["config"]).daemon_nice)  # idle cores only (config.py)
    torch.set_num_threads(args["threads"])
    return Worker(args).serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
