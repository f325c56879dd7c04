"""The byte gate on a CPU server (a scaled version of the H200 soak, docs/serving.md, capacity):
a flood of concurrent mixed requests offering twice the tokens the packed arena holds, shared
prefixes, aborts, and the daemon's worker killed once mid-run. Every request that was not
aborted must finish with SGLang's default KV cache's greedy output, without errors; the arena
must never be over-committed (admission waited for bytes instead), and after a cache flush no
arena byte, outside byte or hot page may be left.

The config is lossless (the chooser keeps every page dense: the 4-bit band candidate fails the
zero error budget) but sizes its slots by that band (~0.27 of fp32 dense), so the bytes, not the
slots, run out first: the gate is what keeps the server alive. Dense pages live beside the
arena and are charged to it (the arena's own blocks: tests/test_sizing.py).
"""
import json
import os
import random
import signal
import threading
import time
import urllib.error

import psutil
import pytest

from server_utils import (SMOLLM2, flush_cache, make_tiny_llama, mosaickv_stats, request,
                          running_server, running_servers, same_greedy_or_tied)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(),
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh")]

FLOOD = {"k_candidates": ["band:b8=0,b4=64,b2=0,group=128", "dense:val=fp32"],
         "v_candidates": ["band:b8=0,b4=64,b2=0,group=128", "dense:val=fp32"],
         "k_error_budget": 0.0, "v_error_budget": 0.0, "rescue_candidates": [],
         "sink_candidates": [], "hot_tokens": 0, "select": {"enabled": False},
         "daemon": "process", "daemon_workers": 1, "daemon_queue_segments": 32,
         "hot_buffer_requests": 8}
SLOTS = 65536


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), head_dim=64)
    logs = tmp_path_factory.mktemp("logs")
    common = ("--dtype", "float32", "--page-size", "128", "--chunked-prefill-size", "1024")
    with running_servers((model, logs / "default.log", "--kv-backend", "default",
                          "--max-total-tokens", "32768", *common),
                         (model, logs / "mosaickv.log", "--kv-backend", "mosaickv",
                          "--max-total-tokens", str(SLOTS),
                          "--mosaickv-config", json.dumps(FLOOD), *common)) as (dense, mosaic):
        yield dense, mosaic


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _greedy(url: str, ids: list[int], n: int, rid: str | None = None):
    payload = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
               "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    if rid is not None:
        payload["rid"] = rid
    status, body = request(f"{url}/generate", payload, timeout=1800)
    assert status == 200, body
    return body


def _worker_pid(server) -> int:
    (pid,) = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)
              if "mosaickv_sglang.daemon.worker" in " ".join(p.cmdline())]
    return pid


def test_flood_beyond_the_arena_waits_for_bytes_and_loses_nothing(pair):
    dense, mosaic = pair
    cap = mosaickv_stats(mosaic.url)["capacity"]
    page = 128
    # tokens the arena holds at the layout the chooser keeps (dense, the largest)
    holds = cap["arena_bytes_per_layer"] // cap["page_bytes"]["worst"] * page
    assert holds < SLOTS // 2, cap  # the slots are not what limits this server
    rng = random.Random(3)
    prefix = _prompt(rng, 384)
    jobs, offered = [], 0
    while offered < 2 * holds:
        body = _prompt(rng, rng.choice((60, 300, 700, 1200)))
        ids = (prefix + body) if len(jobs) % 3 == 0 else body
        jobs.append((ids, rng.choice((16, 64, 160))))
        offered += len(ids) + jobs[-1][1]
    assert len(jobs) >= 16
    want = [_greedy(dense.url, ids, n) for ids, n in jobs]

    out, errors, finished = [None] * len(jobs), [], {}
    aborted = [(_prompt(rng, 900), 1000) for _ in range(3)]

    def go(i):
        try:
            out[i] = _greedy(mosaic.url, *jobs[i])
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(f"request {i}: {exc!r}")

    def go_aborted(i):
        try:
            body = _greedy(mosaic.url, *aborted[i], rid=f"flood-abort{i}")
            finished[i] = ((body.get("meta_info") or {}).get("finish_reason") or {}).get("type")
        except (AssertionError, urllib.error.HTTPError):
            finished[i] = "abort"

    pid, killed, gated = _worker_pid(mosaic), {}, []

    def disturb():  # abort three long requests, kill the worker once while it holds pages,
        # and watch the gate limit admission
        deadline, aborts_sent = time.monotonic() + 600, False
        while time.monotonic() < deadline and (not killed or not gated or not aborts_sent):
            st = mosaickv_stats(mosaic.url)
            if st["capacity"]["byte_deficit"] > 0:
                gated.append(st["capacity"]["byte_deficit"])
            if not killed and st["daemon"]["inflight_pages"] > 0:
                os.kill(pid, signal.SIGKILL)
                killed["inflight"] = st["daemon"]["inflight_pages"]
            if not aborts_sent and time.monotonic() > deadline - 590:
                for i in range(3):
                    request(f"{mosaic.url}/abort_request", {"rid": f"flood-abort{i}"})
                aborts_sent = True
            time.sleep(0.05)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    threads += [threading.Thread(target=go_aborted, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    disturb()
    for t in threads:
        t.join()
    assert not errors, errors
    for w, g in zip(want, out):
        same_greedy_or_tied(w, g)
    assert "length" not in finished.values(), finished  # aborted, not run to the end
    assert killed, "the worker never held a page during the flood"
    assert gated, "the arena's bytes never limited admission: the flood did not test the gate"
    stats = mosaickv_stats(mosaic.url)
    assert stats["capacity"]["byte_limited"] >= 1
    # the planned bytes were never exceeded (the dense pages live beside the arena, charged)
    assert stats["capacity"]["over_capacity"] == 0, stats["capacity"]
    assert stats["segment_store"]["arena_full_segments"] == 0, stats["segment_store"]
    kept = sum(n for kind, n in stats["bytes"].items() if kind != "hot_buffer_capacity")
    assert stats["arena_bytes"] == kept  # running total == re-summed from every kept tensor
    assert stats["daemon"]["restarts"] == 1 and stats["daemon"]["worker_errors"] == 0
    flush_cache(mosaic.url)
    emptied = mosaickv_stats(mosaic.url)
    assert emptied["sealed_pages"] == 0 and emptied["arena_bytes"] == 0
    assert emptied["segment_store"]["live_block_bytes"] == 0
    assert emptied["capacity"]["outside_bytes"] == 0
    assert emptied["hot_tokens_in_use"] == 0, emptied  # no hot page leaked


@pytest.mark.parametrize("daemon", ["off", "process"])
def test_cold_pages_are_recompressed_between_steps(tmp_path, daemon):
    """`cold.enabled` on a server: finished and old pages are re-encoded at the step boundaries
    (the scheduler hook reads the running requests' warm pages), on the scheduler thread or by
    the daemon's workers (cold jobs, adopted at later boundaries); bytes fall, every request
    answers, nothing is left after a flush."""
    model = make_tiny_llama(tmp_path / "tiny_llama", head_dim=64)
    cfg = {"preset": "chunk_rule", "hot_tokens": 0,  # cold needs the chunk read rule
           "cold": {"enabled": True, "after_tokens": 256, "pages_per_step": 16,
                    "k_error_budget": 1.0, "v_error_budget": 1.0},
           "daemon": daemon, "daemon_workers": 1}
    with running_server(model, tmp_path / "cold.log", "--kv-backend", "mosaickv",
                        "--dtype", "float32", "--page-size", "128", "--chunked-prefill-size",
                        "1024", "--max-total-tokens", "16384",
                        "--mosaickv-config", json.dumps(cfg)) as srv:
        rng = random.Random(5)
        for _ in range(3):
            body = _greedy(srv.url, _prompt(rng, 1100), 64)
            assert len(body["output_ids"]) == 64
        deadline = time.time() + 60  # the workers' results come in at idle boundaries
        while True:
            stats = mosaickv_stats(srv.url)
            counters = stats["counters"]
            if counters["cold_pages"] >= 8 or time.time() > deadline:
                break
            time.sleep(0.5)
        assert counters["cold_pages"] >= 8, counters  # the finished requests' pages
        if daemon == "process":
            assert stats["daemon"]["cold_submitted_pages"] >= counters["cold_pages"]
            assert stats["daemon"]["worker_errors"] == stats["daemon"]["sync_seals_fallback"] == 0
        assert counters["cold_saved_bytes"] > 0
        assert any(k.startswith("k:band:b8=4,b4=36") for k in counters["strategies"]), counters
        kept = sum(n for kind, n in stats["bytes"].items() if kind != "hot_buffer_capacity")
        assert stats["arena_bytes"] == kept and stats["capacity"]["over_capacity"] == 0
        flush_cache(srv.url)
        emptied = mosaickv_stats(srv.url)
        assert emptied["sealed_pages"] == 0 and emptied["segment_store"]["live_block_bytes"] == 0
