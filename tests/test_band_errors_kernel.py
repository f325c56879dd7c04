"""The chooser's error check on the GPU (mosaickv_kernels.band_errors) against the codec's own
encode and decode, and the errors-first chooser against the cascade: the same picks, reasons,
bytes and reconstructions on fresh random segments (every default candidate, rescue and the
dense fallback in play). On a CPU the kernel runs in Triton's interpreter (conftest.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mosaickv_kernels.band_errors import band_errors, band_errors_reference
from mosaickv_sglang.codec.layer import (Candidates, _choose_batch, _errors, seal_segments,
                                         use_errors_first)
from mosaickv_sglang.codec.strategies import parse_strategy
from mosaickv_sglang.config import (DEFAULT_K_CANDIDATES, DEFAULT_RESCUE_CANDIDATES,
                                    DEFAULT_SINK_CANDIDATES, DEFAULT_V_CANDIDATES, MosaicConfig)

from conftest import repro

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPECS = sorted(set(DEFAULT_K_CANDIDATES + DEFAULT_V_CANDIDATES + DEFAULT_SINK_CANDIDATES +
                   DEFAULT_RESCUE_CANDIDATES)) + ["band:b8=0,b4=0,b2=32,group=32"]


def _segments(n: int, h: int, s: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Random rotated-like segments: energy falling over the channels, uneven per segment and
    head, a few outliers (so candidates' errors spread around the budgets)."""
    decay = torch.exp(-torch.arange(d) / (d / 4))
    x = torch.randn(n, h, s, d, generator=gen) * decay
    x *= torch.rand(n, h, 1, 1, generator=gen) * 3 + 0.1
    spikes = torch.rand(n, h, s, d, generator=gen) < 0.002
    return (x + spikes * torch.randn(n, h, s, d, generator=gen) * 20).to(DEVICE)


@pytest.mark.parametrize("d", [64, 128])
def test_errors_match_the_codec(d, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _segments(3, 2, 128, d, gen).reshape(6, 128, d).contiguous()
    for spec in SPECS:
        st = parse_strategy(spec)
        err2, norm2 = band_errors(x, st.widths(d))
        want_err2, want_norm2 = band_errors_reference(x, st)
        torch.testing.assert_close(err2, want_err2, rtol=2e-5, atol=1e-6,
                                   msg=lambda m: f"{spec} d={d}: {m} {repro(seed)}")
        torch.testing.assert_close(norm2, want_norm2, rtol=2e-5, atol=1e-6,
                                   msg=lambda m: f"{spec} d={d}: {m} {repro(seed)}")


def test_bad_input_is_refused():
    x = torch.zeros(2, 128, 64, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        band_errors(x.double(), (8, 24, 16, 64))
    with pytest.raises(ValueError, match="group"):
        band_errors(x, (8, 24, 16, 48))
    with pytest.raises(ValueError, match="group"):
        band_errors(x, (8, 24, 16, 16))  # not a multiple of the kernel's 32-token chunk


def _near_ties(x, x_rot, cands, budget) -> np.ndarray:
    """Segments whose error under some candidate is within float32 rounding of the budget
    (either chooser may judge them on either side)."""
    near = np.zeros(x.shape[0], dtype=bool)
    for st in cands:
        src = x_rot if st.rot else x
        _, dec = st.encode_decoded(src.reshape(-1, *src.shape[2:]), "k")
        e = _errors(dec.reshape(src.shape), src).cpu().numpy()
        near |= np.abs(e - budget) < 1e-5 * budget
    return near


@pytest.mark.parametrize("kind", ["k", "v"])
def test_errors_first_picks_what_the_cascade_picks(kind, seed):
    gen = torch.Generator().manual_seed(seed)
    n, h, s, d = 24, 2, 128, 64
    x = _segments(n, h, s, d, gen)
    x_rot = x  # the chooser's rotated input; rotation plays no part in the pick
    cands = [parse_strategy(sp) for sp in (DEFAULT_K_CANDIDATES if kind == "k"
                                           else DEFAULT_V_CANDIDATES)]
    rescue = [parse_strategy(sp) for sp in DEFAULT_RESCUE_CANDIDATES]
    dense = parse_strategy("dense")
    # a budget between the candidates' errors: every candidate, the rescue and dense get picked
    errs = []
    for st in cands:
        _, dec = st.encode_decoded(x.reshape(n * h, s, d), kind)
        errs.append(_errors(dec.reshape(n, h, s, d), x).cpu().numpy())
    budget = float(np.quantile(np.concatenate(errs), 0.45))
    want, want_dec = _choose_batch(x, x_rot, kind, cands, budget, "within-budget", dense,
                                   need_decoded=True, rescue=rescue)
    got, got_dec = _choose_batch(x, x_rot, kind, cands, budget, "within-budget", dense,
                                 need_decoded=True, rescue=rescue, errors_first=True)
    ok = ~_near_ties(x, x_rot, cands + rescue, budget)
    picks = [want.spec_reason(i) for i in range(n)]
    assert len({p for p in picks}) >= 3, f"the budget should spread the picks: {picks}"
    for i in np.nonzero(ok)[0].tolist():
        assert got.spec_reason(i) == want.spec_reason(i), (i, repro(seed))
        a, b = got[i], want[i]
        assert a.encoded.tensors.keys() == b.encoded.tensors.keys()
        for name in a.encoded.tensors:
            assert torch.equal(a.encoded.tensors[name], b.encoded.tensors[name]), (i, name)
        assert abs(a.error - b.error) <= 1e-5 * max(b.error, 1e-6), (i, a.error, b.error)
        assert torch.equal(got_dec[i], want_dec[i]), (i, repro(seed))
    np.testing.assert_array_equal(got.row_bytes()[ok], want.row_bytes()[ok])


def test_seal_segments_errors_first_gives_the_cascades_segments(seed):
    """Through `seal_segments` with the default candidates and budgets (sink segments too): the
    same headers, chosen strategies and page metadata (near ties aside)."""
    gen = torch.Generator().manual_seed(seed)
    n, h, s, d = 6, 2, 128, 64
    k, v = (_segments(n, h, s, d, gen) for _ in range(2))
    basis = torch.linalg.qr(torch.randn(n, h, d, d, generator=gen))[0].to(torch.bfloat16)
    basis = basis.to(DEVICE)
    out = {}
    for chooser in ("cascade", "errors_first"):
        cfg = MosaicConfig(chooser=chooser)
        cands = Candidates.from_config(cfg)
        for sink in (False, True):
            out[chooser, sink] = seal_segments(k, v, basis, basis, 0, list(range(n)), cfg, cands,
                                               sink, True)
    for sink in (False, True):
        a, b = out["errors_first", sink], out["cascade", sink]
        torch.testing.assert_close(a.headers, b.headers, rtol=0, atol=0)
        assert [a.kinds(i) for i in range(n)] == [b.kinds(i) for i in range(n)], repro(seed)
        for f in ("lo", "hi", "rest_norm"):
            torch.testing.assert_close(getattr(a.meta, f), getattr(b.meta, f), rtol=0, atol=0)


def test_which_chooser_runs():
    x = torch.zeros(2, 1, 128, 64)
    bands = [parse_strategy(sp) for sp in DEFAULT_K_CANDIDATES]
    rescue = [parse_strategy(sp) for sp in DEFAULT_RESCUE_CANDIDATES]
    assert not use_errors_first("cascade", x, bands, rescue)
    assert use_errors_first("auto", x, bands, rescue) == x.is_cuda  # the cascade on a CPU
    assert use_errors_first("errors_first", x, bands, rescue)
    odd = [parse_strategy("band:b8=8,b4=24,b2=16,group=16")]
    assert not use_errors_first("auto", x.cuda() if torch.cuda.is_available() else x, odd, ())
    with pytest.raises(ValueError, match="errors_first"):
        use_errors_first("errors_first", x, odd, ())
    with pytest.raises(ValueError, match="chooser"):
        MosaicConfig(chooser="fastest")
