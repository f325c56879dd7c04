"""Helpers for the end-to-end tests: the package's server launcher plus a tiny random model."""
import shutil
from pathlib import Path

from mosaickv_sglang.launch import (SMOLLM2, flush_cache, free_port, mosaickv_stats,  # noqa: F401
                                    request, running_server, server_env, stop)

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


