"""backend.extend_attention (prefill of a chunk over a request's whole sequence) vs attention with
an explicit bottom-right causal mask, on fresh random inputs: fresh prompts, chunks after a prefix,
GQA and MHA, fp32 and (on a GPU, where SDPA takes its flash kernel) bf16."""
import pytest
import torch

from mosaickv_sglang.serving.backend import extend_attention

from conftest import assert_rel_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, keys, values, scale):
    group = q.shape[0] // keys.shape[0]
    k, v = keys.float().repeat_interleave(group, 0), values.float().repeat_interleave(group, 0)
    n, s = q.shape[1], keys.shape[1]
    scores = torch.einsum("hnd,hsd->hns", q.float(), k) * scale
    visible = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]  # new token j at s-n+j
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hns,hsd->hnd", scores.softmax(-1), v)


@pytest.mark.parametrize("hq,hk,d", [(8, 2, 64), (4, 4, 32), (9, 3, 64)])
@pytest.mark.parametrize("n,s", [(37, 37), (16, 300), (129, 400), (1, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEVICE == "cuda"
                         else [torch.float32])
def test_extend_attention_matches_masked_reference(seed, hq, hk, d, n, s, dtype):
    q = torch.randn(hq, n, d, device=DEVICE).to(dtype)
    keys = torch.randn(hk, s, d, device=DEVICE).to(dtype)
    values = torch.randn(hk, s, d, device=DEVICE).to(dtype)
    got = extend_attention(q, keys, values, d ** -0.5)
    want = reference(q, keys, values, d ** -0.5)
    assert got.dtype == dtype
    assert_rel_close(got.float(), want, 2e-2 if dtype == torch.bfloat16 else 1e-5,
                     f"extend n={n} s={s}", seed)
