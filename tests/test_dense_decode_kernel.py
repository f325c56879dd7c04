"""triton_kernels/dense_decode.py: the hot-buffer partial over a gathered [B, H, T, D] copy and
over the buffers themselves through a row table, vs the torch reference, on fresh random
inputs (empty requests, GQA groups 1-8, head_dim 64/128)."""
import pytest
import torch

from mosaickv_kernels.dense_decode import dense_decode_partial, dense_decode_partial_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)


@pytest.mark.parametrize("bsz,h,g,d", [(3, 2, 4, 64), (2, 8, 1, 128), (4, 1, 8, 64)])
def test_indexed_and_gathered_hot_partials_match_reference(bsz, h, g, d, seed):
    gen = torch.Generator().manual_seed(seed)
    n_rows, t = 300, 70
    kbuf = torch.randn(n_rows, h, d, generator=gen).bfloat16().to(DEVICE)
    vbuf = torch.randn(n_rows, h, d, generator=gen).bfloat16().to(DEVICE)
    lens = torch.randint(1, t + 1, (bsz,), generator=gen, dtype=torch.int32)
    lens[0] = 0  # a request without hot tokens
    rows = torch.zeros(bsz, t, dtype=torch.long)
    for b in range(bsz):
        rows[b, :int(lens[b])] = torch.randperm(n_rows, generator=gen)[:int(lens[b])]
    rows, lens = rows.to(DEVICE), lens.to(DEVICE)
    q = (torch.randn(bsz, h, g, d, generator=gen) * d ** -0.5).to(DEVICE)
    got = dense_decode_partial(q, kbuf, vbuf, lens, rows=rows)
    gathered = [buf[rows].permute(0, 2, 1, 3).contiguous() for buf in (kbuf, vbuf)]
    copy = dense_decode_partial(q, *gathered, lens)
    want = dense_decode_partial_reference(q, kbuf, vbuf, lens, rows)
    for name, a, b, w in zip(("m", "l", "acc"), got, copy, want):
        assert torch.equal(a, b), (name, f"seed {seed}")  # same loads, same order: same bits
        fin = torch.isfinite(w)
        assert torch.equal(fin, torch.isfinite(a)), (name, f"seed {seed}")
        err = float((a[fin] - w[fin]).abs().max() / w[fin].abs().max().clamp_min(1e-6))
        assert err < 1e-4, (name, err, f"seed {seed}")
    assert float(got[1][0].abs().max()) == 0 and bool((got[0][0] == float("-inf")).all())


def test_indexed_partial_refuses_a_wrong_row_table():
    q = torch.zeros(2, 1, 1, 64, device=DEVICE)
    buf = torch.zeros(10, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="rows must be contiguous int64"):
        dense_decode_partial(q, buf, buf, lens, rows=torch.zeros(3, 4, dtype=torch.long,
                                                                 device=DEVICE))
    with pytest.raises(ValueError, match=r"with rows, k must be"):
        dense_decode_partial(q, buf.view(10, 1, 1, 64), buf, lens,
                             rows=torch.zeros(2, 4, dtype=torch.long, device=DEVICE))
