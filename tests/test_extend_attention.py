"""prefill_attention.extend_attention (prefill of a chunk over a request's whole sequence) vs attention with
an explicit bottom-right causal mask, on fresh random inputs: fresh prompts, chunks after a prefix,
GQA and MHA, fp32 and (on a GPU, where SDPA takes its flash kernel) bf16; on a GPU with FlashInfer
its prefill kernel (`prefill_attention: flashinfer` or `auto`) on the same inputs, keys head-major as the
backend passes them, queries as strided views; `prefill_attention_kernel`'s choices."""
import importlib.util

import pytest
import torch

from mosaickv_sglang.serving.prefill_attention import chunk_attention, extend_attention, \
    prefill_attention_kernel

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


HAS_FLASHINFER = DEVICE == "cuda" and importlib.util.find_spec("flashinfer") is not None


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs CUDA and FlashInfer")
@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (9, 3, 64), (4, 4, 128)])
@pytest.mark.parametrize("n,s", [(37, 37), (16, 300), (129, 400), (1, 50), (512, 3000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # (each dtype and head dim: a JIT build)
def test_flashinfer_prefill_matches_masked_reference(seed, hq, hk, d, n, s, dtype):
    # queries as the backend passes them: a head-major view of token-major storage
    q = torch.randn(n, hq, d, device=DEVICE).to(dtype).transpose(0, 1)
    keys = torch.randn(hk, s, d, device=DEVICE).to(dtype)
    values = torch.randn(hk, s, d, device=DEVICE).to(dtype)
    got = extend_attention(q, keys, values, d ** -0.5, "flashinfer")
    want = reference(q, keys, values, d ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    assert_rel_close(got.float(), want, 2e-2, f"flashinfer n={n} s={s}", seed)


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs CUDA and FlashInfer")
@pytest.mark.parametrize("per_page", [False, True])
def test_chunk_attention_flashinfer_matches_sdpa(seed, per_page):
    """A chunk after a compressed prefix (the backend's views of token-major pool tensors), in
    one run (chunk rule) or per page (position rule): FlashInfer == SDPA within bf16 noise."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    page, hq, hk, d, first, n = 64, 16, 4, 128, 1024, 300
    rule = (lambda t: max(t - 64, 0) // page) if per_page else (lambda t: first // page)  # noqa: E731
    ja, jc = rule(first), rule(first + n - 1)
    nhd = lambda t, h: torch.randn(t, h, d, device=DEVICE, generator=g).bfloat16()  # noqa: E731
    q = nhd(n, hq).transpose(0, 1)
    kc, vc = (nhd(jc * page, hk).transpose(0, 1) for _ in range(2))
    kd, vd = (nhd(first + n - ja * page, hk).transpose(0, 1) for _ in range(2))
    read = torch.tensor([rule(t) for t in range(first, first + n)])
    args = (q, kc, vc, kd, vd, first, read, ja, page, d ** -0.5, per_page)
    got = chunk_attention(*args, kernel="flashinfer")
    want = chunk_attention(*args, kernel="sdpa")
    assert_rel_close(got.float(), want.float(), 2e-2, f"chunk per_page={per_page}", seed)


def test_prefill_attention_kernel_choices():
    assert prefill_attention_kernel("sdpa", "cpu", torch.float32) == "sdpa"
    assert prefill_attention_kernel("auto", "cpu", torch.bfloat16) == "sdpa"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        prefill_attention_kernel("flashinfer", "cpu", torch.bfloat16)
    if DEVICE == "cuda":
        assert prefill_attention_kernel("auto", "cuda", torch.float32) == "sdpa"
        with pytest.raises(ValueError, match="fp16/bf16"):
            prefill_attention_kernel("flashinfer", "cuda", torch.float32)
        assert prefill_attention_kernel("auto", "cuda", torch.bfloat16) == \
            ("flashinfer" if HAS_FLASHINFER else "sdpa")


def test_flashinfer_call_convention_on_the_cpu(monkeypatch, seed):
    """The FlashInfer path's arguments, checked without a GPU through a stand-in module with
    FlashInfer's documented contract for single_prefill_with_kv_cache (q [qo_len, Hq, D]; NHD
    keys [kv_len, Hk, D]; causal aligned to the bottom right): the keys must arrive token-major
    (its sm90 path reads k.size(0) / k.size(1) as length / heads whatever the layout argument),
    Hq a multiple of Hk, the scale passed through; the result must equal the SDPA path's."""
    import sys
    import types

    calls = []

    def single_prefill_with_kv_cache(q, k, v, causal=False, kv_layout="NHD", sm_scale=None,
                                     **kw):
        assert kv_layout == "NHD" and causal and not kw, (kv_layout, causal, kw)
        kv_len, hk = k.size(0), k.size(1)  # as the sm90 kernel reads them
        assert q.size(1) % hk == 0 and v.shape == k.shape and q.size(2) == k.size(2)
        calls.append((q.shape, k.shape, k.stride(), sm_scale))
        return reference(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                         sm_scale).transpose(0, 1).to(q.dtype)

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        single_prefill_with_kv_cache=single_prefill_with_kv_cache))
    g = torch.Generator().manual_seed(seed)
    hq, hk, d, n, s = 8, 2, 16, 20, 70
    q = torch.randn(n, hq, d, generator=g).transpose(0, 1)  # the backend's view
    keys, values = (torch.randn(hk, s, d, generator=g) for _ in range(2))
    got = extend_attention(q, keys, values, 0.3, "flashinfer")
    assert calls and calls[0][1] == (s, hk, d), calls  # token-major shape, head-major strides
    assert calls[0][3] == 0.3
    assert got.shape == q.shape
    torch.testing.assert_close(got, extend_attention(q, keys, values, 0.3, "sdpa"),
                               atol=1e-5, rtol=1e-5)


class _PagedPrefillStandIn:
    """FlashInfer's documented contract for BatchPrefillWithPagedKVCacheWrapper (NHD): plan with
    host int32 qo_indptr / paged_kv_indptr / paged_kv_indices / last_page_len; run(q [nnz,
    Hq, D], (k_cache, v_cache) [pages, page, Hk, D]): request r's queries q[qo_indptr[r] ..
    qo_indptr[r + 1]) attend causally, aligned bottom right, to the tokens of its pages in
    order, the last one holding last_page_len[r] tokens."""
    instances = []

    def __init__(self, workspace, kv_layout="NHD"):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.plans = 0
        self.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hk, d, page,
             causal=False, sm_scale=None, q_data_type=None, kv_data_type=None, **kw):
        for t in (qo_indptr, kv_indptr, kv_indices, last_page_len):
            assert t.dtype == torch.int32 and t.device.type == "cpu"
        assert causal and hq % hk == 0 and set(kw) <= {"disable_split_kv"}, kw
        assert kw.get("disable_split_kv"), "split-KV makes a run's bits depend on its batch"
        assert ((last_page_len >= 1) & (last_page_len <= page)).all()
        self.args = (qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.tolist(),
                     last_page_len.tolist(), page, sm_scale)
        self.plans += 1

    def run(self, q, paged_kv_cache, out=None):
        qo, kvp, ind, last, page, scale = self.args
        k_cache, v_cache = paged_kv_cache
        assert q.shape[0] == qo[-1] and k_cache.shape[1] == page
        res = torch.empty_like(q)
        for r in range(len(qo) - 1):
            pages = ind[kvp[r]:kvp[r + 1]]
            n_kv = (len(pages) - 1) * page + last[r]
            keys, values = (c[pages].flatten(0, 1)[:n_kv].transpose(0, 1)
                            for c in (k_cache, v_cache))
            res[qo[r]:qo[r + 1]] = reference(q[qo[r]:qo[r + 1]].transpose(0, 1), keys, values,
                                             scale).transpose(0, 1).to(q.dtype)
        if out is not None:
            out.copy_(res)
            return out
        return res


@pytest.mark.parametrize("window", [16, 0])
def test_chunk_attention_flashinfer_convention_on_the_cpu(monkeypatch, seed, window):
    """The batched path's page tables, checked without a GPU through a stand-in with FlashInfer's
    documented paged-prefill contract: a chunk after a prefix, per page (the position rule,
    with and without a dense window), equals the SDPA path run by run, in one plan."""
    import sys
    import types

    _PagedPrefillStandIn.instances.clear()
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_PagedPrefillStandIn))
    g = torch.Generator().manual_seed(seed)
    hq, hk, d = 8, 2, 16
    page, first, m = 16, 64, 40
    rule = lambda t: max(t - window, 0) // page  # noqa: E731  (window 16: 3, 4, 5 pages)
    ja, jc = rule(first), rule(first + m - 1)
    kc, vc = (torch.randn(hk, jc * page, d, generator=g) for _ in range(2))
    kd, vd = (torch.randn(hk, first + m - ja * page, d, generator=g) for _ in range(2))
    qc = torch.randn(hq, m, d, generator=g)
    read = torch.tensor([rule(t) for t in range(first, first + m)])
    args = (qc, kc, vc, kd, vd, first, read, ja, page, 0.25, True)
    torch.testing.assert_close(chunk_attention(*args, kernel="flashinfer"),
                               chunk_attention(*args, kernel="sdpa"), atol=1e-5, rtol=1e-5)
    fi = _PagedPrefillStandIn.instances[-1]
    assert fi.plans == 1 and len(fi.args[0]) - 1 == 3  # one plan, a run per page (pages 4-6)
