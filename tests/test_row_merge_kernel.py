"""triton_kernels/row_merge.py: the Triton merge of a request's rows vs its torch reference, on
fresh random inputs (padded row tables, empty rows with NaN outputs, bf16 and fp32 outputs)."""
import pytest
import torch

from mosaickv_kernels.row_merge import merge_rows, merge_rows_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)


def _case(gen, rows_per_req, hq, d, empty_rows=()):
    r = sum(rows_per_req)
    o_rows = torch.randn(r, hq, d, generator=gen)
    lse = torch.randn(r, hq, generator=gen) * 4
    for row in empty_rows:  # attended to nothing: lse -inf, output NaN (0/0 in the kernels)
        lse[row] = float("-inf")
        o_rows[row] = float("nan")
    width = max(rows_per_req)
    table, first = [], 0
    for n in rows_per_req:
        table.append(list(range(first, first + n)) + [r] * (width - n))
        first += n
    return (o_rows.to(DEVICE), lse.to(DEVICE), torch.tensor(table).to(DEVICE))


@pytest.mark.parametrize("rows_per_req,hq,d,empty", [
    ((3, 1, 2), 4, 64, ()), ((1,), 32, 128, ()), ((8, 8, 1, 5), 9, 64, (2, 9)),
    ((2, 4), 6, 80, (0,))])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_merge_rows_matches_reference(rows_per_req, hq, d, empty, out_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    o_rows, lse, table = _case(gen, rows_per_req, hq, d, empty)
    k = len(rows_per_req)
    reqs = torch.randperm(k + 2, generator=gen)[:k].to(DEVICE)  # requests spread over a batch
    got = torch.full((k + 2, hq, d), 7.0, dtype=out_dtype, device=DEVICE)
    want = got.clone()
    merge_rows(o_rows, lse, table, reqs, got)
    merge_rows_reference(o_rows, lse, table, reqs, want)
    assert not got.isnan().any(), f"seed {seed}"
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < (1e-6 if out_dtype == torch.float32 else 5e-3), f"seed {seed}: rel err {err}"
    untouched = torch.ones(k + 2, dtype=torch.bool)
    untouched[reqs.cpu()] = False
    assert (got[untouched.to(DEVICE)] == 7.0).all(), f"seed {seed}: wrote outside `reqs`"


def test_merge_rows_bf16_output_rounds_to_nearest(seed):
    """A bf16 output is the kernel's own fp32 merge rounded to nearest (ties to even), as a GPU
    store rounds it: Triton's interpreter casts fp32 to bf16 by truncating, which on a CPU moved
    every merged decode output toward zero by half a bf16 ulp on average (~50% of elements one
    ulp off, 3.6e-3 relative; the kernel-vs-reference server check's log-probs by up to 0.06)."""
    gen = torch.Generator().manual_seed(seed)
    o_rows, lse, table = _case(gen, (3, 1, 2), 4, 64)
    reqs = torch.arange(3, device=DEVICE)
    got = torch.empty(3, 4, 64, dtype=torch.bfloat16, device=DEVICE)
    fp32 = torch.empty(3, 4, 64, dtype=torch.float32, device=DEVICE)
    merge_rows(o_rows, lse, table, reqs, got)
    merge_rows(o_rows, lse, table, reqs, fp32)
    off = int((got != fp32.to(torch.bfloat16)).sum())
    assert off == 0, f"seed {seed}: {off} of {got.numel()} bf16 outputs not the nearest"


def test_merge_rows_refuses_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    o_rows, lse, table = _case(gen, (2, 1), 4, 64)
    reqs = torch.arange(2, device=DEVICE)
    with pytest.raises(ValueError, match="out must be contiguous"):
        merge_rows(o_rows, lse, table, reqs, torch.empty(2, 64, 4, device=DEVICE).transpose(1, 2))
    with pytest.raises(ValueError, match="lse"):
        merge_rows(o_rows, lse[:1], table, reqs, torch.empty(2, 4, 64, device=DEVICE))
    with pytest.raises(ValueError, match="req_rows must be contiguous torch.int64"):
        merge_rows(o_rows, lse, table.int(), reqs, torch.empty(2, 4, 64, device=DEVICE))
