"""The chooser's error check on the GPU (mosaickv_kernels.band_errors) against the codec's own
encode and decode, and the errors-first chooser against the cascade: the same picks, reasons,
bytes and reconstructions on fresh random segments (every default candidate, rescue and the
dense fallback in play). On a CPU the kernel runs in Triton's interpreter (conftest.py)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mosaickv_kernels.band_errors import band_errors, band_errors_reference
from mosaickv_sglang.codec.layer import (Candidates, _choose_batch, _errors, seal_segments,
                                         use_errors_first)
from mosaickv_sglang.codec.strategies import parse_strategy
from mosaickv_sglang.config import (DEFAULT_K_CANDIDATES, DEFAULT_RESCUE_CANDIDATES,
                                    DEFAULT_SINK_CANDIDATES, DEFAULT_V_CANDIDATES, MosaicConfig)

from conftest import LaunchRecorder, repro

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPECS = sorted(set(DEFAULT_K_CANDIDATES + DEFAULT_V_CANDIDATES + DEFAULT_SINK_CANDIDATES +
                   DEFAULT_RESCUE_CANDIDATES)) + ["band:b8=0,b4=0,b2=32,group=32"]


def _segments(n: int, h: int, s: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Random rotated-like segments (energy falling over the channels) whose outliers grow over
    the batch, from none to frequent and large: relative errors from tiny to large, so budgets
    between them spread the picks over every candidate, the rescue and dense."""
    decay = torch.exp(-torch.arange(d) / (d / 4))
    x = torch.randn(n, h, s, d, generator=gen) * decay
    rate = torch.linspace(0, 0.08, n)[:, None, None, None]
    size = torch.linspace(0, 40, n)[:, None, None, None]
    spikes = torch.rand(n, h, s, d, generator=gen) < rate
    return (x + spikes * torch.randn(n, h, s, d, generator=gen) * size).to(DEVICE)


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
        # into rows of a caller's buffer (the chooser's, one per candidate): the same bits
        buf = torch.full((3, 6), float("nan"), device=DEVICE)
        band_errors(x, st.widths(d), out=(buf[2], buf[0]))
        assert torch.equal(buf[2], err2) and torch.equal(buf[0], norm2), (spec, repro(seed))
        assert buf[1].isnan().all(), (spec, repro(seed))


def test_bad_input_is_refused():
    x = torch.zeros(2, 128, 64, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        band_errors(x.double(), (8, 24, 16, 64))
    with pytest.raises(ValueError, match="group"):
        band_errors(x, (8, 24, 16, 48))
    with pytest.raises(ValueError, match="group"):
        band_errors(x, (8, 24, 16, 16))  # not a multiple of the kernel's 32-token chunk
    good = torch.empty(2, device=DEVICE)
    for bad in (torch.empty(3, device=DEVICE), torch.empty(2, dtype=torch.float64,
                                                           device=DEVICE),
                torch.empty(4, device=DEVICE)[::2]):
        with pytest.raises(ValueError, match="out"):
            band_errors(x, (8, 24, 16, 64), out=(good, bad))


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
    errs = {}
    for st in cands + rescue:
        _, dec = st.encode_decoded(x.reshape(n * h, s, d), kind)
        errs[st.spec] = _errors(dec.reshape(n, h, s, d), x).cpu().numpy()
    # two budgets: between the candidates' errors (each candidate picked), and between the
    # rescue's (no candidate fits: rescued or dense)
    budgets = [float(np.median(errs[cands[1].spec])), float(np.median(errs[rescue[0].spec]))]
    seen = set()
    for budget in budgets:
        want, want_dec = _choose_batch(x, x_rot, kind, cands, budget, "within-budget", dense,
                                       need_decoded=True, rescue=rescue)
        got, got_dec = _choose_batch(x, x_rot, kind, cands, budget, "within-budget", dense,
                                     need_decoded=True, rescue=rescue, errors_first=True)
        ok = ~_near_ties(x, x_rot, cands + rescue, budget)
        seen |= {want.spec_reason(i) for i in range(n)}
        for i in np.nonzero(ok)[0].tolist():
            assert got.spec_reason(i) == want.spec_reason(i), (i, budget, repro(seed))
            a, b = got[i], want[i]
            assert a.encoded.tensors.keys() == b.encoded.tensors.keys()
            for name in a.encoded.tensors:
                assert torch.equal(a.encoded.tensors[name], b.encoded.tensors[name]), (i, name)
            assert abs(a.error - b.error) <= 1e-5 * max(b.error, 1e-6), (i, a.error, b.error)
            assert torch.equal(got_dec[i], want_dec[i]), (i, repro(seed))
        np.testing.assert_array_equal(got.row_bytes()[ok], want.row_bytes()[ok])
    # every path of the pick was compared: each candidate, a rescue, the dense fallback
    assert {spec for spec, _ in seen} >= {st.spec for st in cands} | {dense.spec}, (seen, repro(seed))
    assert ("band:b8=64,b4=0,b2=0,group=32", "rescued") in seen, (seen, repro(seed))


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


def start_up_covers_the_chooser(monkeypatch, seed, module, kernel: str, cfg) -> None:
    """Asserts that `module.compile_variants` for the default candidates' band widths warms up
    every launch of `module.<kernel>` that sealing with `cfg` makes (sink segments too)."""
    pytest.importorskip("sglang", reason="the serving modules import SGLang")
    from mosaickv_sglang.serving.graph_decode import band_pairs
    from mosaickv_sglang.serving.segment_store import SegmentStore

    rec = LaunchRecorder(getattr(module, kernel))
    monkeypatch.setattr(module, kernel, rec)
    gen = torch.Generator().manual_seed(seed)
    n, h, s, d = 6, 2, 128, 64
    k, v = (_segments(n, h, s, d, gen) for _ in range(2))
    basis = torch.linalg.qr(torch.randn(n, h, d, d, generator=gen))[0].to(torch.bfloat16)
    cands = Candidates.from_config(cfg)
    for sink in (False, True):
        seal_segments(k, v, basis.to(DEVICE), basis.to(DEVICE), 0, list(range(n)), cfg, cands,
                      sink, True)
    assert rec.launched, repro(seed)
    widths = [w for _, w in SegmentStore.pack_variants(
        SimpleNamespace(head_dim=d), band_pairs(cfg), s)]
    assert module.compile_variants(widths, s, d) >= 1
    assert rec.launched <= rec.warmed, (rec.launched - rec.warmed, repro(seed))


def test_start_up_compiles_every_band_errors_variant_the_chooser_launches(monkeypatch, seed):
    """What `SegmentStore.compile_chooser_kernels` compiles at start-up (CUDA) covers every
    `band_errors` launch of the errors-first chooser sealing with the default config (sink
    segments too): a variant it missed would compile inside a live step (seconds). Needs SGLang
    (the serving modules import it): skipped, visibly, in a kernel-only GPU run."""
    from mosaickv_kernels import band_errors as be

    start_up_covers_the_chooser(monkeypatch, seed, be, "_band_errors",
                                MosaicConfig(chooser="errors_first"))
