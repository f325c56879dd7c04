"""Helpers for the end-to-end tests: the package's server launcher plus a tiny random model."""
import shutil
from pathlib import Path

from mosaickv_sglang.launch import (SMOLLM2, flush_cache, free_port, mosaickv_stats,  # noqa: F401
                                    request, running_server, running_servers,
                                    server_env, stop)

# Lossless sealing (fp32 dense, no sink/selection) through the daemon: greedy ids must equal dense.
LOSSLESS_DAEMON_CONFIG = {"k_candidates": ["dense:val=fp32"], "v_candidates": ["dense:val=fp32"],
                          "sink_candidates": [], "hot_tokens": 0, "select": {"enabled": False},
                          "hot_buffer_fraction": 0.5, "daemon": "process", "daemon_workers": 1,
                          "daemon_queue_segments": 32}


def make_tiny_llama(out: Path, head_dim: int = 16, kv_heads: int = 2) -> Path:
    """A 2-layer random Llama with the SmolLM2 tokenizer and peaked logits (no greedy ties);
    head_dim 64 gives heads the band strategies (and so the packed kernels) accept; kv_heads 4
    gives each of 2 tensor-parallel ranks 2 KV heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2, tie_word_embeddings=False, initializer_range=0.2)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMOLLM2 / name, out)
    return out




# Lossless K/V read through another attention path agree with dense to ~1e-5 nat per token (fp32
# sums in another order); two tokens closer than this are a tie either side may take.
TIE_NAT = 1e-4


def same_greedy_or_tied(want: dict, got: dict, tol: float = TIE_NAT) -> None:
    """Assert two `/generate` answers (with `top_logprobs_num` >= 2) give the same greedy ids,
    except that they may part at a step where `want`'s best two tokens are within `tol` nat and
    `got` took the runner-up (the rest then follows another prefix and is not compared)."""
    a, b = want["output_ids"], got["output_ids"]
    assert len(a) == len(b), (len(a), len(b))
    split = next((k for k in range(len(a)) if a[k] != b[k]), None)
    if split is None:
        return
    best, second = want["meta_info"]["output_top_logprobs"][split][:2]
    assert best[0] - second[0] < tol and b[split] == second[1], (
        f"parted at step {split} of {len(a)} without a tie: want top-2 {best[:2]}, {second[:2]}; "
        f"got token {b[split]}")
