"""A CPU server under RULER-like load keeps its auto hot buffer (tests/test_hot_sizing.py at the
pool level): many short concurrent prompts, some behind a shared prefix, short answers, the
default read rule and window, `hot_buffer_requests` small so the cap binds. Before the chunk
rule's window was sized, this stopped the scheduler with "hot buffer exhausted" within seconds
(as 65 RULER requests did on an H100, 2026-12-07)."""
import json
import random
import threading

import pytest

from server_utils import SMOLLM2, mosaickv_stats, request, running_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(),
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh")]

NEW_TOKENS = 4


def test_short_concurrent_requests_never_exhaust_the_auto_hot_buffer(tmp_path):
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(300)]
    prompts = []
    for i in range(10):
        body = [rng.randrange(100, 40000) for _ in range(rng.randrange(150, 500))]
        prompts.append(prefix + body if i % 3 == 0 else body)
    cfg = {"hot_buffer_requests": 2}  # the default read rule (chunk) and window (hot_tokens 64)
    with running_server(SMOLLM2, tmp_path / "server.log", "--kv-backend", "mosaickv",
                        "--dtype", "float32", "--max-total-tokens", "32768",
                        "--chunked-prefill-size", "512",
                        "--mosaickv-config", json.dumps(cfg)) as srv:
        done, errors = {}, []

        def run(i):
            try:
                _, out = request(f"{srv.url}/generate", {"input_ids": prompts[i],
                                 "sampling_params": {"max_new_tokens": NEW_TOKENS,
                                                     "temperature": 0, "ignore_eos": True}})
                done[i] = out["meta_info"]["completion_tokens"]
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append((i, repr(e)[:300]))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, (errors, srv.log.read_text()[-3000:])
        assert done == {i: NEW_TOKENS for i in range(len(prompts))}
        stats = mosaickv_stats(srv.url)
        assert stats["counters"]["sealed_pages"] > 0  # it compressed, not ran dense
