"""The chooser's band encoding on the GPU (mosaickv_kernels.band_encode) against the codec's own
`Band.encode_decoded`: the same bytes (codes, fp16 scales and zeros) and the same float32
reconstruction, bit for bit, for every default candidate (K, V, sink, rescue) and a 2-bit-only
band, on fresh random segments whose outliers range from none to large (clamping, tiny spans);
and the chooser with `encode_kernel: "triton"` against the torch encode. On a CPU the kernel
runs in Triton's interpreter (conftest.py)."""
from __future__ import annotations

import pytest
import torch

from mosaickv_kernels.band_encode import band_encode
from mosaickv_sglang.codec.layer import Candidates, seal_segments
from mosaickv_sglang.codec.strategies import parse_strategy
from mosaickv_sglang.config import MosaicConfig

from conftest import repro
from test_band_errors_kernel import DEVICE, SPECS, _segments, start_up_covers_the_chooser


@pytest.mark.parametrize("d", [64, 128])
def test_bytes_and_reconstruction_are_the_codecs(d, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _segments(4, 2, 128, d, gen).reshape(8, 128, d).contiguous()
    x[0, :, 5] = 3.25  # a constant channel: a zero span (the scale's floor)
    for spec in SPECS:
        st = parse_strategy(spec)
        want, want_dec = st.encode_decoded(x, "k")
        got, got_dec = band_encode(x, st.widths(d))
        assert got.keys() == want.keys(), (spec, repro(seed))
        for name in want:
            assert got[name].dtype == want[name].dtype and \
                got[name].shape == want[name].shape, (spec, name)
            assert torch.equal(got[name], want[name]), (spec, name, repro(seed))
        assert torch.equal(got_dec, want_dec), (spec, float((got_dec - want_dec).abs().max()),
                                                repro(seed))


def test_bad_input_is_refused():
    x = torch.zeros(2, 128, 64, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        band_encode(x.double(), (8, 24, 16, 64))
    with pytest.raises(ValueError, match="group"):
        band_encode(x, (8, 24, 16, 48))
    with pytest.raises(ValueError, match="group"):
        band_encode(x, (40, 24, 16, 64))  # more channels than head_dim


def test_seal_segments_with_the_encode_kernel_is_the_torch_encode(seed):
    """Through `seal_segments` (default candidates and budgets, the errors-first chooser, sink
    segments too): the same headers, choices, encoded tensors, page metadata and kept
    reconstructions with `encode_kernel` "triton" as with "torch"."""
    gen = torch.Generator().manual_seed(seed)
    n, h, s, d = 6, 2, 128, 64
    k, v = (_segments(n, h, s, d, gen) for _ in range(2))
    basis = torch.linalg.qr(torch.randn(n, h, d, d, generator=gen))[0].to(torch.bfloat16)
    basis = basis.to(DEVICE)
    out = {}
    for kernel in ("torch", "triton"):
        cfg = MosaicConfig(chooser="errors_first", encode_kernel=kernel)
        cands = Candidates.from_config(cfg)
        for sink in (False, True):
            out[kernel, sink] = seal_segments(k, v, basis, basis, 0, list(range(n)), cfg, cands,
                                              sink, True, keep_decoded=True)
    for sink in (False, True):
        a, b = out["triton", sink], out["torch", sink]
        assert torch.equal(a.headers, b.headers), repro(seed)
        assert [a.kinds(i) for i in range(n)] == [b.kinds(i) for i in range(n)], repro(seed)
        for f in ("lo", "hi", "rest_norm"):
            assert torch.equal(getattr(a.meta, f), getattr(b.meta, f)), (f, repro(seed))
        for x, y in zip(a.decoded, b.decoded):
            assert torch.equal(x, y), repro(seed)
        for i in range(n):
            for kind in ("k", "v"):
                ea, eb = getattr(a[i], kind).encoded, getattr(b[i], kind).encoded
                assert ea.tensors.keys() == eb.tensors.keys()
                for name in ea.tensors:
                    assert torch.equal(ea.tensors[name], eb.tensors[name]), (i, kind, name)


def test_start_up_compiles_every_band_encode_variant_the_chooser_launches(monkeypatch, seed):
    """What `SegmentStore.compile_chooser_kernels` compiles at start-up (CUDA) with
    `encode_kernel` "triton" covers every `band_encode` launch of the chooser sealing with the
    default candidates (sink segments too). Needs SGLang (the serving modules import it)."""
    from mosaickv_kernels import band_encode as be

    start_up_covers_the_chooser(monkeypatch, seed, be, "_band_encode",
                                MosaicConfig(chooser="errors_first", encode_kernel="triton"))
