"""Tensor parallelism (issue 8) on a 2-GPU box: correctness with the daemon on, then the 128K
decode point at TP=2, dense vs MosaicKV. Every server starts at once (start-up dominates a short
run); the small ones stop once checked, before anything is timed.

1. Correctness: greedy ids of MosaicKV with the lossless config (dense fp32 candidates, no
   selection) and ``daemon: process``, TP=2 vs TP=1, plus dense SGLang (torch_native) at TP=1 and
   TP=2 as controls (does SGLang's own TP change the ids?); then the two ranks' swap lines
   (daemon/swaplog.py) compared. The model runs in bf16 on a GPU (``--check-dtype``): SGLang's
   CUDA RMSNorm (sgl_kernel) has no fp32 kernel, and an fp32 server dies on its first forward.
   In bf16 greedy ids can part on near-ties (dense SGLang's own TP=2 and TP=1 do), so each
   comparison also reports where they part: the top-2 logprob gap there and the largest logprob
   difference before (`divergence`). The model has the Llama-3.1-8B attention shape (32 q / 8
   KV heads, head_dim 128, hidden 4096) with 4 layers and *saved* random weights: ``--load-format dummy`` cannot be compared across TP sizes, SGLang
   seeds each rank's weight shard alike (the values depend only on the shard's size), so TP=1
   and TP=2 would be different models.
2. The 128K point: the Llama-3.1-8B-shaped dummy model, TP=2, through serving_bench.measure, in
   the order dense b1, MosaicKV b1, then the larger batches while time is left (``--deadline-s``).

Writes tp2.json after each step (partial results survive a time limit) and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.serving_bench import make_llama8b, measure, print_table, system_args  # noqa: E402
from mosaickv_sglang.daemon.swaplog import compare  # noqa: E402
from mosaickv_sglang.launch import mosaickv_stats, request, running_server  # noqa: E402

# A greedy choice whose top-2 logprob gap is below this (nats) is a near-tie: bf16 rounding that
# differs between TP sizes (all-reduce order) can flip it without any cache fault.
NEAR_TIE = 0.05
LOSSLESS_DAEMON = {"k_candidates": ["dense:val=fp32"], "v_candidates": ["dense:val=fp32"],
                   "sink_candidates": [], "hot_tokens": 0, "select": {"enabled": False},
                   "hot_buffer_fraction": 0.5, "decode_kernel": "reference",
                   "daemon": "process", "daemon_workers": 2, "daemon_queue_segments": 32}


class Background:
    """`running_server` in a thread, so that several servers start at the same time."""

    def __init__(self, name: str, model: Path, log: Path, *args: str, startup_s: float):
        self.name, self.log = name, log
        self.url = self.error = self.startup_s = None
        self._up, self._stop = threading.Event(), threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(model, args, startup_s),
                                        daemon=True)
        self._thread.start()

    def _run(self, model, args, startup_s):
        try:
            with running_server(model, self.log, *args, startup_s=startup_s) as srv:
                self.url, self.startup_s = srv.url, time.perf_counter() - self._t0
                print(f"[{self.name}] up in {self.startup_s:.0f} s", flush=True)
                self._up.set()
                self._stop.wait()
        except Exception as exc:  # handed to wait(): the caller decides
            self.error = repr(exc)[-3000:]
            self._up.set()

    def wait(self) -> str:
        self._up.wait()
        if self.error is not None:
            raise RuntimeError(f"{self.name}: {self.error}")
        return self.url

    def stop(self, wait: bool = True) -> None:
        self._stop.set()
        if wait:
            self._thread.join(timeout=90)


def make_check_model(out: Path, tokenizer: Path, layers: int) -> Path:
    """The Llama-3.1-8B config cut to `layers` layers (MLP 1024 wide), saved with random bf16
    weights (seed 0, initializer range 0.02: peaked logits, no greedy near-ties)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    make_llama8b(out, tokenizer, 4096)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, intermediate_size=1024, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # ~1 min on 2 CPU cores
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def greedy(url: str, ids: list[int], n: int) -> Run:
    """Greedy output ids and, per position, the two most likely (logprob, id)."""
    payload = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
               "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    out = request(f"{url}/generate", payload, timeout=600)[1]
    top2 = [[(float(e[0]), int(e[1])) for e in pos[:2]]
            for pos in out["meta_info"]["output_top_logprobs"]]
    return Run(out["output_ids"], top2)


class Run(list):
    """Output ids (the list itself) with `top2`: per position [(logprob, id)] x 2."""

    def __init__(self, ids: list[int], top2: list):
        super().__init__(ids)
        self.top2 = top2


def divergence(a: list[Run], b: list[Run], near_tie: float = NEAR_TIE) -> dict:
    """How two runs' greedy outputs part: for each request that differs, the top-2 logprob gap
    of both runs at the first differing token (a small gap: a near-tie that rounding can flip),
    and over the tokens before it the largest difference of the chosen tokens' logprobs."""
    gaps, drift = [], 0.0
    for x, y in zip(a, b):
        m = min(len(x), len(y))  # over the tokens both have
        n = first_mismatch(x[:m], y[:m])
        same = n if n is not None else m
        drift = max([drift] + [abs(x.top2[i][0][0] - y.top2[i][0][0]) for i in range(same)])
        if n is not None:
            gaps.append(min(r.top2[n][0][0] - r.top2[n][1][0] for r in (x, y)))
    return {"differing_requests": len(gaps), "top2_gap_at_divergence": [round(g, 5) for g in gaps],
            "max_logprob_diff_before": round(drift, 5),
            "only_near_ties": all(g < near_tie for g in gaps)}


def outputs(url: str, jobs: list[tuple[list[int], int]]) -> list[Run]:
    """Sequential requests, then the same jobs again all at once (batched decode steps)."""
    seq = [greedy(url, ids, n) for ids, n in jobs]
    conc: list = [None] * len(jobs)
    errors: list[str] = []

    def go(i):
        try:
            conc[i] = greedy(url, *jobs[i])
        except Exception as exc:  # raised below: a missing output must not compare equal
            errors.append(f"request {i}: {exc!r}")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return seq + conc


def first_mismatch(x: list[int], y: list[int]) -> int | None:
    """The first token position where two outputs differ (one ending early counts), or None."""
    if x == y:
        return None
    return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))


def first_diff(a: list[list[int]], b: list[list[int]]):
    """None when equal, else (request, token position) of the first difference."""
    for r, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return r, first_mismatch(x, y)
    return None if len(a) == len(b) else (min(len(a), len(b)), 0)


def check(servers: dict, vocab: int) -> dict:
    rng = random.Random(0)
    jobs = [([rng.randrange(100, vocab) for _ in range(n)], 40) for n in (300, 700, 1500, 260)]
    got, res = {}, {}
    for name in ("mk_tp1", "mk_tp2", "dense_tp1", "dense_tp2"):
        try:
            got[name] = outputs(servers[name].wait(), jobs)
        except Exception as exc:  # reported; the other comparisons still count
            res[f"{name}_error"] = repr(exc)[-2000:]
    for a, b, key in (("mk_tp2", "mk_tp1", "tp2_equals_tp1"),
                      ("mk_tp2", "dense_tp2", "tp2_equals_dense_tp2"),
                      ("mk_tp1", "dense_tp1", "tp1_equals_dense_tp1"),
                      ("dense_tp2", "dense_tp1", "dense_tp2_equals_dense_tp1")):
        if a in got and b in got:
            res[key] = got[a] == got[b]
            res[f"first_diff_{key}"] = first_diff(got[a], got[b])
            res[f"divergence_{key}"] = divergence(got[a], got[b])
    res["requests"] = 2 * len(jobs)
    if "mk_tp2" in got:
        daemon = mosaickv_stats(servers["mk_tp2"].url)["daemon"]
        res["swap_logs_agree"], res["swap_report"] = compare(
            servers["mk_tp2"].log.read_text(errors="replace"))
        res["rank0_daemon"] = {k: daemon[k] for k in (
            "adopted_pages", "submitted_pages", "sync_seals_backpressure", "sync_seals_fallback",
            "worker_errors", "discarded_pages", "swaps")}
    print("[check]", json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tp2"))
    ap.add_argument("--out", type=Path, required=True, help="folder for tp2.json and the logs")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--dense-batches", default="1,4")
    ap.add_argument("--mosaickv-batches", default="1",
                    help="1: sealing a 128K prompt takes ~100 s at ~3 ms per (page, layer)")
    ap.add_argument("--check-layers", type=int, default=4)
    ap.add_argument("--check-only", action="store_true", help="skip the 128K servers")
    ap.add_argument("--check-dtype", default="bfloat16",
                    help="dtype of the check servers (float32 works on a CPU, not on CUDA)")
    ap.add_argument("--deadline-s", type=float, default=360,
                    help="start no serving point after this many seconds")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    big = make_llama8b(args.work / "llama8b", args.tokenizer, args.context + 1024)  # config only
    small = make_check_model(args.work / "check", args.tokenizer, args.check_layers)
    vocab = json.loads((big / "config.json").read_text())["vocab_size"]
    print(f"models written in {time.perf_counter() - t0:.0f} s", flush=True)
    dense_b, mosaic_b = ([int(b) for b in s.split(",")] for s in (args.dense_batches,
                                                                  args.mosaickv_batches))
    # Every server is capped by --max-total-tokens so that they fit the GPUs together; the
    # fraction only bounds each one's profiling (weights + pool + graphs).
    common = ["--grammar-backend", "none", "--mem-fraction-static", "0.85"]
    check_args = [*common, "--dtype", args.check_dtype, "--context-length", "4096",
                  "--max-total-tokens", "32768"]
    span = args.context + 1024
    bench_args = [*common, "--load-format", "dummy", "--tp", "2", "--context-length", str(span),
                  "--chunked-prefill-size", str(-(-args.context // 128) * 128)]
    specs = {
        "mk_tp1": (small, "--kv-backend", "mosaickv", "--mosaickv-config",
                   json.dumps(LOSSLESS_DAEMON), *check_args),
        "mk_tp2": (small, "--tp", "2", "--kv-backend", "mosaickv", "--mosaickv-config",
                   json.dumps(LOSSLESS_DAEMON), *check_args),
        # the controls use torch SDPA like MosaicKV's prefill and fp32 reference decode
        "dense_tp1": (small, *system_args("dense", "torch_native"), *check_args),
        "dense_tp2": (small, "--tp", "2", *system_args("dense", "torch_native"),
                      *check_args),
        # CUDA graphs only for the batch sizes measured (capture is most of a dense start-up)
        "dense": (big, *system_args("dense", "triton"), *bench_args,
                  "--max-running-requests", str(max(dense_b)),
                  "--max-total-tokens", str(max(dense_b) * span),
                  "--cuda-graph-bs", *map(str, sorted(set(dense_b)))),
        # the hot buffer (1/4 of the logical slots by default) must hold a whole 128K prefill
        "mosaickv": (big, *system_args("mosaickv", "triton"), *bench_args,
                     "--max-running-requests", str(max(mosaic_b)),
                     "--max-total-tokens", str(max(6, 3 * max(mosaic_b)) * span)),
    }
    if args.check_only:
        del specs["dense"], specs["mosaickv"]
    servers = {name: Background(name, model, logs / f"{name}.log", *a, startup_s=420)
               for name, (model, *a) in specs.items()}
    result = {"startup_s": {}, "check": None, "serving": []}
    path = args.out / "tp2.json"
    try:
        try:
            result["check"] = check(servers, vocab)
        except Exception as exc:  # reported; the serving points still run
            result["check"] = {"error": repr(exc)[-3000:]}
            print(f"[check] FAILED: {exc!r}"[-3000:], flush=True)
        checked = [servers[name] for name in ("mk_tp1", "mk_tp2", "dense_tp1", "dense_tp2")]
        for s in checked:
            s.stop(wait=False)
        for s in checked:
            s.stop()
        path.write_text(json.dumps(result, indent=1))
        points = [("dense", 1), ("mosaickv", 1)] + [("dense", b) for b in dense_b if b != 1] \
            + [("mosaickv", b) for b in mosaic_b if b != 1]
        for system, b in points if not args.check_only else ():
            if time.perf_counter() - t0 > args.deadline_s:
                result["serving"].append({"system": system, "batch": b,
                                          "error": f"skipped: past --deadline-s {args.deadline_s}"})
                continue
            try:
                url = servers[system].wait()
                result["serving"].append(measure(url, f"{system}-tp2", args.context, b,
                                                 args.output, vocab))
            except Exception as exc:  # reported, never dropped
                result["serving"].append({"system": system, "batch": b,
                                          "error": repr(exc)[-2000:]})
                print(f"[{system}] b{b} FAILED: {exc!r}"[-2000:], flush=True)
            path.write_text(json.dumps(result, indent=1))
    finally:  # also on SIGTERM (the script's timeout): no server outlives the run
        for s in servers.values():
            result["startup_s"][s.name] = s.startup_s
            s.stop(wait=False)
        for s in servers.values():
            s.stop()
        path.write_text(json.dumps(result, indent=1))
    c = result["check"] or {}
    print(f"\ncheck: tp2==tp1 {c.get('tp2_equals_tp1')}, tp2==dense_tp2 "
          f"{c.get('tp2_equals_dense_tp2')}, tp1==dense_tp1 {c.get('tp1_equals_dense_tp1')}, "
          f"dense tp2==tp1 {c.get('dense_tp2_equals_dense_tp1')}, "
          f"swap logs agree {c.get('swap_logs_agree')} "
          f"({c.get('swap_report') or c.get('error', '')[:200]})")
    print("start-up s:", {k: v if v is None else round(v) for k, v in result["startup_s"].items()})
    print_table(result["serving"])


if __name__ == "__main__":
    main()
