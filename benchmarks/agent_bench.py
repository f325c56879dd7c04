"""Multi-turn agent benchmark: N sessions x T turns over a shared system prompt, dense vs MosaicKV.

Per system a real server starts (one at a time, same model and settings; or `--url` attaches to a
running one). The system prompt is S tokens of random vocabulary words; each turn of a session
sends system prompt + the session's history (earlier user messages and answers) + a new user
message of U words, greedy, O output tokens, all N sessions concurrently. Two workloads:

* ``native``: token ids through `/generate`, streamed (TTFT and inter-token latency client-side);
  the system prompt is prefilled once first (`max_new_tokens` 0), as the frontend does;
* ``dsl``: the same shape as an SGLang frontend program (`sgl.function`: the system prompt, then
  T `User:`/`Assistant:` turns with `sgl.gen`), `run_batch` over the sessions; the frontend
  caches the traced common prefix itself before the batch.

Reported per (system, workload): wall time, output tokens/s overall and per turn, TTFT/ITL
percentiles (native), cached-token ratio (SGLang's `cached_tokens` over prompt tokens), memory
(tokens the pool holds, from `/v1/loads`; bytes: dense rows, or MosaicKV's packed bytes + hot
rows) and, for MosaicKV, the pool's per-position counters over the prefix pages: one seal per
position = the shared prefix was compressed once; reuses per position = requests that read it
from the radix tree. JSON after every run; a table last.

    python benchmarks/agent_bench.py --make-llama8b /tmp/llama8b --tokenizer TOK \\
        --load-format dummy --sessions 32 --turns 8 --system-tokens 16384 --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

from serving_bench import (add_server_args, make_llama8b, percentile, save, stream_one,
                           system_args)

from mosaickv_sglang.launch import flush_cache, request, running_server  # noqa: E402 (path set)


def word_ids(tokenizer_dir: Path) -> list[int]:
    """Ids of single-token lowercase words with a leading space: any sequence of them decodes
    to text that tokenizes back to the same ids, so both workloads see the same token counts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = [i for t, i in tok.get_vocab().items()
           if len(t) > 3 and t[0] == "\u0120" and t[1:].isascii() and t[1:].isalpha()
           and t[1:].islower()]
    if len(ids) < 1000:
        raise SystemExit(f"{tokenizer_dir}: only {len(ids)} 'Ġword' tokens; the workload needs "
                         "a byte-level BPE tokenizer (GPT-2/Llama-3 style)")
    return sorted(ids)


class Workload:
    """The token ids of every system prompt and user message (same for every system)."""

    def __init__(self, words: list[int], sessions: int, turns: int, system_tokens: int,
                 user_tokens: int, output: int, seed: int):
        rng = random.Random(seed)
        self.system = [rng.choice(words) for _ in range(system_tokens)]
        self.users = [[[rng.choice(words) for _ in range(user_tokens)] for _ in range(turns)]
                      for _ in range(sessions)]
        self.sessions, self.turns, self.output = sessions, turns, output


def run_native(url: str, w: Workload) -> tuple[list[dict], float]:
    """All sessions concurrently, each turn streamed; returns one record per request."""
    t0 = time.perf_counter()
    request(f"{url}/generate", {"input_ids": w.system, "sampling_params": {"max_new_tokens": 0}})
    warm_s = time.perf_counter() - t0
    recs: list[dict] = []
    lock = threading.Lock()

    def session(i: int) -> None:
        history = list(w.system)
        for t, user in enumerate(w.users[i]):
            rec = {"session": i, "turn": t}
            history += user
            stream_one(url, history, w.output, rec)
            history += rec["output_ids"]
            with lock:
                recs.append(rec)
                if len(recs) % w.sessions == 0:
                    print(f"  {len(recs)}/{w.sessions * w.turns} turns", flush=True)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(w.sessions)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if len(recs) != w.sessions * w.turns:
        raise RuntimeError(f"{w.sessions * w.turns - len(recs)} requests failed (see above)")
    return recs, warm_s


def run_dsl(url: str, w: Workload, tokenizer_dir: Path) -> tuple[list[dict], None]:
    """The workload as an `sgl.function` program, `run_batch` over the sessions."""
    import sglang as sgl
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    system = tok.decode(w.system)
    users = [[tok.decode(u) for u in s] for s in w.users]

    @sgl.function
    def session(s, turns):
        s += system  # a constant of the program: the frontend's tracing finds and caches it
        for t, user in enumerate(turns):
            s += "\nUser:" + user + "\nAssistant:"
            s += sgl.gen(f"answer_{t}", max_tokens=w.output, temperature=0, ignore_eos=True)

    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    states = session.run_batch([{"turns": u} for u in users], num_threads=w.sessions)
    recs = []
    for i, st in enumerate(states):
        for t in range(w.turns):
            meta = st.get_meta_info(f"answer_{t}")
            if meta is None:
                raise RuntimeError(f"DSL session {i} turn {t} has no result: {st.error()!r}")
            recs.append({"session": i, "turn": t, "meta": meta})
    return recs, None  # the frontend caches the prefix itself, inside run_batch


def summarize(recs: list[dict], wall_s: float, prefix_tokens: int) -> dict:
    """Throughput, cached-token ratio, latencies: overall and per turn. Streamed requests give
    TTFT/ITL and a turn's span (first request sent -> last token); DSL requests the server's
    end-to-end latency only."""
    def stats(rs: list[dict]) -> dict:
        prompt = sum(r["meta"]["prompt_tokens"] for r in rs)
        cached = sum(r["meta"]["cached_tokens"] for r in rs)
        e2e = [r["stamps"][-1] if "stamps" in r else r["meta"]["e2e_latency"] for r in rs]
        out = sum(r["meta"]["completion_tokens"] for r in rs)
        row = {"requests": len(rs), "output_tokens": out, "prompt_tokens": prompt,
               "cached_tokens": cached, "cached_ratio": cached / prompt,
               "requests_with_prefix_cached": sum(r["meta"]["cached_tokens"] >= prefix_tokens
                                                  for r in rs),
               **{f"e2e_s_p{q}": percentile(e2e, q / 100) for q in (50, 99)}}
        if all("stamps" in r for r in rs):
            ttft = [r["stamps"][0] for r in rs]
            gaps = [b - a for r in rs for a, b in zip(r["stamps"], r["stamps"][1:])]
            row.update({f"ttft_s_p{q}": percentile(ttft, q / 100) for q in (50, 90, 99)})
            if gaps:
                row.update({f"itl_ms_p{q}": 1e3 * percentile(gaps, q / 100)
                            for q in (50, 90, 99)})
        return row

    total = {**stats(recs), "wall_s": wall_s}
    total["output_tok_s"] = total["output_tokens"] / wall_s
    per_turn = []
    for t in sorted({r["turn"] for r in recs}):
        rs = [r for r in recs if r["turn"] == t]
        row = {"turn": t, **stats(rs)}
        if all("start" in r for r in rs):
            span = max(r["start"] + r["stamps"][-1] for r in rs) - min(r["start"] for r in rs)
            row.update(span_s=span, output_tok_s=row["output_tokens"] / span)
        per_turn.append(row)
    return {**total, "per_turn": per_turn}


class PeakLoad:
    """Polls /v1/loads while a workload runs: the most tokens running requests held at once
    (SGLang counts a shared prefix once; idle cached tokens are evictable, not counted). None
    when no poll saw a running request: on an idle CPU a short workload's requests can all fall
    between polls (CI once read 0 for dense's native run with 0.5 s polls), and 0 would read as
    a measurement. Polls every 0.1 s: each one is a request the scheduler answers."""

    def __init__(self, url: str, every_s: float = 0.1):
        self.url, self.every_s, self.peak = url, every_s, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            _, loads = request(f"{self.url}/v1/loads", timeout=60)
            rows = loads["loads"] if isinstance(loads, dict) else loads
            used = sum(r["num_used_tokens"] for r in rows)
            if used:
                self.peak = max(self.peak or 0, used)
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


def server_state(url: str) -> dict:
    _, info = request(f"{url}/get_server_info")
    states = info["internal_states"][0]
    return {"mosaickv": states.get("mosaickv"), "memory": states.get("memory_usage", {}),
            "page_size": states.get("page_size")}


def prefix_counters(before: dict, after: dict, prefix_pages: int, sessions: int) -> dict:
    """What the run added to the pool's per-position counters over the shared prefix's pages."""
    def delta(key: str) -> list[int]:
        a, b = before["counters"][key], after["counters"][key]
        return [(b[i] if i < len(b) else 0) - (a[i] if i < len(a) else 0)
                for i in range(prefix_pages)]

    seals, reuses = delta("sealed_by_position"), delta("reused_by_position")
    return {"prefix_pages": prefix_pages, "prefix_seals": sum(seals),
            "prefix_sealed_once": prefix_pages > 0 and all(s == 1 for s in seals),
            "prefix_reuse_min": min(reuses, default=0),
            "prefix_pages_reused_by_every_session": sum(r >= sessions for r in reuses),
            "sealed_pages": after["counters"]["sealed_pages"] - before["counters"]["sealed_pages"],
            "reused_pages": after["counters"]["reused_pages"] - before["counters"]["reused_pages"],
            "seals_by_prefix_position": seals, "reuses_by_prefix_position": reuses}


def run_workload(url: str, system: str, kind: str, w: Workload, tokenizer_dir: Path,
                 dense_bytes_per_token: int) -> dict:
    flush_cache(url)  # each workload starts from an empty tree (counters are cumulative: deltas)
    before = server_state(url)
    page = before["page_size"] or 1
    t0 = time.perf_counter()
    with PeakLoad(url) as load:
        if kind == "native":
            recs, warm_s = run_native(url, w)
        elif kind == "dsl":
            recs, warm_s = run_dsl(url, w, tokenizer_dir)
        else:
            raise SystemExit(f"unknown workload {kind!r}: use native, dsl")
    wall_s = time.perf_counter() - t0  # with the system prompt's prefill, like the DSL's
    after = server_state(url)
    # word ids re-tokenize to themselves (word_ids): the DSL's prefix has the same length
    prefix_pages = len(w.system) // page
    row = {"system": system, "workload": kind, "sessions": w.sessions, "turns": w.turns,
           "system_tokens": len(w.system), "user_tokens": len(w.users[0][0]),
           "output": w.output, "warm_s": warm_s,
           **summarize(recs, wall_s, prefix_pages * page)}
    mk = after["mosaickv"]
    row["memory"] = {"peak_used_tokens": load.peak,
                     "token_capacity": after["memory"].get("token_capacity"),
                     "kv_cache_gb": after["memory"].get("kvcache"),
                     "dense_bytes_per_token": dense_bytes_per_token,
                     "dense_bytes_at_peak": None if load.peak is None
                     else load.peak * dense_bytes_per_token}
    if mk is not None:  # everything the tree still holds at the end, as stored
        row["memory"].update(packed_bytes=mk["arena_bytes"], sealed_tokens=mk["sealed_tokens"],
                             hot_tokens_in_use=mk["hot_tokens_in_use"],
                             sealed_bytes_per_token=mk["sealed_bytes_per_token"],
                             sealed_ratio=mk["sealed_ratio"])
        row["mosaickv"] = prefix_counters(before["mosaickv"], mk, prefix_pages, w.sessions)
    return row


def dense_bytes(model: Path) -> int:
    """bf16 K+V bytes per token of the model (what a dense cache keeps)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) \
        * head_dim * 2


def print_table(results: list[dict]) -> None:
    print(f"\n{'system':<10}{'workload':<9}{'wall s':>7}{'out tok/s':>10}{'cached':>7}"
          f"{'TTFT p50':>9}{'ITL p50':>8}{'ITL p99':>8}{'peak tok':>9}{'packed MB':>10}"
          f"{'prefix pg':>10}{'seals':>6}{'reuse min':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['system']:<10}{r.get('workload', ''):<9} ERROR {r['error'][:100]}")
            continue
        mk, mem = r.get("mosaickv") or {}, r["memory"]
        packed = f"{mem['packed_bytes'] / 1e6:.1f}" if "packed_bytes" in mem else "-"
        print(f"{r['system']:<10}{r['workload']:<9}{r['wall_s']:>7.1f}{r['output_tok_s']:>10.1f}"
              f"{r['cached_ratio']:>7.3f}{r.get('ttft_s_p50', float('nan')):>9.2f}"
              f"{r.get('itl_ms_p50', float('nan')):>8.1f}{r.get('itl_ms_p99', float('nan')):>8.1f}"
              f"{mem['peak_used_tokens'] or '-':>9}{packed:>10}{mk.get('prefix_pages', '-'):>10}"
              f"{mk.get('prefix_seals', '-'):>6}{mk.get('prefix_reuse_min', '-'):>10}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--make-llama8b", type=Path, help="write a Llama-3.1-8B-shaped config here")
    ap.add_argument("--tokenizer", type=Path, help="default: the model's")
    ap.add_argument("--url", help="attach to this running server (one system in --systems)")
    ap.add_argument("--systems", default="dense,mosaickv")
    ap.add_argument("--workloads", default="native,dsl")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=16384)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    add_server_args(ap)
    ap.add_argument("--logs", type=Path, default=Path("agent_logs"))
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    # a time limit (`timeout`'s SIGTERM) unwinds like an error: servers stopped, JSON kept
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("agent_bench: SIGTERM, stopping"))
    systems, workloads = args.systems.split(","), args.workloads.split(",")
    if args.url and len(systems) != 1:
        raise SystemExit("--url attaches to one server: name its system with --systems")
    context = args.system_tokens + args.turns * (args.user_tokens + args.output + 8) + 256
    model = args.model
    if args.make_llama8b:
        model = make_llama8b(args.make_llama8b, args.tokenizer, context + 1024)
    tokenizer = args.tokenizer or model
    w = Workload(word_ids(tokenizer), args.sessions, args.turns, args.system_tokens,
                 args.user_tokens, args.output, args.seed)
    per_token = dense_bytes(model)
    args.logs.mkdir(parents=True, exist_ok=True)
    common = ["--load-format", args.load_format, "--context-length", str(context),
              "--chunked-prefill-size", str(-(-context // 128) * 128),  # as serving_bench
              "--max-running-requests", str(args.sessions), "--grammar-backend", "none",
              *args.server_arg]
    results = []
    for system in systems:
        extra = system_args(system, args.dense_backend, args.mosaickv_config)
        t = time.perf_counter()
        try:
            if args.url:
                server = _attached(args.url)
            else:
                server = running_server(model, args.logs / f"{system}.log", *extra, *common,
                                        startup_s=900)
            with server as srv:
                print(f"[{system}] up in {time.perf_counter() - t:.0f} s", flush=True)
                for kind in workloads:
                    print(f"[{system}] {kind}: {args.sessions} sessions x {args.turns} turns "
                          f"over a {args.system_tokens}-token system prompt", flush=True)
                    row = run_workload(srv.url, system, kind, w, tokenizer, per_token)
                    results.append(row)
                    save(args.json, results)  # partial results survive a time limit
                    print(f"[{system}] {kind}: {row['wall_s']:.1f} s, "
                          f"{row['output_tok_s']:.1f} out tok/s, cached "
                          f"{row['cached_ratio']:.3f}", flush=True)
        except Exception as exc:  # reported, never dropped: the other systems still run
            results.append({"system": system, "error": repr(exc)[-2000:]})
            print(f"[{system}] FAILED: {exc!r}"[-2000:], flush=True)
    save(args.json, results)
    print_table(results)


class _attached:
    """`--url`: a server someone else runs (left running)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def __enter__(self):
        with urllib.request.urlopen(f"{self.url}/health", timeout=30):
            return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
