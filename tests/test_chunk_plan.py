"""A prefill forward's chunk attention in one plan (`ChunkAttention`, `plan_chunks`,
`gather_chunks`): several requests' chunks (chunk rule and position rule, with and without a
compressed prefix) in one batched run give each query the bits it gets in its request's own
call (the reference on the CPU; FlashInfer's batch prefill on a GPU, also against SDPA);
bad plans are refused; a forward's layers share one plan."""
import importlib.util

import pytest
import torch

from mosaickv_sglang.serving.prefill_attention import ChunkAttention, chunk_attention, \
    gather_chunks, plan_chunks

from conftest import assert_rel_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_FLASHINFER = DEVICE == "cuda" and importlib.util.find_spec("flashinfer") is not None
KERNELS = ["sdpa"] + (["flashinfer"] if HAS_FLASHINFER else [])


def _requests(g, page, hk, d, dtype, window, per_page):
    """Three requests' chunks: a fresh prompt, a chunk after a prefix, a short final chunk;
    each (first, n, read, ja, jc) with token-major kc, vc, kd, vd."""
    out = []
    for first, n in ((0, 3 * page + 5), (4 * page, 2 * page), (6 * page, 7)):
        if per_page:
            rule = lambda t: max(t - window, 0) // page  # noqa: E731
        else:
            rule = lambda t, f=first: f // page  # noqa: E731
        ja, jc = rule(first), rule(first + n - 1)
        read = torch.tensor([rule(t) for t in range(first, first + n)])
        mk = lambda rows: torch.randn(rows, hk, d, generator=g, device=DEVICE).to(dtype)  # noqa: E731
        kc, vc = mk(jc * page), mk(jc * page)
        kd, vd = mk(first + n - ja * page), mk(first + n - ja * page)
        out.append(((first, n, read, ja, jc), (kc, vc, kd, vd)))
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("per_page,window", [(True, 0), (True, 16), (False, 0)])
def test_a_batch_gives_each_query_its_own_bits(seed, kernel, per_page, window):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    page, hq, hk, d = 16, 8, 2, 64
    dtype = torch.bfloat16 if kernel == "flashinfer" else torch.float32
    reqs = _requests(g, page, hk, d, dtype, window, per_page)
    qs = [torch.randn(spec[1], hq, d, generator=g, device=DEVICE).to(dtype) for spec, _ in reqs]
    runner = ChunkAttention(kernel)
    specs = [spec for spec, _ in reqs]
    plan = runner.plan(specs, page, per_page, (hq, hk, d), dtype, 0.125, DEVICE)
    k = gather_chunks(plan, [t[0] for _, t in reqs], [t[2] for _, t in reqs])
    v = gather_chunks(plan, [t[1] for _, t in reqs], [t[3] for _, t in reqs])
    got = runner.run(plan, torch.cat(qs), k, v, 0.125)
    start = 0
    for (spec, (kc, vc, kd, vd)), q in zip(reqs, qs):
        first, n, read, ja, _ = spec
        alone = chunk_attention(q.transpose(0, 1), kc.transpose(0, 1), vc.transpose(0, 1),
                                kd.transpose(0, 1), vd.transpose(0, 1), first, read, ja, page,
                                0.125, per_page, kernel).transpose(0, 1)
        part = got[start:start + n]
        differ = (part != alone).any(-1).any(-1).nonzero().flatten().tolist()
        assert not differ, (f"seed {seed}, {kernel}, request at {first}: queries {differ[:8]} "
                            "differ in a batch from their request alone")
        if kernel == "flashinfer":  # and the batch kernel against the reference
            want = chunk_attention(q.transpose(0, 1).float(), *(x.transpose(0, 1).float()
                                   for x in (kc, vc, kd, vd)), first, read, ja, page, 0.125,
                                   per_page, "sdpa").transpose(0, 1)
            assert_rel_close(part.float(), want, 2e-2, f"flashinfer request at {first}", seed)
        start += n


def test_plans_are_checked_and_shared_by_key():
    page = 16
    read = torch.tensor([2, 2, 1])
    with pytest.raises(ValueError, match="non-decreasing"):
        plan_chunks([(40, 3, read, 1, 2)], page, True)
    with pytest.raises(ValueError, match="outside"):  # reads 3 pages, only 2 compressed
        plan_chunks([(48, 2, torch.tensor([3, 3]), 2, 2)], page, True)
    with pytest.raises(ValueError, match="read has"):
        plan_chunks([(48, 3, torch.tensor([3, 3]), 2, 3)], page, True)
    plan = plan_chunks([(32, 20, torch.tensor([2] * 16 + [3] * 4), 2, 3)], page, True)
    # two runs: page 2 (2 compressed + its own dense page), page 3 (3 + the 4 tokens of page 3)
    assert plan.qo_indptr.tolist() == [0, 16, 20]
    assert plan.kv_indices.tolist() == [0, 1, 3, 0, 1, 2, 4]
    assert plan.last_page_len.tolist() == [16, 4] and plan.pages == 5
    runner = ChunkAttention("sdpa")
    spec = [(32, 20, torch.tensor([2] * 16 + [3] * 4), 2, 3)]
    a = runner.plan(spec, page, True, (4, 2, 8), torch.float32, 0.5, "cpu", key=("k",))
    assert runner.plan(spec, page, True, (4, 2, 8), torch.float32, 0.5, "cpu", key=("k",)) is a
    assert runner.plan(spec, page, True, (4, 2, 8), torch.float32, 0.5, "cpu", key=("j",)) is not a
    with pytest.raises(ValueError, match="unknown kernel"):
        ChunkAttention("triton")
    with pytest.raises(ValueError, match="dense rows"):
        gather_chunks(a, [torch.zeros(48, 2, 8)], [torch.zeros(19, 2, 8)])
