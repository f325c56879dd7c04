"""Serving benchmark: dense SGLang vs MosaicKV servers, side by side in one run.

For each system a real server starts (one at a time, same model and settings), then for each
batch size B, B long prompts (distinct random ids) are streamed concurrently with greedy decoding
and a fixed output length. By default a point runs in two phases: the B prompts are prefilled
together (one output token each: TTFT at batch B), then sent again with the output length, so
that the prefixes come from the radix cache and all B requests decode at once (a MosaicKV prefill
of 19 x 32K prompts took 100 s: with a 128-token output the first requests had finished before
the last began, and the "batch 19" point decoded at ~6 requests on average);
`--concurrent-prefill` sends each prompt once, prefill and decode interleaved. Reported per
(system, context, batch): TTFT, decode throughput over the steady window (from the last request's
first token to the first request's last: every request decoding; None, with `decode_note`, when
that window has fewer than MIN_STEADY_STEPS steps), the end-to-end output rate, inter-token
latency p50/p99 (client-side stream arrival gaps), the tokens the server's KV memory holds
(`token_capacity`: SGLang's `max_total_num_tokens`; for MosaicKV, whose slots are an upper bound,
`stats()["capacity"]["tokens_that_fit"]` at the layout mix sealed so far) and, for MosaicKV, the
pool's physical bytes. Prints a table last and
writes JSON.

    python benchmarks/serving_bench.py --model DIR --load-format dummy --contexts 32768 \\
        --batches 1,8 --output 64 --json OUT.json

`--make-llama8b DIR --tokenizer TOKDIR` writes a Llama-3.1-8B-shaped config (32 layers, 32/8
heads, head_dim 128; vocabulary of the tokenizer) for `--load-format dummy`.

Systems (`--systems`): `dense` / `fp8` (SGLang's cache, bf16 / fp8_e4m3, attention backend
`--dense-backend`), `dense_flashinfer` / `fp8_flashinfer` (the same with FlashInfer, so both of
SGLang's GPU backends can be served in one run), `dense_eager` (no CUDA graphs), `mosaickv`
(the default config: on CUDA `decode_cuda_graph: auto` is the full decode graph), `mosaickv_eager`
(`decode_cuda_graph: off`: every decode step eager), `mosaickv_graph` (MosaicKV with
`decode_cuda_graph: breakable`), `mosaickv_full` (with `decode_cuda_graph: full`: the whole
decode step in SGLang's CUDA graph) and `mosaickv_daemon` (MosaicKV
with `daemon: process`: pages sealed by the recompression daemon's workers and swapped in at
step boundaries; its rows carry the daemon's counters), `mosaickv_flashinfer_prefill`
(`prefill_attention: flashinfer`: a prefill chunk's attention through FlashInfer's kernel, which
the default `auto` picks on CUDA) and `mosaickv_sdpa_prefill` (`prefill_attention: sdpa`: torch
SDPA instead).
"""
from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
import hashlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mosaickv_sglang.launch import request, running_server, stop_servers_on_signals  # noqa: E402


# Dense servers keep decode CUDA graphs but not SGLang 0.5.17's prefill (piecewise) graphs: their
# capture walks every token count up to the chunked-prefill size, ~40 s each at 128K on an H200
# (298 sizes: a start-up of hours); a long prefill is compute bound, so TTFT barely depends on it.
NO_PREFILL_GRAPHS = ["--disable-prefill-cuda-graph"]
PAGE_MARGIN = 256  # tokens per request kept aside when sizing the largest batch (page rounding)
# Share of an *estimated* capacity (MosaicKV's tokens_that_fit at the layout mix sealed so far)
# kept aside when sizing the largest batch. Measured (H100, 2026-12-05): the estimate was 653,184
# tokens after one 32K prompt and 605,184 after 19, so a batch of 19 sized on the first did not
# fit: 17 of 19 prompts were evicted between the prefill and the decode phase.
ESTIMATE_MARGIN = 0.10
# Once a largest batch sized on an estimate has run (its own prompts sealed: the estimate is now
# of this context's layout mix), a larger batch that the estimate then holds with this margin is
# run too, and is the largest batch if every one of its prompts stayed cached. Measured (H100,
# 2026-12-06): 17 sized at 32K with the 10% margin, 621,824 tokens held after it: 18 would fit.
GROW_MARGIN = 0.02
SYSTEMS = {  # name -> what it adds to the common server arguments
    "dense": NO_PREFILL_GRAPHS,  # SGLang's own cache, decode CUDA graphs on
    "dense_eager": ["--disable-cuda-graph"],  # the same without CUDA graphs (as MosaicKV runs)
    "fp8": ["--kv-cache-dtype", "fp8_e4m3", *NO_PREFILL_GRAPHS],  # SGLang's built-in FP8 cache
}
# MosaicKV systems: the config each one merges over --mosaickv-config
MOSAICKV_SYSTEMS = {"mosaickv": {}, "mosaickv_eager": {"decode_cuda_graph": "off"},
                    "mosaickv_graph": {"decode_cuda_graph": "breakable"},
                    "mosaickv_full": {"decode_cuda_graph": "full"},
                    "mosaickv_daemon": {"daemon": "process"},
                    "mosaickv_flashinfer_prefill": {"prefill_attention": "flashinfer"},
                    "mosaickv_sdpa_prefill": {"prefill_attention": "sdpa"},
                    # the decode graph's stage-1 products, named (`graph_products`)
                    "mosaickv_exact": {"graph_products": "exact"},
                    "mosaickv_bf16": {"graph_products": "bf16"},
                    # the default before 2026-12-07 (the chunk read rule, budgets 0.08 / 0.12, no
                    # second stage): what every speed number before that date measured
                    "mosaickv_former": {"preset": "former_default"}}
# The same dense/FP8 caches with FlashInfer's attention instead of --dense-backend, so both of
# SGLang's GPU backends can be served side by side in one run.
SYSTEMS.update({f"{name}_flashinfer": [*SYSTEMS[name], "--attention-backend", "flashinfer"]
                for name in ("dense", "fp8")})


def system_args(system: str, dense_backend: str, mosaickv_config: str | None = None) -> list[str]:
    """A system's server arguments; MosaicKV systems get --mosaickv-config (the given JSON with
    the system's own keys over it)."""
    if system in MOSAICKV_SYSTEMS:
        config = {**json.loads(mosaickv_config or "{}"), **MOSAICKV_SYSTEMS[system]}
        return ["--kv-backend", "mosaickv",
                *(["--mosaickv-config", json.dumps(config)] if config else [])]
    if system not in SYSTEMS:
        raise SystemExit(f"unknown system {system!r}: use {', '.join([*SYSTEMS, *MOSAICKV_SYSTEMS])}")
    backend = [] if "--attention-backend" in SYSTEMS[system] else ["--attention-backend", dense_backend]
    return ["--kv-backend", "default", *backend, *SYSTEMS[system]]


def add_server_args(ap: argparse.ArgumentParser) -> None:
    """The server options the serving and agent benchmarks share."""
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for every server (repeat; e.g. --server-arg=--dtype)")
    ap.add_argument("--mosaickv-config", default=None)
    ap.add_argument("--dense-backend", default="triton",
                    help="attention backend of the dense server (torch_native on a CPU)")


def make_llama8b(out: Path, tokenizer: Path, max_positions: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": vocab,
           "max_position_embeddings": max_positions, "rope_theta": 500000.0,
           "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1,
           "eos_token_id": 2, "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out)
    return out


WARMUP_OUTPUT, WARMUP_SEED = 16, -1  # the points' prompts are seeded with context + batch > 0


def stream_one(url: str, ids: list[int], n_out: int, rec: dict, logprobs: bool = False) -> None:
    payload = {"input_ids": ids, "stream": True, "return_logprob": logprobs,
               "sampling_params": {"temperature": 0, "max_new_tokens": n_out, "ignore_eos": True}}
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps, last, chunk = [], 0, None
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            n = chunk["meta_info"]["completion_tokens"]
            now = time.perf_counter() - t0
            stamps += [now] * (n - last)
            last = n
    if chunk is None:  # e.g. the server's scheduler died: say so, not a KeyError later
        raise RuntimeError(f"{url}/generate streamed no token for a {len(ids)}-token prompt "
                           "(see the server log)")
    # the last chunk's output_ids are all of them (SGLang streams cumulative ids by default)
    rec.update(start=t0, stamps=stamps, output_ids=chunk["output_ids"], meta=chunk["meta_info"])
    if logprobs:  # cumulative too: (log-prob, id, text) per output token
        rec["logprobs"] = [round(t[0], 5) for t in chunk["meta_info"]["output_token_logprobs"]]


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _firsts(recs: list[dict]) -> tuple[float, list[float]]:
    """(the batch's first start, each request's first token in seconds after it)."""
    t0 = min(r["start"] for r in recs)
    return t0, [r["start"] - t0 + r["stamps"][0] for r in recs]


MIN_STEADY_STEPS = 8  # per request, for a decode throughput at the batch the point names


def latency_stats(recs: list[dict], min_steady_steps: int = MIN_STEADY_STEPS) -> dict:
    """TTFT, decode throughput and inter-token gaps of one batch's streams (each rec: its
    request's start time and its tokens' arrival times, seconds after that start).

    `decode_tok_s` counts the tokens that arrive inside the steady window, from the last
    request's first token to the first request's last one, when every request of the batch is
    decoding; fewer than `min_steady_steps` steps there (requests that finished before others
    began) give None and say so in `decode_note`: a rate over tokens made at a smaller batch
    would not be the batch's. `output_tok_s` is every output token over the whole point."""
    t0, firsts = _firsts(recs)
    ends = [r["start"] - t0 + r["stamps"][-1] for r in recs]
    gaps = [b - a for r in recs for a, b in zip(r["stamps"], r["stamps"][1:])]
    # Gaps once every request has its first token: no prompt of this point is prefilling then,
    # so a stall there is the decode step's own (the full list also has the waits of running
    # requests while the later prompts prefill).
    all_in = max(firsts)
    steady = [b - a for r in recs for a, b in zip(r["stamps"], r["stamps"][1:])
              if r["start"] - t0 + a >= all_in]
    lo, hi = all_in, min(ends)
    inside = [sum(lo < r["start"] - t0 + s <= hi for s in r["stamps"]) for r in recs]
    decode, note = None, None
    if hi - lo > 0 and min(inside) >= min_steady_steps:
        decode = sum(inside) / (hi - lo)
    else:
        note = (f"no steady window of {min_steady_steps} steps: every request decoded together "
                f"for {max(hi - lo, 0.0):.2f} s ({min(inside) if hi > lo else 0} tokens of the "
                f"slowest; TTFT spread {all_in - min(firsts):.2f} s): raise the output length")
    total = sum(len(r["stamps"]) for r in recs)
    return {"ttft_s_p50": statistics.median(firsts), "ttft_s_max": max(firsts),
            "decode_tok_s": decode, "decode_note": note, "steady_s": max(hi - lo, 0.0),
            "output_tok_s": total / max(ends) if max(ends) > 0 else None,
            "itl_ms_p50": 1e3 * statistics.median(gaps),
            "itl_ms_p99": 1e3 * percentile(gaps, 0.99),
            "itl_ms_max": 1e3 * max(gaps),  # a once-per-server stall (a compile) p99 hides
            "itl_ms_p99_all_decoding": 1e3 * percentile(steady, 0.99) if steady else None}


def _stream_all(url: str, prompts: list[list[int]], n_out: int, logprobs: bool) -> list[dict]:
    recs = [{} for _ in prompts]
    threads = [threading.Thread(target=stream_one, args=(url, p, n_out, r, logprobs))
               for p, r in zip(prompts, recs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed := sum("start" not in r for r in recs):
        raise RuntimeError(f"{failed} of {len(prompts)} requests at context "
                           f"{len(prompts[0]) + n_out} got no output (the server log says why)")
    return recs


def run_batch(url: str, ctx: int, batch: int, n_out: int, seed: int, vocab: int,
              logprobs: bool = False, prefill_first: bool = False) -> dict:
    """One point: `batch` prompts of `ctx - n_out` random ids, streamed at once. With
    `prefill_first` they are prefilled together first (one output token each: the TTFT columns)
    and then sent again with `n_out` (their prefixes from the radix cache, so that every request
    decodes at once: the decode columns; `ttft_cached_s_p50` is that phase's TTFT)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(ctx - n_out)] for _ in range(batch)]
    prefill = {}
    if prefill_first:
        _, firsts = _firsts(_stream_all(url, prompts, 1, False))
        prefill = {"ttft_s_p50": statistics.median(firsts), "ttft_s_max": max(firsts)}
    recs = _stream_all(url, prompts, n_out, logprobs)
    stats = latency_stats(recs)
    if prefill_first:
        stats.update(ttft_cached_s_p50=stats["ttft_s_p50"], **prefill)
    return {"context": ctx, "batch": batch, "output": n_out, "prefill_first": prefill_first,
            **stats, "tokens": [len(r["stamps"]) for r in recs],
            # prompt tokens each request found in the prefix cache (SGLang's meta_info): with
            # prefill_first, a request that missed it prefilled again (evicted under pressure)
            "cached_tokens": [r["meta"].get("cached_tokens") for r in recs],
            # greedy outputs, so two servers of the same weights can be compared id for id
            "output_sha1": [hashlib.sha1(json.dumps(r["output_ids"]).encode()).hexdigest()[:16]
                            for r in recs],
            **({"output_ids": [r["output_ids"] for r in recs],
                "output_logprobs": [r["logprobs"] for r in recs]} if logprobs else {})}


def warm_up(url: str, system: str, tokens: int, vocab: int) -> dict:
    """One uncounted request (`tokens` in all, a prompt no point uses): JIT compiles and other
    first-use costs happen here, not inside the first measured point."""
    t = time.perf_counter()
    row = run_batch(url, tokens, 1, WARMUP_OUTPUT, seed=WARMUP_SEED, vocab=vocab)
    print(f"[{system}] warm-up: {tokens} tokens in {time.perf_counter() - t:.1f} s (TTFT "
          f"{row['ttft_s_p50']:.1f} s), not counted", flush=True)
    return row


def measure(url: str, system: str, ctx: int, batch: int, n_out: int, vocab: int,
            logprobs: bool = False, prefill_first: bool = True) -> dict:
    """One (context, batch) point on a running server, with its capacity and MosaicKV stats."""
    _, info = request(f"{url}/get_server_info")
    state = info.get("internal_states", [{}])[0]
    memory = state.get("memory_usage", {})
    row = run_batch(url, ctx, batch, n_out, seed=ctx + batch, vocab=vocab, logprobs=logprobs,
                    prefill_first=prefill_first)
    row.update(system=system, max_total_num_tokens=memory.get("token_capacity"),
               kv_cache_gb=memory.get("kvcache"))
    _, info = request(f"{url}/get_server_info")
    row["mosaickv"] = info.get("internal_states", [{}])[0].get("mosaickv")
    row["token_capacity"] = tokens_held(info)  # after the batch sealed its pages
    for kind in ("decode", "prefill"):
        row[f"{kind}_profile"] = point_profile(state.get("mosaickv"), row["mosaickv"], kind)
    # the decode graph's steps that did host work (seals, new pages), every one of them timed
    row["decode_host_profile"] = point_profile(state.get("mosaickv"), row["mosaickv"], "decode",
                                               "forced")
    rate = (f"{row['decode_tok_s']:.1f} tok/s" if row["decode_tok_s"] is not None
            else f"decode tok/s not measured ({row['decode_note']})")
    print(f"[{system}] ctx {ctx} batch {batch}: {rate}, ITL p50 {row['itl_ms_p50']:.1f} ms, "
          f"TTFT p50 {row['ttft_s_p50']:.2f} s", flush=True)
    row["prefix_misses"] = prefix_misses(row, ctx - n_out) if prefill_first else None
    if missed := row["prefix_misses"]:
        print(f"[{system}] ctx {ctx} batch {batch}: {missed} of {batch} requests decoded without "
              f"their prefilled prompt in the prefix cache (evicted: they prefilled again)",
              flush=True)
    return row


def grow_largest(url: str, system: str, row: dict, margin: float, measure_batch,
                 capacity=None) -> dict | None:
    """After `row`, a largest batch sized on an estimated capacity (a two-phase point): the
    batch the estimate holds now that this context's prompts are sealed, with `margin` of it
    kept aside, measured by `measure_batch(b)` if larger. It becomes the largest batch (and
    `row` not) only if none of its prompts left the prefix cache; returns its row, or None
    when `row` lost prompts itself or no larger batch fits."""
    if row.get("prefix_misses"):
        return None
    capacity, estimated = capacity if capacity is not None else token_capacity(url)
    ctx = row["context"]
    b = largest_batch(capacity, ctx, row["output"], estimated, margin)
    if not b or b <= row["batch"]:
        return None
    print(f"[{system}] ctx {ctx}: after batch {row['batch']} the estimate holds {capacity} "
          f"tokens: batch {b} too (less {margin:.0%})", flush=True)
    grown = measure_batch(b)
    kept = grown.get("prefix_misses") == 0
    grown.update(is_largest_batch=kept, largest_batch=b, grown_from=row["batch"],
                 capacity_before=capacity, capacity_estimated=estimated)
    if kept:
        row["is_largest_batch"] = False
    else:
        print(f"[{system}] ctx {ctx}: batch {b} did not fit ({grown.get('prefix_misses')} "
              f"prompts evicted): batch {row['batch']} stays the largest", flush=True)
    return grown


def prefix_misses(row: dict, prompt: int, page: int = 128) -> int:
    """Requests of a two-phase point that found less than their prompt (one page of slack) in
    the prefix cache; unknown counts (a server without `cached_tokens`) are not misses."""
    return sum(c is not None and c < prompt - page for c in row.get("cached_tokens", []))


def token_capacity(url: str) -> tuple[int | None, bool]:
    """(`batch_tokens` of the server now, whether that is an estimate: `capacity_estimated`)."""
    _, info = request(f"{url}/get_server_info")
    return batch_tokens(info), capacity_estimated(info)


def batch_tokens(info: dict) -> int | None:
    """Tokens a batch of prefilled prompts may hold at once (what sizes the largest batch):
    `tokens_held`, less MosaicKV's hot buffer: prompts kept in the prefix cache between a
    point's two phases are sealed pages in the arena, and the hot buffer only ever holds each
    request's last pages (a CPU server with an 8,192-token hot buffer beside a ~5,600-token
    arena lost 4 of 6 prompts between the phases when it was counted)."""
    held, mosaic = tokens_held(info), _mosaic_capacity(info)
    if not mosaic or held is None:
        return held
    return min(held, mosaic["tokens_that_fit"] - mosaic.get("hot_buffer_tokens", 0))


def capacity_estimated(info: dict) -> bool:
    """Whether `batch_tokens` is an estimate (MosaicKV's arena bytes over the bytes per token of
    the layout mix sealed so far, which moves as more is sealed) rather than a count of slots."""
    if not _mosaic_capacity(info):
        return False
    slots = _slots(info)
    return not slots or batch_tokens(info) < slots


def largest_batch(capacity: int | None, ctx: int, output: int, estimated: bool,
                  margin: float = ESTIMATE_MARGIN) -> int | None:
    """Requests of `ctx` prompt and `output` new tokens that fit `capacity` tokens at once, with
    PAGE_MARGIN tokens each for page rounding and, for an estimated capacity, `margin` of it
    kept aside (None: capacity unknown)."""
    if not capacity:
        return None
    usable = int(capacity * (1 - margin)) if estimated else capacity
    return usable // (ctx + output + PAGE_MARGIN)


def tokens_held(info: dict) -> int | None:
    """Tokens the server's KV memory holds, from its /get_server_info: SGLang's slots, or for
    MosaicKV (whose slots are an upper bound, sized at its smallest layout) the tokens its arena
    holds at the layout mix sealed so far (before any seal: the mean of its candidates) plus
    its hot buffer, or its slots where those are fewer (`--max-total-tokens` set below what the
    bytes hold: a CPU run's "largest batch" of 6 then queued on 4096 slots)."""
    slots, mosaic = _slots(info), _mosaic_capacity(info)
    if not mosaic:
        return slots
    return min(mosaic["tokens_that_fit"], slots) if slots else mosaic["tokens_that_fit"]


def _mosaic_capacity(info: dict) -> dict | None:
    """MosaicKV's `stats()["capacity"]` in /get_server_info (None for another backend)."""
    return (info.get("internal_states", [{}])[0].get("mosaickv") or {}).get("capacity")


def _slots(info: dict) -> int | None:
    """The server's token slots: MosaicKV's own count, else SGLang's."""
    state = info.get("internal_states", [{}])[0]
    return ((_mosaic_capacity(info) or {}).get("slots")
            or state.get("memory_usage", {}).get("token_capacity")
            or info.get("max_total_num_tokens"))


def parse_batches(text: str) -> list:
    """"1,8,max" -> [1, 8, "max"]; "max" is each server's largest batch of the context that its
    token capacity holds (prompt + output + a page of margin per request)."""
    out = []
    for item in text.split(","):
        if item != "max" and not (item.isdigit() and int(item) > 0):
            raise SystemExit(f"--batches {text!r}: positive ints or 'max'")
        out.append(item if item == "max" else int(item))
    return out


def point_profile(before: dict | None, after: dict | None, kind: str = "decode",
                  part: str | None = None) -> dict | None:
    """MosaicKV's sampled `kind` ("decode" / "prefill") step phases (decode_profile_every > 0)
    of one point: the server's running averages before and after it, differenced -> ms per step
    of this point, and the slowest sampled steps that fell inside it. `part` "forced": the
    steps timed apart from the sampling (the decode graph's steps with host work)."""
    prof = [((s or {}).get(kind) or {}).get("profile") or {} for s in (before, after)]
    if part is not None:
        prof = [{**(p.get(part) or {}), "steps": p.get("steps", 0)} for p in prof]
    steps = [p.get("sampled_steps", 0) for p in prof]
    if steps[1] <= steps[0]:
        return None
    totals = [{k: v * n for k, v in p.get("ms_per_step", {}).items()} for p, n in zip(prof, steps)]
    return {"sampled_steps": steps[1] - steps[0],
            "ms_per_step": {k: round((v - totals[0].get(k, 0.0)) / (steps[1] - steps[0]), 3)
                            for k, v in totals[1].items()},
            "slowest": [s for s in prof[1].get("slowest", [])
                        if s["step"] > prof[0].get("steps", 0)]}


def phase_line(ms: dict) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in sorted(ms.items(), key=lambda kv: -kv[1]))


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def print_table(results: list) -> None:
    print(f"\n{'system':<10}{'ctx':>7}{'batch':>6}{'TTFT p50 s':>11}{'decode tok/s':>13}"
          f"{'ITL p50 ms':>11}{'ITL p99 ms':>11}{'ITL max ms':>11}{'p99 all-dec':>12}"
          f"{'capacity':>10}{'ratio':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['system']:<10} ERROR {r['error'][:100]}")
            continue
        mk = r.get("mosaickv") or {}
        ratio = mk.get("sealed_ratio")
        print(f"{r['system']:<10}{r['context']:>7}{r['batch']:>6}{r['ttft_s_p50']:>11.2f}"
              f"{_num(r['decode_tok_s']):>13}{r['itl_ms_p50']:>11.1f}{r['itl_ms_p99']:>11.1f}"
              f"{r.get('itl_ms_max') or 0:>11.1f}{r.get('itl_ms_p99_all_decoding') or 0:>12.1f}"
              f"{r.get('token_capacity') or r['max_total_num_tokens'] or 0:>10}"
              f"{ratio or 0:>7.2f}")
    for r in results:  # MosaicKV's sampled step phases (decode_profile_every > 0)
        for kind in ("decode", "decode_host", "prefill"):
            prof = r.get(f"{kind}_profile")
            if not prof:
                continue
            print(f"{kind} profile {r['system']} ctx {r['context']} batch {r['batch']} "
                  f"({prof['sampled_steps']} steps, ms per step): "
                  f"{phase_line(prof['ms_per_step'])}")
            for s in prof["slowest"][:2]:
                print(f"  slowest {kind} step {s['step']}: {s['ms']:.1f} ms: "
                      f"{phase_line(s['phases'])}")
    first = {}  # (context, batch) -> the first system's row: same prompts, same dummy weights
    for r in results:
        if "output_sha1" not in r:
            continue
        ref = first.setdefault((r["context"], r["batch"]), r)
        if ref is not r:
            same = sum(a == b for a, b in zip(ref["output_sha1"], r["output_sha1"]))
            print(f"greedy outputs ctx {r['context']} batch {r['batch']}: {r['system']} "
                  f"identical to {ref['system']} in {same} of {len(r['output_sha1'])} requests")
            if "output_logprobs" in r and "output_logprobs" in ref:
                diff, tokens = logprob_agreement(ref, r)
                print(f"  log-probs while the ids agree ({tokens} tokens): max |diff| {diff:.2e}")


def logprob_agreement(ref: dict, row: dict) -> tuple[float, int]:
    """Largest |log-prob difference| between two rows' requests over the tokens up to each
    request's first differing id (after it the contexts differ), and how many tokens that is."""
    diff, tokens = 0.0, 0
    for ids_a, ids_b, lp_a, lp_b in zip(ref["output_ids"], row["output_ids"],
                                        ref["output_logprobs"], row["output_logprobs"]):
        n = next((i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b),
                 min(len(ids_a), len(ids_b)))
        n = min(n, len(lp_a), len(lp_b))
        diff = max([diff] + [abs(a - b) for a, b in zip(lp_a[:n], lp_b[:n])])
        tokens += n
    return diff, tokens


def save(path: Path, results: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--make-llama8b", type=Path, help="write a Llama-3.1-8B-shaped config here")
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--systems", default="dense,mosaickv")
    ap.add_argument("--contexts", default="32768")
    ap.add_argument("--batches", default="1,8",
                    help="comma list of batch sizes; 'max' = each system's largest that fits")
    ap.add_argument("--output", type=int, default=64)
    add_server_args(ap)
    ap.add_argument("--parallel-start", action="store_true",
                    help="start every system's server at once (start-up overlaps; give each a "
                         "share of the GPU with --server-arg=--mem-fraction-static), then "
                         "benchmark them one at a time while the others idle")
    ap.add_argument("--wait-for", type=Path, default=None,
                    help="before the first measurement, wait (up to 600 s) until this file "
                         "exists: work sharing the GPU during start-up must be over by then")
    ap.add_argument("--after-bench", action="append", default=[], metavar="CMD",
                    help="shell command run against each system's server after its rows, "
                         "before it stops ({url} and {system} are filled in; repeat); e.g. "
                         "benchmarks/agent_bench.py --url {url} --systems {system} ...")
    ap.add_argument("--system-arg", action="append", default=[], metavar="SYSTEM:ARG",
                    help="extra argument for one system's server (repeat; e.g. "
                         "--system-arg=mosaickv:--max-total-tokens --system-arg=mosaickv:270000)")
    ap.add_argument("--logs", type=Path, default=Path("serving_logs"))
    ap.add_argument("--warmup", type=int, default=0, metavar="TOKENS",
                    help="one request of this many tokens on each server before its points, not "
                         "counted (the first point otherwise pays JIT compiles: MosaicKV's TTFT "
                         "25.5 s vs ~12 s at 32K x 1 on the H200); 0: none")
    ap.add_argument("--logprobs", action="store_true",
                    help="keep each output token's log-prob and compare them across systems "
                         "(equal greedy ids say little on dummy weights); SGLang then computes "
                         "log-probs in every step, for every system alike")
    ap.add_argument("--concurrent-prefill", action="store_true",
                    help="send each point's prompts once, prefill and decode interleaved (TTFT "
                         "with running requests around it; decode tok/s only if a steady window "
                         "of every request decoding remains); default: prefill the batch first, "
                         "then decode it from the prefix cache")
    ap.add_argument("--grow-margin", type=float, default=GROW_MARGIN,
                    help="share of the capacity estimated after a largest batch ran kept aside "
                         "when trying a larger one")
    ap.add_argument("--no-grow", action="store_true",
                    help="size the largest batch once, on the estimate before it ran")
    ap.add_argument("--estimate-margin", type=float, default=ESTIMATE_MARGIN,
                    help="share of an estimated capacity (MosaicKV's tokens that fit at the "
                         "layout mix sealed so far) kept aside when sizing the largest batch")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    systems = args.systems.split(",")
    per_system: dict[str, list[str]] = {s: [] for s in systems}
    for item in args.system_arg:
        name, sep, arg = item.partition(":")
        if not sep or name not in per_system:
            raise SystemExit(f"--system-arg {item!r}: use SYSTEM:ARG with SYSTEM one of {systems}")
        per_system[name].append(arg)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.warmup > max(contexts):  # the servers' context is the largest point's + 1024
        print(f"[serving_bench] --warmup {args.warmup} is past the largest context: the warm-up "
              f"request takes {max(contexts)} tokens")
        args.warmup = max(contexts)
    batches = parse_batches(args.batches)
    model = args.model
    if args.make_llama8b:
        model = make_llama8b(args.make_llama8b, args.tokenizer, max(contexts) + 1024)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    args.logs.mkdir(parents=True, exist_ok=True)
    # --max-running-requests only for explicit batches: with 'max' SGLang derives it (and a
    # MosaicKV pool lowers it to what its hot buffer carries, logged), where an explicit value
    # above that is refused at start-up
    running = [] if "max" in batches else ["--max-running-requests", str(max(batches))]
    common = ["--load-format", args.load_format, "--context-length", str(max(contexts) + 1024),
              "--chunked-prefill-size", str(-(-max(contexts) // 128) * 128), *running,
              "--grammar-backend", "none", *args.server_arg]
    results = []
    # a time limit stops the servers too (partial results are saved after every point)
    stop_servers_on_signals("serving_bench", f"; results so far in {args.json}")

    def launch(system: str):
        """(system, entered server context, start-up seconds) or (system, None, exception)."""
        extra = system_args(system, args.dense_backend, args.mosaickv_config) + per_system[system]
        t = time.perf_counter()
        ctx = running_server(model, args.logs / f"{system}.log", *extra, *common, startup_s=900)
        try:
            srv = ctx.__enter__()
        except Exception as exc:  # reported, never dropped: the other systems still run
            return system, None, exc
        startup = time.perf_counter() - t
        print(f"[{system}] up in {startup:.0f} s", flush=True)
        return system, (ctx, srv), startup

    def bench(system: str, srv, startup_s: float) -> None:
        if args.warmup:
            warm_up(srv.url, system, args.warmup, vocab)
        for ctx in contexts:
            for b in batches:
                # read before every point: an estimated capacity moves as pages are sealed
                capacity, estimated = token_capacity(srv.url)
                largest = largest_batch(capacity, ctx, args.output, estimated,
                                        args.estimate_margin)
                if b == "max":
                    b = largest
                    if not b:
                        results.append({"system": system, "context": ctx, "batch": 0,
                                        "error": f"not one request fits {capacity} tokens"})
                        continue
                    print(f"[{system}] ctx {ctx}: largest batch that fits = {b} ({capacity} tokens"
                          + (f", an estimate less {args.estimate_margin:.0%})" if estimated
                             else ")"), flush=True)
                    done = [r for r in results if r.get("system") == system
                            and r.get("context") == ctx and r.get("batch") == b]
                    if done:  # measured already (same prompts: it would be a prefix-cache hit)
                        done[0]["is_largest_batch"] = True
                        continue
                elif largest is not None and b > largest:  # it would queue, not run at once
                    print(f"[{system}] ctx {ctx}: batch {b} skipped: the largest that fits its "
                          f"{capacity} tokens is {largest}", flush=True)
                    continue
                row = measure(srv.url, system, ctx, b, args.output, vocab, args.logprobs,
                              prefill_first=not args.concurrent_prefill)
                row["is_largest_batch"] = b == largest
                row["largest_batch"] = largest
                row["capacity_before"] = capacity
                row["capacity_estimated"] = estimated
                row["startup_s"] = round(startup_s, 1)
                results.append(row)
                save(args.json, results)  # partial results survive a time limit
                if row["is_largest_batch"] and estimated and not (args.no_grow or
                                                                  args.concurrent_prefill):
                    grown = grow_largest(
                        srv.url, system, row, args.grow_margin,
                        lambda b: measure(srv.url, system, ctx, b, args.output, vocab,
                                          args.logprobs))
                    if grown is not None:
                        grown["startup_s"] = round(startup_s, 1)
                        results.append(grown)
                        save(args.json, results)

        for n, template in enumerate(args.after_bench):
            cmd = template.format(url=srv.url, system=system)
            t = time.perf_counter()
            with open(args.logs / f"after_{system}_{n}.log", "w") as fh:
                rc = subprocess.run(cmd, shell=True, stdout=fh, stderr=subprocess.STDOUT).returncode
            print(f"[{system}] after-bench {n} rc {rc} in {time.perf_counter() - t:.0f} s: {cmd}",
                  flush=True)

    if args.parallel_start:
        with ThreadPoolExecutor(len(systems)) as pool:
            launched = list(pool.map(launch, systems))
    else:
        launched = [None] * len(systems)
    try:
        for i, system in enumerate(systems):
            _, server, startup = launched[i] = launched[i] or launch(system)
            if args.wait_for is not None and not args.wait_for.exists():
                t = time.perf_counter()
                while not args.wait_for.exists() and time.perf_counter() - t < 600:
                    time.sleep(1)
                print(f"waited {time.perf_counter() - t:.0f} s for {args.wait_for}", flush=True)
            if server is None:
                results.append({"system": system, "error": repr(startup)[-2000:]})
                print(f"[{system}] FAILED to start: {startup!r}"[-2000:], flush=True)
                continue
            try:
                bench(system, server[1], startup)
            except Exception as exc:  # reported, never dropped: the other systems still run
                results.append({"system": system, "error": repr(exc)[-2000:]})
                print(f"[{system}] FAILED: {exc!r}"[-2000:], flush=True)
            finally:  # this server's turn is over: stop it (frees the GPU for the next)
                server[0].__exit__(None, None, None)
                launched[i] = (system, None, startup)
    finally:  # servers started but never benchmarked (an interrupted run)
        for entry in launched:
            if entry and entry[1] is not None:
                entry[1][0].__exit__(None, None, None)
    save(args.json, results)
    print_table(results)


if __name__ == "__main__":
    main()
