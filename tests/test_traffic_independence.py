"""Same prompt, same output: a greedy request's output does not depend on other traffic.

A tiny random Llama (head_dim 64, fp32; SmolLM2-135M-Instruct with MOSAICKV_TI_MODEL=smollm2)
behind a small pool (4096 tokens, 512-token prefill chunks): 12 concurrent greedy requests
(random-token prompts of 600-1400 tokens, 3 of them behind a shared 1024-token prefix, 24 new
tokens each) offer ~15K tokens to the 4096-token pool, so chunking, batching, queueing and
retraction all depend on the neighbours. Then every prompt is sent again alone after
`/flush_cache`. Each loaded output must equal its alone output, as with `--kv-backend default`
(the control), under the default config (read_rule "position"; or the config in
MOSAICKV_TI_CONFIG, JSON, e.g. '{"preset": "chunk_rule"}' for the chunk rule, which does not pass:
docs/determinism.md), bit for bit in what it reads (the position rule, the chunking-invariant
prefill attention and the CPU platform's batch-invariant linear layers):

* `daemon: off`: every request;
* `daemon: process` (192 new tokens, so that every request fills pages of generated tokens,
  which the workers seal inside the window W = 128, anchored at the prompt's end for the
  prompt; prompt pages before it are sealed inline): every request, those behind the shared
  prefix included: the radix tree holds each request's last W prompt tokens back from its
  match and its inserts, so a cached prefix is made of pages read compressed by every token of
  the request reusing it, as the cache holds them.

About 1 min per server on an otherwise idle 2-core box.
"""
import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_utils import (SMOLLM2, flush_cache, make_tiny_llama, mosaickv_stats, request,
                          running_server)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(),
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh")]

SEED = 35
N_REQ, NEW_TOKENS, SHARED = 12, 24, 1024
# the daemon case: every request fills a page of generated tokens (the only pages the workers
# get) at least 64 tokens before it ends
DAEMON_NEW_TOKENS = 192
SHARED_PREFIX = [i for i in range(N_REQ) if i % 4 == 1]  # the requests behind the shared prefix
# the configuration whose outputs do not depend on other traffic (docs/determinism.md) is the
# default (the position rule, first-page bases, W 0): no keys; the chunk rule gave 4 of 12 here
COMMON = ("--dtype", "float32", "--max-total-tokens", "4096", "--chunked-prefill-size", "512")


def _prompts(seed: int = SEED) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 49000) for _ in range(SHARED)]
    prompts = []
    for i in range(N_REQ):
        n = rng.randrange(600, 1401)
        if i % 4 == 1:  # 3 of 12 behind the shared prefix
            prompts.append(shared + [rng.randrange(100, 49000) for _ in range(max(n - SHARED, 64))])
        else:
            prompts.append([rng.randrange(100, 49000) for _ in range(n)])
    return prompts


def _greedy(url: str, ids: list[int], new_tokens: int | None = None) -> list[int]:
    status, body = request(f"{url}/generate", {
        "input_ids": ids, "sampling_params": {"temperature": 0,
                                              "max_new_tokens": new_tokens or NEW_TOKENS,
                                              "ignore_eos": True}}, timeout=1800)
    assert status == 200, body
    return body["output_ids"]


def loaded_vs_alone(url: str, prompts: list[list[int]],
                    new_tokens: int | None = None) -> tuple[list, list]:
    flush_cache(url)
    with ThreadPoolExecutor(len(prompts)) as ex:
        loaded = list(ex.map(lambda p: _greedy(url, p, new_tokens), prompts))
    alone = []
    for p in prompts:
        flush_cache(url)
        alone.append(_greedy(url, p, new_tokens))
    return loaded, alone


def _check(loaded, alone, label: str, which: list[int] | None = None) -> None:
    """loaded[i] == alone[i] for every request i in `which` (default: all)."""
    which = range(len(loaded)) if which is None else which
    first_diff = {i: next((j for j, (x, y) in enumerate(zip(loaded[i], alone[i])) if x != y),
                          min(len(loaded[i]), len(alone[i])))
                  for i in which if loaded[i] != alone[i]}
    assert not first_diff, (f"{label}: {len(which) - len(first_diff)} of {len(which)} loaded "
                            f"outputs equal the same prompt served alone (seed {SEED}); request "
                            f"-> first differing token: {first_diff}")


# the same with page selection active on these short prompts (a 512-token budget: about half of
# the pages read) and its second stage (candidates rescored on their compressed K): what the
# position rule needs for its accuracy (docs/determinism.md), still a function of the request
SELECTING = {"select": {"budget_tokens": 512, "recent_tokens": 128, "sink_tokens": 64,
                        "rescore_factor": 2, "rescore_channels": 32}}


def test_loaded_equals_alone_with_selection_and_second_stage(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny", head_dim=64)
    args = ["--kv-backend", "mosaickv", *COMMON,
            "--mosaickv-config", json.dumps({**SELECTING, "daemon": "off"})]
    with running_server(model, tmp_path / "server.log", *args) as server:
        loaded, alone = loaded_vs_alone(server.url, _prompts())
        stats = mosaickv_stats(server.url)
    reads = stats["decode"]["selection_reference"]
    assert 0 < reads["read_fraction"] < 0.9, reads  # selection skipped pages
    _check(loaded, alone, "mosaickv/off, selection + second stage")


@pytest.mark.parametrize("kv_backend,daemon", [("default", None), ("mosaickv", "off"),
                                               ("mosaickv", "process")])
def test_loaded_equals_alone(tmp_path, kv_backend, daemon):
    prompts = _prompts()
    model = SMOLLM2 if os.environ.get("MOSAICKV_TI_MODEL") == "smollm2" else \
        make_tiny_llama(tmp_path / "tiny", head_dim=64)
    args = ["--kv-backend", kv_backend, *COMMON]
    if kv_backend == "default":
        args += ["--page-size", "128"]
    else:
        # MOSAICKV_TI_CONFIG (JSON) replaces the default, to measure another config
        config = json.loads(os.environ.get("MOSAICKV_TI_CONFIG") or "{}")
        args += ["--mosaickv-config", json.dumps({**config, "daemon": daemon})]
    new_tokens = DAEMON_NEW_TOKENS if daemon == "process" else NEW_TOKENS
    with running_server(model, tmp_path / "server.log", *args) as server:
        loaded, alone = loaded_vs_alone(server.url, prompts, new_tokens)
        stats = mosaickv_stats(server.url) if kv_backend == "mosaickv" else None
    label = f"{kv_backend}/{daemon}"
    if stats is not None:
        assert stats["sealed_pages"] or stats["counters"]["sealed_pages"], stats
        label += " " + str({k: stats["counters"][k] for k in (
            "early_sealed_reads", "prompt_len_unknown", "prefix_repairs")})
    if daemon == "process":
        label += " " + str({k: stats["daemon"][k] for k in (
            "worker_pages", "sync_seals_needed", "sync_seals_backpressure")})
    print(label)  # the counters (pytest -rP shows them)
    _check(loaded, alone, label)
    if daemon == "process" and not os.environ.get("MOSAICKV_TI_CONFIG"):
        # the daemon sealed pages (a daemon that seals nothing would pass like daemon: off)
        assert stats["daemon"]["worker_pages"] > 0, stats["daemon"]
        assert stats["counters"]["early_sealed_reads"] == 0, stats["counters"]
        assert stats["counters"]["prompt_len_unknown"] == 0, stats["counters"]
