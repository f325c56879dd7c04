"""A token's arithmetic does not depend on what was computed with it (docs/determinism.md).

* a prefill chunk's attention (`chunk_attention`) gives every query the same bits whatever the
  (page-aligned) chunk boundaries: a request's prompt computed in other chunks under load;
* the CPU platform's linear layers (`platform_cpu.pad_rows`) give a row the same bits in a
  batch of 1 as among 64 rows: a decode batch of 1 (alone) or of 12 (under load).
"""
import importlib.util

import pytest
import torch

from mosaickv_sglang.serving.prefill_attention import chunk_attention

PAGE, HQ, HK, D = 32, 4, 2, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the reference everywhere; FlashInfer's batch prefill (the server's kernel on CUDA) on a GPU
KERNELS = ["sdpa"] + (["flashinfer"] if DEVICE == "cuda"
                      and importlib.util.find_spec("flashinfer") is not None else [])


def _prefill(q, k, v, kz, vz, chunks, window, kernel="sdpa"):
    """The prompt's attention output [HQ, T, D] computed chunk by chunk as the backend does:
    each chunk reads compressed (kz, vz) the pages its last token reads compressed, and dense
    (k, v) the tokens from the page its first token reads compressed on."""
    rule = lambda t: max(t - window, 0) // PAGE  # noqa: E731
    out, start = [], 0
    for end in chunks:
        ja, jc = rule(start), rule(end - 1)
        read = torch.tensor([rule(t) for t in range(start, end)])
        out.append(chunk_attention(q[:, start:end], kz[:, :jc * PAGE], vz[:, :jc * PAGE],
                                   k[:, ja * PAGE:end], v[:, ja * PAGE:end], start, read, ja,
                                   PAGE, 0.25, kernel=kernel))
        start = end
    return torch.cat(out, 1)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("window", [0, PAGE])
def test_chunk_attention_does_not_depend_on_chunking(window, seed, kernel):
    dev, dt = ("cuda", torch.bfloat16) if kernel == "flashinfer" else ("cpu", torch.float32)
    hd = 64 if kernel == "flashinfer" else D  # (a head dim FlashInfer builds)
    g = torch.Generator(device=dev).manual_seed(seed)
    t = 9 * PAGE + 13
    q = torch.randn(HQ, t, hd, generator=g, device=dev).to(dt)
    k, v = (torch.randn(HK, t, hd, generator=g, device=dev).to(dt) for _ in range(2))
    # the compressed pages' read-back: the dense K/V plus a codec's error
    kz, vz = ((x + 0.01 * torch.randn(x.shape, generator=g, device=dev)).to(dt) for x in (k, v))
    chunkings = [[t], [4 * PAGE, 8 * PAGE, t], [PAGE, 2 * PAGE, 5 * PAGE, t],
                 [2 * PAGE, 3 * PAGE, t], [PAGE * i for i in range(1, 10)] + [t]]
    want = _prefill(q, k, v, kz, vz, chunkings[0], window, kernel)
    for chunks in chunkings[1:]:
        got = _prefill(q, k, v, kz, vz, chunks, window, kernel)
        differ = (got != want).any(0).any(-1).nonzero().flatten().tolist()
        assert not differ, (f"seed {seed}, {kernel}, window {window}, chunks {chunks}: positions "
                            f"{differ[:8]} differ from the whole prompt in one chunk")


@pytest.mark.parametrize("k_in,n_out", [(64, 512), (256, 64), (576, 960), (64, 49152)])
def test_pad_rows_makes_a_row_independent_of_the_batch(k_in, n_out):
    from mosaickv_sglang.integration import platform_cpu  # noqa: PLC0415 (imports SGLang)

    g = torch.Generator().manual_seed(k_in + n_out)
    w = torch.randn(n_out, k_in, generator=g) * 0.1
    x = torch.randn(64, k_in, generator=g)
    linear = lambda rows: torch.nn.functional.linear(rows, w)  # noqa: E731
    full = linear(x)
    for m in range(1, 21):
        for first in (0, 7):
            got = platform_cpu.pad_rows(linear, x[first:first + m])
            assert torch.equal(got, full[first:first + m]), (
                f"[{k_in} -> {n_out}] rows {first}..{first + m - 1} alone differ from the same "
                f"rows among 64: this CPU's GEMM kernels need more than "
                f"MIN_GEMM_ROWS={platform_cpu.MIN_GEMM_ROWS} rows to be batch invariant")
    # a 3-D input keeps its shape
    assert platform_cpu.pad_rows(linear, x[:3].view(1, 3, k_in)).shape == (1, 3, n_out)
