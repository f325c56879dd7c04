"""benchmarks/plan_bench.py plans what the server would: on its stand-in pool, `begin` gives one
row per basis block of each request, the sealed pages in request order as the segment list, and
the last row of a request its hot tokens."""
import importlib.util
from pathlib import Path

import torch

from mosaickv_sglang.config import MosaicConfig

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_bench.py"
spec = importlib.util.spec_from_file_location("plan_bench", SCRIPT)
plan_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan_bench)


def test_the_stand_in_plan_has_a_row_per_basis_block_and_every_sealed_page():
    cfg = MosaicConfig()
    ps, context = 128, 9000  # 71 pages: 69 sealed in blocks of 32, 32, 5, then 2 hot
    plan, batch, req_to_token = plan_bench.stand_in(2, context, 4, ps, cfg)
    plan.begin(batch, req_to_token)
    st = plan.step
    pages = -(-context // ps)
    assert torch.equal(torch.diff(st.seg_indptr), torch.tensor([32, 32, 5] * 2, dtype=torch.int32))
    want = torch.cat([torch.arange(1, pages - 1), torch.arange(pages + 1, 2 * pages - 1)])
    assert torch.equal(st.seg_ids, want.to(torch.int32))
    assert st.row_req.tolist() == [0, 0, 0, 1, 1, 1]
    assert len({id(b) for b in st.row_bases}) == 6  # each row its own block
    hot = (context - 100) - (pages - 2) * ps
    assert st.hot_lens.tolist() == [0, 0, hot, 0, 0, hot]
    assert st.rows is not None  # 69 sealed pages > the 4096-token budget
