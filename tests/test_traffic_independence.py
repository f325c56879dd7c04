"""Same prompt, same output: a greedy request's output does not depend on other traffic.

A tiny random Llama (head_dim 64, fp32; SmolLM2-135M-Instruct with MOSAICKV_TI_MODEL=smollm2)
behind a small pool (4096 tokens, 512-token prefill chunks): 12 concurrent greedy requests
(random-token prompts of 600-1400 tokens, 3 of them behind a shared 1024-token prefix, 24 new
tokens each) offer ~15K tokens to the 4096-token pool, so chunking, batching, queueing and
retraction all depend on the neighbours. Then every prompt is sent again alone after
`/flush_cache`. Each loaded output must equal its alone output, as with `--kv-backend default`
(the control), under read_rule "position" with `daemon: off` and `daemon: process` (or the
config in MOSAICKV_TI_CONFIG, JSON, e.g. '{}' for the default).

Opt-in (MOSAICKV_TRAFFIC_TEST=1, ~11 min on 2 cores): MosaicKV does not pass it yet. Measured
2026-12-04 (docs/determinism.md): the default config 9 of 12 (48 new tokens); the position rule
12 of 12 once (48 tokens) and 11 of 12 in the next run (24 tokens), under the daemon 9 of 12;
the dense control 12 of 12. Made a CI gate when it passes.
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
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh"),
              pytest.mark.skipif(os.environ.get("MOSAICKV_TRAFFIC_TEST") != "1",
                                 reason="issue 35's reproduction, opt-in (MOSAICKV_TRAFFIC_TEST=1): "
                                        "MosaicKV does not pass it yet (docs/determinism.md)")]

SEED = 35
N_REQ, NEW_TOKENS, SHARED = 12, 24, 1024
# the configuration whose outputs do not depend on other traffic (docs/determinism.md); the
# default (read_rule "chunk") gave 9 of 12 here
POSITION_RULE = {"read_rule": "position", "basis_fit": "first_page", "hot_tokens": 0}
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


def _greedy(url: str, ids: list[int]) -> list[int]:
    status, body = request(f"{url}/generate", {
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                              "ignore_eos": True}}, timeout=1800)
    assert status == 200, body
    return body["output_ids"]


def loaded_vs_alone(url: str, prompts: list[list[int]]) -> tuple[list, list]:
    flush_cache(url)
    with ThreadPoolExecutor(len(prompts)) as ex:
        loaded = list(ex.map(lambda p: _greedy(url, p), prompts))
    alone = []
    for p in prompts:
        flush_cache(url)
        alone.append(_greedy(url, p))
    return loaded, alone


def _check(loaded, alone, label: str) -> None:
    same = [a == b for a, b in zip(loaded, alone)]
    first_diff = {i: next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                  for i, (a, b) in enumerate(zip(loaded, alone)) if a != b}
    assert all(same), (f"{label}: {sum(same)} of {len(same)} loaded outputs equal the same prompt "
                       f"served alone (seed {SEED}); request -> first differing token: "
                       f"{first_diff}")


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
        # MOSAICKV_TI_CONFIG (JSON) replaces the position rule, to measure another config
        config = json.loads(os.environ.get("MOSAICKV_TI_CONFIG") or json.dumps(POSITION_RULE))
        args += ["--mosaickv-config", json.dumps({**config, "daemon": daemon})]
    with running_server(model, tmp_path / "server.log", *args) as server:
        loaded, alone = loaded_vs_alone(server.url, prompts)
        if kv_backend == "mosaickv":
            stats = mosaickv_stats(server.url)
            assert stats["sealed_pages"] or stats["counters"]["sealed_pages"], stats
    _check(loaded, alone, f"{kv_backend}/{daemon}")
