"""triton_kernels/row_copy.py: many pieces (contiguous spans of different tensors, different
dtypes, uint8 -> int32 widened) moved by one launch vs `copy_rows_reference` (torch slices), on
fresh random inputs; nothing outside the pieces written; bad pieces refused."""
import pytest
import torch

from mosaickv_kernels.row_copy import copy_rows, copy_rows_reference, rows_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)


def _tensors(gen, dtype, count, size):
    if dtype == torch.uint8:
        return [torch.randint(0, 256, (size,), dtype=dtype, generator=gen).to(DEVICE)
                for _ in range(count)]
    return [torch.randn(size, generator=gen).to(dtype).to(DEVICE) for _ in range(count)]


@pytest.mark.parametrize("pieces_per_kind", [1, 7, 40])
def test_copy_rows_matches_reference(pieces_per_kind, seed):
    gen = torch.Generator().manual_seed(seed)
    pairs = [(torch.bfloat16, torch.bfloat16, 5000), (torch.int32, torch.int32, 300),
             (torch.float16, torch.float16, 64), (torch.int32, torch.uint8, 100)]
    pieces, dsts = [], []
    for dst_dtype, src_dtype, size in pairs:
        dst = _tensors(gen, dst_dtype, 3, size)
        src = _tensors(gen, src_dtype, 2, size)
        dsts += dst
        for _ in range(pieces_per_kind):
            n = int(torch.randint(1, size // 4, (), generator=gen))
            pieces.append((dst[int(torch.randint(0, 3, (), generator=gen))],
                           int(torch.randint(0, size - n + 1, (), generator=gen)),
                           src[int(torch.randint(0, 2, (), generator=gen))],
                           int(torch.randint(0, size - n + 1, (), generator=gen)), n))
    before = [t.clone() for t in dsts]
    # later pieces may overwrite earlier ones in one launch, in any order: keep one per dst span
    seen, unique = [], []
    for p in pieces:
        if all(q[0] is not p[0] or q[1] + q[4] <= p[1] or p[1] + p[4] <= q[1] for q in seen):
            seen.append(p)
            unique.append(p)
    copy_rows(rows_for(unique).to(DEVICE), max(int(r[2]) for r in rows_for(unique)))
    got = [t.clone() for t in dsts]
    for t, b in zip(dsts, before):
        t.copy_(b)
    copy_rows_reference(unique)
    for i, (g, want) in enumerate(zip(got, dsts)):
        assert torch.equal(g.view(torch.uint8), want.view(torch.uint8)), f"seed {seed}: tensor {i}"
    assert any(not torch.equal(g, b) for g, b in zip(got, before)), f"seed {seed}: nothing copied"


def test_rows_for_refuses_bad_pieces():
    a = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    b = torch.zeros(16, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="runs past"):
        rows_for([(a, 10, a, 0, 8)])
    with pytest.raises(ValueError, match="cannot copy"):
        rows_for([(a, 0, b, 0, 4)])
    with pytest.raises(ValueError, match="cannot copy"):
        rows_for([(torch.zeros(4, dtype=torch.uint8, device=DEVICE), 0,
                   torch.zeros(4, dtype=torch.uint8, device=DEVICE), 0, 4)])
    with pytest.raises(ValueError, match="int64"):
        copy_rows(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), 1)


def test_kernel_compiles_for_the_h200(compile_sm90):
    from mosaickv_kernels.row_copy import BLOCK, _copy_rows_kernel
    assert "cubin" in compile_sm90(_copy_rows_kernel, {"rows": "*i64"}, {"BLOCK": BLOCK})
