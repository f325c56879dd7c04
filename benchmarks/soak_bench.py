"""Soak and flood against a running server: many concurrent mixed requests offering a multiple
of the tokens its KV memory holds, aborts and (with the daemon) its worker killed once, then
every finished request again alone.

The workload (`make_workload`, seeded): short prompts, long prompts (8K-128K by default, clipped
to `--max-prompt`), prompts behind one of a few shared system prompts (radix reuse), and
requests aborted mid-flight (`/abort_request` by rid, at a random time), added until there are
at least `--requests` of them and they offer at least `--offer` x the tokens the server holds
(`serving_bench.token_capacity`: SGLang's slots, or MosaicKV's tokens that fit at its layout mix).
All are sent at once, greedy with `ignore_eos`. While they run, the server's MosaicKV stats are
polled: the byte deficit its admission waited on, and with `daemon: process` one worker process
is SIGKILLed once while it holds pages in flight.

Then it reports, per claim, PASS or FAIL (the JSON keeps every request's record):

* **no errors**: every request not aborted answered 200 with all its tokens; every aborted one
  ended as aborted (not run to its length);
* **same output as alone**: after `/flush_cache`, each finished request is sent again with
  nothing else running (all of them, or an even sample of `--alone N`, within `--limit-s`), its
  greedy ids compared with the loaded ones (the first differing position is recorded);
* MosaicKV only: **bytes exact** (the pool's running arena total equals its bytes re-summed
  from every kept tensor; nothing over capacity; no arena-full segment), **daemon** (killed
  once, restarted once, no worker error), **nothing leaked** (after a flush: no sealed page,
  arena byte, live block byte, outside byte or hot token left).

    python benchmarks/soak_bench.py --url http://127.0.0.1:30000 --system mosaickv_daemon \\
        --requests 500 --offer 2 --json soak.json
    # on the device, after a server's serving points: SOAK=1 bash scripts/device_serving.sh
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving_bench beside this file

from serving_bench import token_capacity  # noqa: E402

from mosaickv_sglang.launch import flush_cache, request  # noqa: E402

KINDS = ("short", "long", "shared", "abort")


@dataclass
class Job:
    index: int
    kind: str
    ids: list[int]
    max_new: int
    rid: str
    record: dict = field(default_factory=dict)


def make_workload(rng: random.Random, capacity: int, *, requests: int, offer: float,
                  vocab: int, output: int, short: tuple[int, int], long: list[int],
                  max_prompt: int, shared_prompts: int, shared_tokens: int,
                  shares: dict[str, float], abort_output: int) -> tuple[list[Job], int]:
    """Jobs until there are `requests` of them and they offer `offer` x `capacity` tokens
    (prompt + output; aborted ones count their prompt only). Returns (jobs, offered)."""
    if not 0 < sum(shares.values()) <= 1:
        raise ValueError(f"kind shares {shares} must sum to (0, 1] (short takes the rest)")
    long = [n for n in long if n <= max_prompt] or [max_prompt]
    shared_tokens = min(shared_tokens, max_prompt - 512)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    systems = [tokens(shared_tokens) for _ in range(shared_prompts)] if shared_tokens > 0 else []
    jobs, offered, target = [], 0, int(offer * capacity)
    while len(jobs) < requests or offered < target:
        u, kind = rng.random(), "short"
        for k in ("abort", "shared", "long"):
            if u < shares.get(k, 0.0):
                kind = k
                break
            u -= shares.get(k, 0.0)
        if kind == "shared" and not systems:
            kind = "short"
        if kind == "short":
            ids, n = tokens(rng.randint(*short)), output
        elif kind == "long":
            ids, n = tokens(rng.choice(long) - rng.randrange(0, 256)), output
        elif kind == "shared":
            ids, n = rng.choice(systems) + tokens(rng.randint(64, 512)), output
        else:  # aborted while it runs (or waits): a long answer it never finishes
            ids, n = tokens(rng.randint(*short)), abort_output
        i = len(jobs)
        # SGLang's /abort_request aborts every request whose rid *starts with* the one given
        # (scheduler.abort_request: `req.rid.startswith(recv_req.rid)`): fixed-width ids, so
        # aborting request 1 does not abort 10-19 too
        jobs.append(Job(i, kind, ids, n, f"soak-{os.getpid()}-{i:06d}"))
        offered += len(ids) + (0 if kind == "abort" else n)
    return jobs, offered


def generate(url: str, job: Job, timeout: float) -> dict:
    """One greedy request; the record: status, ids, finish reason, latency, error."""
    t = time.perf_counter()
    payload = {"input_ids": job.ids, "rid": job.rid,
               "sampling_params": {"temperature": 0, "max_new_tokens": job.max_new,
                                   "ignore_eos": True}}
    rec = {"prompt": len(job.ids), "max_new": job.max_new}
    try:
        status, body = request(f"{url}/generate", payload, timeout=timeout)
        rec.update(status=status, output_ids=body.get("output_ids"),
                   finish=((body.get("meta_info") or {}).get("finish_reason") or {}).get("type"),
                   cached=(body.get("meta_info") or {}).get("cached_tokens"))
    except urllib.error.HTTPError as exc:  # an aborted request may answer with an error status
        rec.update(status=exc.code, error=exc.read().decode(errors="replace")[-500:])
    except Exception as exc:  # noqa: BLE001 - recorded and reported as an error
        rec.update(status=None, error=repr(exc)[-500:])
    rec["latency_s"] = round(time.perf_counter() - t, 3)
    return rec


def first_difference(a: list[int] | None, b: list[int] | None) -> int | None:
    """The first position where two id lists differ (a length difference counts); None: equal."""
    if a == b:
        return None
    a, b = a or [], b or []
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def even_sample(items: list, n: int) -> list:
    """`n` items spread evenly over `items` (all when n <= 0 or n >= len)."""
    if n <= 0 or n >= len(items):
        return list(items)
    step = len(items) / n
    return [items[int(k * step)] for k in range(n)]


def _mosaic(url: str) -> dict | None:
    _, info = request(f"{url}/get_server_info")
    return (info.get("internal_states") or [{}])[0].get("mosaickv")


class Watcher(threading.Thread):
    """Polls the MosaicKV stats while the flood runs: the largest byte deficit admission waited
    on, the largest hot use; kills one daemon worker once while it holds pages (`kill`)."""

    def __init__(self, url: str, kill: bool, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.kill, self.stop, self.t0 = url, kill, stop, time.perf_counter()
        self.max_deficit, self.max_hot, self.killed, self.polls, self.errors = 0, 0, None, 0, 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                st = _mosaic(self.url) or {}
            except Exception:  # noqa: BLE001 - a busy server may time out a poll; counted
                self.errors += 1
                time.sleep(1)
                continue
            self.polls += 1
            cap = st.get("capacity") or {}
            self.max_deficit = max(self.max_deficit, cap.get("byte_deficit") or 0)
            self.max_hot = max(self.max_hot, st.get("hot_tokens_in_use") or 0)
            daemon = st.get("daemon") or {}
            if self.kill and self.killed is None and daemon.get("inflight_pages", 0) > 0:
                # the server's own workers (rank 0's pool), not any worker on the machine
                pids = daemon.get("worker_pids") or []
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    self.killed = {"pid": pids[0], "inflight_pages": daemon["inflight_pages"],
                                   "t_s": round(time.perf_counter() - self.t0, 1)}
            time.sleep(0.5)


def check(name: str, ok: bool, detail: str) -> dict:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return {"claim": name, "pass": bool(ok), "detail": detail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--system", default="server", help="label in the output")
    ap.add_argument("--requests", type=int, default=500, help="at least this many requests")
    ap.add_argument("--offer", type=float, default=2.0,
                    help="offer at least this multiple of the tokens the server holds")
    ap.add_argument("--capacity", type=int, default=None,
                    help="tokens the server holds (default: from /get_server_info)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="token ids are drawn below this (default: --model's vocab_size, else 32000)")
    ap.add_argument("--model", default=None,
                    help="the served model's directory: its config.json's vocab_size bounds the ids")
    ap.add_argument("--output", type=int, default=32, help="new tokens per finished request")
    ap.add_argument("--short", default="64,1024", help="short prompt lengths: MIN,MAX")
    ap.add_argument("--long", default="8192,16384,32768,65536,131072",
                    help="long prompt lengths to draw from (clipped to --max-prompt)")
    ap.add_argument("--max-prompt", type=int, default=None,
                    help="longest prompt (default: the server's context length less the output)")
    ap.add_argument("--shared-prompts", type=int, default=3)
    ap.add_argument("--shared-tokens", type=int, default=16384)
    ap.add_argument("--share-long", type=float, default=0.1)
    ap.add_argument("--share-shared", type=float, default=0.3)
    ap.add_argument("--share-abort", type=float, default=0.05)
    ap.add_argument("--abort-output", type=int, default=4096,
                    help="new tokens an aborted request asks for (it never gets them)")
    ap.add_argument("--abort-within-s", type=float, default=60.0,
                    help="aborts are sent at uniform random times in (1, this) seconds")
    ap.add_argument("--no-kill", action="store_true", help="do not kill a daemon worker")
    ap.add_argument("--alone", type=int, default=0,
                    help="requests re-run alone: an even sample of this many (0: all)")
    ap.add_argument("--limit-s", type=float, default=3600.0,
                    help="the whole run's time: the loaded phase may take it less --reserve-s "
                         "(then its claims are checked on what answered, 'load finished' "
                         "fails, and the JSON is written), the alone re-runs stop at it")
    ap.add_argument("--reserve-s", type=float, default=15.0,
                    help="time kept after a cut loaded phase for the stats and the JSON")
    ap.add_argument("--request-timeout-s", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    capacity = args.capacity or token_capacity(args.url)[0]
    if not capacity:
        raise SystemExit(f"{args.url}: the server's token capacity is unknown; pass --capacity")
    if args.max_prompt is None:
        _, info = request(f"{args.url}/get_server_info")
        if not info.get("context_length"):
            raise SystemExit(f"{args.url}: the server's context length is unknown; pass "
                             "--max-prompt")
        args.max_prompt = info["context_length"] - max(args.output, args.abort_output) - 8
    if args.model:
        model_vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
        if args.vocab is not None and args.vocab > model_vocab:
            raise SystemExit(f"--vocab {args.vocab} exceeds {args.model}'s vocab_size "
                             f"{model_vocab}: ids past it crash the server's embedding")
        args.vocab = args.vocab or model_vocab
    args.vocab = args.vocab or 32000
    lo, hi = (int(x) for x in args.short.split(","))
    jobs, offered = make_workload(
        random.Random(args.seed), capacity, requests=args.requests, offer=args.offer,
        vocab=args.vocab, output=args.output, short=(lo, hi),
        long=[int(x) for x in args.long.split(",")], max_prompt=args.max_prompt,
        shared_prompts=args.shared_prompts, shared_tokens=args.shared_tokens,
        shares={"long": args.share_long, "shared": args.share_shared, "abort": args.share_abort},
        abort_output=args.abort_output)
    kinds = {k: sum(j.kind == k for j in jobs) for k in KINDS}
    print(f"[soak {args.system}] {len(jobs)} requests {kinds}, {offered:,} tokens offered to "
          f"{capacity:,} held ({offered / capacity:.2f}x)", flush=True)
    mosaic = _mosaic(args.url) is not None
    stop = threading.Event()
    watcher = Watcher(args.url, mosaic and not args.no_kill, stop) if mosaic else None
    if watcher:
        watcher.start()
    rng = random.Random(args.seed + 1)
    aborts = sorted((rng.uniform(1, args.abort_within_s), j) for j in jobs if j.kind == "abort")

    def aborter():
        start = time.perf_counter()
        for at, job in aborts:
            time.sleep(max(0.0, at - (time.perf_counter() - start)))
            try:
                request(f"{args.url}/abort_request", {"rid": job.rid}, timeout=60)
            except Exception as exc:  # noqa: BLE001 - recorded on the job
                job.record["abort_error"] = repr(exc)[-300:]
    threading.Thread(target=aborter, daemon=True).start()

    done = [0]

    def run(job: Job) -> None:
        job.record.update(generate(args.url, job, args.request_timeout_s))
        done[0] += 1

    def progress():
        while not stop.wait(10):
            print(f"[soak {args.system}] {done[0]}/{len(jobs)} answered in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    threading.Thread(target=progress, daemon=True).start()
    t_load = time.perf_counter()
    ex = ThreadPoolExecutor(len(jobs))
    futures = [ex.submit(run, job) for job in jobs]
    wait_s = max(1.0, args.limit_s - args.reserve_s - (t_load - t0))
    _, pending = wait(futures, timeout=wait_s)
    load_s = time.perf_counter() - t_load
    stop.set()
    checks, out = [], {"system": args.system, "url": args.url, "capacity": capacity,
                       "offered": offered, "kinds": kinds, "load_s": round(load_s, 1)}
    # a loaded phase past the limit: the claims below on what answered, the rest not checked
    cut = bool(pending)
    checks.append(check("load finished", not cut,
                        f"{len(jobs) - len(pending)} of {len(jobs)} requests answered in "
                        f"{load_s:.0f} s (limit {wait_s:.0f} s)"))
    answered = [j for j in jobs if "status" in j.record or "error" in j.record]
    finished = [j for j in answered if j.kind != "abort"]
    bad = [j.index for j in finished
           if j.record.get("status") != 200 or len(j.record.get("output_ids") or []) != j.max_new]
    checks.append(check("no errors", not bad,
                        f"{len(finished) - len(bad)} of {len(finished)} finished requests answered "
                        f"with all their tokens" + (f"; failed: {bad[:10]}" if bad else "")))
    ran_out = [j.index for j in answered if j.kind == "abort"
               and j.record.get("finish") == "length"]
    checks.append(check("aborts", not ran_out,
                        f"{kinds['abort'] - len(ran_out)} of {kinds['abort']} aborted requests "
                        "ended before their length" + (f"; ran out: {ran_out}" if ran_out else "")))
    if mosaic:
        st = _mosaic(args.url)
        kept = sum(n for kind, n in st["bytes"].items() if kind != "hot_buffer_capacity")
        cap = st.get("capacity") or {}
        checks.append(check(
            "bytes exact", st["arena_bytes"] == kept and cap.get("over_capacity", 0) == 0
            and st["segment_store"]["arena_full_segments"] == 0,
            f"arena {st['arena_bytes']:,} B vs {kept:,} re-summed, over capacity "
            f"{cap.get('over_capacity')}, arena-full segments "
            f"{st['segment_store']['arena_full_segments']}, largest byte deficit waited on "
            f"{watcher.max_deficit:,} B, sealed ratio {st.get('sealed_ratio')}"))
        out["loaded_stats"] = {k: st.get(k) for k in ("sealed_ratio", "sealed_pages", "counters",
                                                      "capacity", "daemon")}
        daemon = st.get("daemon")
        if daemon is not None and not args.no_kill:
            checks.append(check(
                "daemon", watcher.killed is not None and daemon.get("restarts") == 1
                and daemon.get("worker_errors") == 0,
                f"killed {watcher.killed}, restarts {daemon.get('restarts')}, worker errors "
                f"{daemon.get('worker_errors')}"))
    # every finished request again, alone (none when the loaded phase was cut: not checked)
    alone = [] if cut else even_sample([j for j in finished if j.index not in bad], args.alone)
    equal, differ, checked = 0, [], 0
    for job in alone:
        if time.perf_counter() - t0 > args.limit_s:
            break
        flush_cache(args.url, timeout_s=300)
        rec = generate(args.url, job, args.request_timeout_s)
        first = first_difference(job.record.get("output_ids"), rec.get("output_ids"))
        job.record["alone_first_difference"] = first
        checked += 1
        if first is None:
            equal += 1
        else:
            differ.append({"index": job.index, "kind": job.kind, "first": first})
        if checked % 25 == 0:
            print(f"[soak {args.system}] alone: {equal} of {checked} equal "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    by_kind = {k: [sum(1 for j in alone[:checked] if j.kind == k and
                       j.record.get("alone_first_difference") is None),
                   sum(1 for j in alone[:checked] if j.kind == k)] for k in KINDS if k != "abort"}
    checks.append(check("same output as alone", not cut and checked == len(alone) and not differ,
                        f"{equal} of {checked} checked equal (of {len(alone)} chosen, "
                        f"{len(finished)} finished); by kind [equal, checked] {by_kind}"
                        + (f"; first differing: {differ[:8]}" if differ else "")))
    if mosaic and cut:
        checks.append(check("nothing leaked", False, "not checked: requests still running"))
    elif mosaic:
        flush_cache(args.url, timeout_s=300)
        st = _mosaic(args.url)
        left = {"sealed_pages": st["sealed_pages"], "arena_bytes": st["arena_bytes"],
                "live_block_bytes": st["segment_store"]["live_block_bytes"],
                "outside_bytes": (st.get("capacity") or {}).get("outside_bytes", 0),
                "hot_tokens_in_use": st["hot_tokens_in_use"]}
        checks.append(check("nothing leaked", not any(left.values()), f"after a flush: {left}"))
    out.update(checks=checks, alone_checked=checked, alone_equal=equal, differ=differ,
               watcher=None if watcher is None else {
                   "max_byte_deficit": watcher.max_deficit, "max_hot_tokens": watcher.max_hot,
                   "killed": watcher.killed, "polls": watcher.polls,
                   "poll_errors": watcher.errors},
               wall_s=round(time.perf_counter() - t0, 1),
               requests=[{**{k: v for k, v in asdict(j).items() if k not in ("ids", "record")},
                          **{k: v for k, v in j.record.items() if k != "output_ids"},
                          "output_len": len(j.record.get("output_ids") or [])} for j in jobs])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"[soak {args.system}] {sum(c['pass'] for c in checks)} of {len(checks)} claims pass "
          f"in {out['wall_s']} s -> {args.json}", flush=True)
    if cut:  # requests still in flight: their threads would hold the exit
        os._exit(1)
    ex.shutdown()
    sys.exit(0 if all(c["pass"] for c in checks) else 1)


if __name__ == "__main__":
    main()
