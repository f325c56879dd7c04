"""A real SGLang server (CPU) decoding through the packed Triton kernels (interpreter) gives the
same greedy ids as the same server on the torch reference path: both read the same packed bytes,
with page selection active and a prompt spanning two basis blocks."""
import json

import pytest

from server_utils import SMOLLM2, make_tiny_llama, mosaickv_stats, request, running_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(),
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh")]

CONFIG = {"basis_block_tokens": 256, "hot_tokens": 32,
          "sink_candidates": ["band:b8=64,b4=0,b2=0,group=32"],
          "select": {"budget_tokens": 256, "sink_tokens": 32, "recent_tokens": 64},
          "hot_buffer_fraction": 0.5}  # 4096 slots: the hot buffer must hold a 2048 chunk


def test_triton_decode_path_matches_reference_path(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny64", head_dim=64)
    ids = list(range(1000, 1700))  # 700 tokens: 5 sealed pages over 3 basis blocks
    outputs, stats = {}, {}
    for kernel in ("reference", "triton"):
        cfg = json.dumps({**CONFIG, "decode_kernel": kernel})
        with running_server(model, tmp_path / f"{kernel}.log", "--kv-backend", "mosaickv",
                            "--mosaickv-config", cfg, "--dtype", "bfloat16",
                            "--max-total-tokens", "4096") as srv:
            status, body = request(f"{srv.url}/generate", {
                "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 12,
                                                      "ignore_eos": True}})
            assert status == 200
            outputs[kernel] = body["output_ids"]
            stats[kernel] = mosaickv_stats(srv.url)
    assert outputs["triton"] == outputs["reference"]
    assert stats["triton"]["decode"]["kernel_request_steps"] >= 11
    assert stats["triton"]["decode"]["reference_decode_requests"] == 0
    assert stats["reference"]["decode"] == {}
    assert stats["triton"]["sealed_pages"] >= 5
