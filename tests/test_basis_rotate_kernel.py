"""triton_kernels/basis_rotate.py: rows through their bases read by address (into the K basis,
back from the V basis with the hot output added) vs the torch reference, on fresh random bases
and inputs, identity rows among them, GQA groups of 1-8 and head_dim 64/128."""
import pytest
import torch

from mosaickv_kernels.basis_rotate import basis_pointers, rotate_rows, rotate_rows_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)


@pytest.mark.parametrize("rows,h,g,d,layers", [(3, 2, 4, 64, 3), (5, 8, 1, 128, 2),
                                               (1, 4, 8, 128, 1)])
@pytest.mark.parametrize("back", [False, True])
def test_rotate_rows_matches_reference(rows, h, g, d, layers, back, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(2 * layers, h, d, d, generator=gen).bfloat16().to(DEVICE)
              for _ in range(2)]
    # rows point at either block or at nothing (the identity), in a random order
    pick = torch.randint(0, 3, (rows,), generator=gen).tolist()
    wholes = [None if p == 2 else blocks[p] for p in pick]
    if all(w is None for w in wholes):
        wholes[0] = blocks[1]
    ptrs, keep = basis_pointers(wholes, DEVICE)
    assert len(keep) == sum(w is not None for w in wholes)
    x = torch.randn(rows, h, g, d, generator=gen).to(DEVICE)
    add = torch.randn(rows, h, g, d, generator=gen).to(DEVICE) if back else None
    for layer in range(layers):
        offset = ((layers + layer) if back else layer) * h  # V bases of a layer, or K
        got = rotate_rows(x, ptrs, offset, back=back, add=add)
        want = rotate_rows_reference(x, wholes, offset, back=back, add=add)
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-5, (layer, err, f"seed {seed}")
        for i, w in enumerate(wholes):  # an identity row is passed through exactly
            if w is None:
                assert torch.equal(got[i], x[i] if add is None else x[i] + add[i]), f"seed {seed}"


def test_rotate_rows_refuses_what_it_cannot_read():
    x = torch.zeros(2, 1, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="ptrs must be int64"):
        rotate_rows(x, torch.zeros(3, dtype=torch.int64, device=DEVICE), 0, back=False)
    with pytest.raises(ValueError, match="power of two"):
        rotate_rows(torch.zeros(1, 1, 1, 80, device=DEVICE),
                    torch.zeros(1, dtype=torch.int64, device=DEVICE), 0, back=False)
    with pytest.raises(ValueError, match="contiguous bf16"):
        basis_pointers([torch.zeros(2, 1, 64, 64, device=DEVICE)], DEVICE)  # fp32
