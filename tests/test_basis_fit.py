"""fit_solver "jacobi" (basis.jacobi_axes): the GEMM-only fit must give what the codec needs from
the eigh fit: orthonormal axes sorted by energy whose leading ones capture (nearly) the exact
top-r energy, on K/V-like data and on the blocks that break naive solvers, deterministically."""
from __future__ import annotations

import pytest
import torch

from mosaickv_sglang.bench.basis_fit import edge_cases, energy_ratios, kv_like, ranks_for
from mosaickv_sglang.codec.attention import decode_attention
from mosaickv_sglang.codec.basis import fit_basis, jacobi_axes, resolve_fit_solver, rotate
from mosaickv_sglang.codec.layer import compress_layer
from mosaickv_sglang.config import MosaicConfig, SelectionConfig

from conftest import repro

MIN_RATIO = 0.995  # measured >= 0.999 (NOTES.md); eigh's bf16 R itself is ~0.998 by this measure


def cov(x: torch.Tensor) -> torch.Tensor:
    return x.float().transpose(-1, -2) @ x.float()


def check_axes(x: torch.Tensor, seed: int, what: str, tf32: bool = False) -> None:
    """jacobi_axes of x's covariance: finite, orthonormal, sorted, top-r energy near exact
    (checked in float64 on the CPU, wherever the fit ran)."""
    axes = jacobi_axes(cov(x), tf32=tf32).cpu()
    x = x.cpu()
    d = x.shape[-1]
    assert bool(torch.isfinite(axes).all()), f"{what}: non-finite axes {repro(seed)}"
    gram = axes.transpose(-1, -2) @ axes
    assert float((gram - torch.eye(d)).abs().max()) < 1e-4, f"{what}: not orthonormal {repro(seed)}"
    c = cov(x).double()
    energy = ((c @ axes.double()) * axes.double()).sum(-2)  # Rayleigh quotient per axis
    scale = energy.sum(-1, keepdim=True).clamp_min(1e-30)
    assert bool((energy.diff(dim=-1) <= 1e-6 * scale).all()), f"{what}: not sorted {repro(seed)}"
    for r, ratio in energy_ratios(c, axes, ranks_for(d)).items():
        worst = float(ratio.nan_to_num(1.0).min())
        assert worst >= MIN_RATIO, f"{what}: top-{r} energy ratio {worst:.4f} {repro(seed)}"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("tokens", [64, 1024])
def test_jacobi_axes_capture_the_exact_energy(d, kind, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    check_axes(kv_like(6, tokens, d, kind, gen), seed, f"{kind} D={d} T={tokens}")


def test_jacobi_axes_edge_cases(seed):
    """Near-degenerate spectra, zero and constant channels, rank one, all zero, a 64-token block
    at D=128, fp16-range values: finite, orthonormal, sorted, energy bounded."""
    gen = torch.Generator().manual_seed(seed)
    for name, x in edge_cases(128, gen).items():
        check_axes(x, seed, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_jacobi_tf32_axes_capture_the_exact_energy_on_a_gpu(seed):
    """fit_solver "jacobi_tf32": the rotation steps on TF32 tensor cores still give orthonormal,
    sorted axes capturing the exact top-r energy, on K/V-like blocks and the edge cases."""
    gen = torch.Generator().manual_seed(seed)
    for d in (64, 128):
        for kind in ("k", "v"):
            check_axes(kv_like(6, 1024, d, kind, gen).cuda(), seed, f"tf32 {kind} D={d}", True)
    for name, x in edge_cases(128, gen).items():
        check_axes(x.cuda(), seed, f"tf32 {name}", True)


def test_jacobi_tf32_changes_nothing_on_a_cpu_and_restores_the_setting(seed, monkeypatch):
    """On a CPU "jacobi_tf32" is "jacobi" bit for bit; the CUDA TF32 setting is on during the
    rotation steps only and restored after (also when they raise)."""
    from mosaickv_sglang.codec import basis
    from mosaickv_sglang.codec.basis import fit_with

    x = kv_like(3, 256, 64, "k", torch.Generator().manual_seed(seed))
    assert torch.equal(fit_with(x, "jacobi_tf32"), fit_with(x, "jacobi")), repro(seed)
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    seen = []
    tangents = basis._pair_tangents

    def spy(b):
        seen.append(matmul.fp32_precision)
        return tangents(b)

    monkeypatch.setattr(basis, "_pair_tangents", spy)
    jacobi_axes(cov(x), tf32=True)
    assert seen and set(seen) == {"tf32"} and matmul.fp32_precision == before
    seen.clear()
    jacobi_axes(cov(x))
    assert set(seen) == {before}

    def boom(b):
        raise RuntimeError("boom")

    monkeypatch.setattr(basis, "_pair_tangents", boom)
    with pytest.raises(RuntimeError, match="boom"):
        jacobi_axes(cov(x), tf32=True)
    assert matmul.fp32_precision == before


def test_jacobi_axes_are_deterministic_and_scale_free(seed):
    x = kv_like(4, 256, 64, "k", torch.Generator().manual_seed(seed))
    a = jacobi_axes(cov(x))
    assert torch.equal(a, jacobi_axes(cov(x))), repro(seed)
    # the covariance is normalized by its trace first: a power-of-two scale changes no bit
    assert torch.equal(a, jacobi_axes(cov(x) * 2.0 ** 20)), repro(seed)


def test_the_checks_catch_a_wrong_basis(seed):
    """The checks can fail: a random rotation captures far less than the exact top-8 energy of
    K-like data (<= 0.63 over 3000 seeds), and the jacobi axes reversed are not sorted. (Raw
    channels are no such basis: K-like energy sits in a few outlier channels, and the identity
    reached 0.996 of the exact top-8 on ~17% of seeds, which made this test flaky.)"""
    gen = torch.Generator().manual_seed(seed)
    x = kv_like(4, 512, 64, "k", gen)
    c = cov(x).double()
    random_axes, _ = torch.linalg.qr(torch.randn(4, 64, 64, generator=gen))
    assert float(energy_ratios(c, random_axes, [8])[8].max()) < MIN_RATIO, repro(seed)
    flipped = jacobi_axes(cov(x)).flip(-1).double()
    assert not bool((((c @ flipped) * flipped).sum(-2).diff(dim=-1) <= 0).all()), repro(seed)


def test_fit_basis_jacobi_contract(seed):
    """R = fit_basis(x, jacobi=True): bf16 [H, D, D], rows orthonormal to bf16 precision and
    sorted by the stored coordinates' energy (what write_transform / decode rely on)."""
    x = kv_like(3, 512, 64, "k", torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    r = fit_basis(x, jacobi=True)
    assert r.dtype == torch.bfloat16 and r.shape == (3, 64, 64)
    gram = r.float() @ r.float().transpose(-1, -2)
    assert float(torch.linalg.matrix_norm(gram - torch.eye(64), ord=2).max()) < 2e-2, repro(seed)
    energy = rotate(x.float(), r).pow(2).sum(1)  # [H, D]: energy of each stored coordinate
    assert bool((energy[:, 1:] <= energy[:, :-1] * 1.02 + 1e-6 * energy.sum(-1, True)).all()), \
        repro(seed)


def test_codec_error_jacobi_vs_eigh(seed):
    """End to end (compress_layer, decode_attention) with one fixed band strategy per kind (no
    chooser: the basis alone decides the error). The mean segment reconstruction error with the
    jacobi bases is within 2% of the eigh bases' (measured over seeds: 0.994-1.008x; eigh on
    7/8 of the tokens, an equally good basis, 1.00-1.03x). The attention-output error is noisier
    at this size (+-20% between equally good bases), so it only has to stay well below what an
    unsorted basis gives (3.5-5x)."""
    gen = torch.Generator().manual_seed(seed)
    h, t, d = 2, 1088, 64
    k = kv_like(h, t, d, "k", gen).to(torch.bfloat16)
    v = kv_like(h, t, d, "v", gen).to(torch.bfloat16)
    q = torch.randn(8, 2 * h, d, generator=gen) * 0.3
    pos = torch.full((8,), t - 1)
    kk, vv = k.float().repeat_interleave(2, 0), v.float().repeat_interleave(2, 0)
    ref = (torch.einsum("nhd,htd->nht", q, kk) * d ** -0.5).softmax(-1)
    ref = torch.einsum("nht,htd->nhd", ref, vv)
    rec, attn = {}, {}
    for solver in ("host", "jacobi"):
        cfg = MosaicConfig(fit_solver=solver, basis_block_tokens=512, sink_segments=0,
                           k_candidates=["band:b8=4,b4=44,b2=16,group=128"],
                           v_candidates=["band:b8=0,b4=48,b2=16,group=128"],
                           k_error_budget=float("inf"), v_error_budget=float("inf"),
                           select=SelectionConfig(enabled=False))
        layer = compress_layer(k, v, cfg)
        rec[solver] = [sum(getattr(s, kind).error for s in layer.segments) for kind in "kv"]
        out, _ = decode_attention(q, layer, pos, cfg.select, cfg.page_tokens)
        attn[solver] = float((out - ref).norm() / ref.norm())
    for kind, got, want in zip("KV", rec["jacobi"], rec["host"]):
        assert got <= want * 1.02, (kind, rec, repro(seed))
    assert attn["host"] < 0.2 and attn["jacobi"] <= 1.5 * attn["host"], (attn, repro(seed))


def test_auto_solver_is_jacobi_on_gpus_and_lapack_on_cpus():
    """The default `fit_solver: auto` picks by where the pages are; named solvers pass through."""
    assert MosaicConfig().fit_solver == "auto"
    assert resolve_fit_solver("auto", torch.device("cpu")) == "host"
    assert resolve_fit_solver("auto", torch.device("cuda", 0)) == "jacobi"
    for solver in ("host", "device", "jacobi"):
        assert resolve_fit_solver(solver, torch.device("cuda")) == solver
        assert resolve_fit_solver(solver, "cpu") == solver
