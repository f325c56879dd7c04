"""SVD rotation bases: one D x D basis per (layer, KV head, basis block).

Rotating into the principal axes of a block concentrates a vector's energy in few coordinates,
which is what per-vector top-r selection and per-channel bit allocation exploit. Scores are
invariant and values are accumulated in the rotated basis and rotated back once, so the cache
never has to be un-rotated.

The stored tensor R is the *read-side* transform: bf16, its rows the principal axes (R ~ U^T).
bf16 R is orthonormal only to ~5e-3, so exactness needs one true inverse somewhere; it is put on
the write side, computed in fp32 when segments are sealed and never stored: data goes in as
x R^-1, comes back as y R, and queries go in as q R^T, which keeps q.k exact for any invertible R.
Reads (every decode step, every layer) therefore use R as stored: no inverse on the decode path.
A basis block spans many segments (4096 tokens by default) so its D*D bf16 entries cost ~1.6% of
the bf16 K or V bytes of the block at D=64, and less at D=128; the basis bytes are counted in
every ratio we report.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

BASIS_DTYPE = torch.bfloat16


def fit_basis(x: torch.Tensor, jacobi: bool = False, tf32: bool = False) -> torch.Tensor:
    """Principal axes of x [..., S, D] per leading index, as the bf16 read transform R
    [..., D, D] (rows sorted by energy).

    Uncentered, because attention uses raw dot products. `jacobi` picks `jacobi_axes` (batched
    GEMMs, one code path on CPU and GPU) instead of the exact eigendecomposition (LAPACK or
    cuSOLVER, one matrix at a time); both give orthonormal axes sorted by energy, R is their bf16
    cast. The eigh axes are orthonormalized again after the bf16 cast (QR) so that R stays close
    to an isometry. `tf32`: jacobi's rotation steps on a GPU's TF32 tensor cores (`jacobi_axes`).
    """
    x = x.float()
    cov = x.transpose(-1, -2) @ x  # [..., D, D]
    if jacobi:
        return jacobi_axes(cov, tf32=tf32).transpose(-1, -2).to(BASIS_DTYPE)
    _, eigvecs = torch.linalg.eigh(cov)  # ascending eigenvalues
    u = eigvecs.flip(-1)
    u = u.to(BASIS_DTYPE).float()
    q, r = torch.linalg.qr(u)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return q.transpose(-1, -2).to(BASIS_DTYPE)


def fit_with(x: torch.Tensor, solver: str) -> torch.Tensor:
    """The read transform a resolved `fit_solver` gives for x [..., S, D]: the identity for
    "identity" (no rotation, an ablation; stored and read like any basis, so the kernels and the
    byte counts are the same), else `fit_basis` by eigh or jacobi."""
    if solver == "identity":
        d = x.shape[-1]
        return torch.eye(d, dtype=BASIS_DTYPE, device=x.device).expand(*x.shape[:-2], d, d).clone()
    return fit_basis(x, jacobi=solver in ("jacobi", "jacobi_tf32"), tf32=solver == "jacobi_tf32")


# jacobi_axes' fixed schedule (measured: tests/test_basis_fit.py; docs/codec.md, "GEMM-only
# basis fit")
JACOBI_STEPS = 6
JACOBI_DAMPING = 0.5  # all pairs rotate at once: full Jacobi angles overshoot
START_SHIFT = 1e-5  # of the trace: the start's columns stay independent (cond <= 1e5)
GRAM_SHIFT = 1e-12  # fp64 Cholesky of Z^T Z + this: positive definite even for a rounding-
# negative eigenvalue of the fp32 covariance at exactly -START_SHIFT (cond <= 1e12 < 1/(D eps))
EXP_SQUARINGS = 4
EXP_MAX_ROW_SUM = 0.5 * 2 ** EXP_SQUARINGS  # |K|_2 <= row sum: K / 2^s stays within 0.5


@contextmanager
def _matmul_tf32(on: bool):
    """CUDA float32 matmuls on TF32 tensor cores inside (10-bit mantissa inputs, float32
    accumulation), the previous setting restored after; nothing changes when `on` is False.
    CPU matmuls ignore the setting."""
    if not on:
        yield
        return
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def jacobi_axes(cov: torch.Tensor, tf32: bool = False) -> torch.Tensor:
    """Orthonormal axes of symmetric PSD `cov` [..., D, D] as columns, sorted by energy
    (Rayleigh quotient), from batched GEMMs and elementwise ops plus one batched Cholesky: no
    per-matrix solver loop, a fixed amount of work, no device sync, deterministic.

    Start: the covariance's own columns, largest diagonal first, orthonormalized in that order
    (Cholesky-QR in fp64), i.e. one step of subspace iteration from the channel basis. Then
    JACOBI_STEPS simultaneous Jacobi steps: with B = Q^T C Q, every pair (i, j) gets the angle
    that would zero B_ij alone, all damped and applied at once as one rotation exp(K). A rotation
    keeps Q orthonormal whatever the angles, and near-degenerate pairs (mixing them costs no
    energy) turn by at most 45 degrees: nothing can blow up. Top-r energy >= 0.998 of the exact
    top-r subspace's on SmolLM2 K/V, synthetic RoPE-like K/V and edge cases (docs/codec.md).

    `tf32` runs the Jacobi steps' GEMMs (most of the fit's time on a GPU) on TF32 tensor cores:
    each step's angles then carry ~1e-3 relative error, an error in the axes that costs energy
    only to second order, and the start (fp64) and the final orthonormalization (two
    Newton-Schulz steps instead of one) and energy order (float32) are computed without it, so
    the axes stay orthonormal to float32 precision. On a CPU it changes nothing.
    """
    shape, d = cov.shape, cov.shape[-1]
    c = cov.reshape(-1, d, d).float()
    c = c / torch.diagonal(c, dim1=-2, dim2=-1).sum(-1).clamp_min(1e-30)[:, None, None]
    eye = torch.eye(d, device=c.device)
    order = torch.diagonal(c, dim1=-2, dim2=-1).argsort(dim=-1, descending=True, stable=True)
    z = (c + START_SHIFT * eye).double().gather(-1, order[:, None, :].expand_as(c))
    gram = z.transpose(-1, -2) @ z + GRAM_SHIFT * eye.double()
    chol, _ = torch.linalg.cholesky_ex(gram)  # cannot fail (the shifts); _ex: no device sync
    q = torch.linalg.solve_triangular(chol.transpose(-1, -2), z, upper=True, left=False).float()
    with _matmul_tf32(tf32):
        for _ in range(JACOBI_STEPS):
            q = q @ _expm_skew(_pair_tangents(q.transpose(-1, -2) @ c @ q), JACOBI_DAMPING)
    # Newton-Schulz: the Taylor's rounding; where TF32 ran (CUDA) a second step, since its
    # GEMMs leave the axes ~1e-2 from orthonormal and one step only squares that (4e-4 was
    # measured on an H100, 2026-12-06)
    for _ in range(2 if tf32 and q.is_cuda else 1):
        q = 1.5 * q - 0.5 * q @ (q.transpose(-1, -2) @ q)
    energy = (q * (c @ q)).sum(-2)
    order = energy.argsort(dim=-1, descending=True, stable=True)
    return q.gather(-1, order[:, None, :].expand_as(q)).reshape(shape)


def _pair_tangents(b: torch.Tensor) -> torch.Tensor:
    """Skew K [N, D, D]: K_ij = tan of the Jacobi angle that zeroes b_ij (i < j), in [-1, 1];
    the stable form (never 0/0: a pair with b_ij = 0 gets 0)."""
    diag = torch.diagonal(b, dim1=-2, dim2=-1)
    gap = diag[:, None, :] - diag[:, :, None]  # b_jj - b_ii
    b2 = 2 * b
    den = gap + torch.copysign(torch.hypot(gap, b2), gap)
    t = (b2 / den.masked_fill_(den == 0, 1.0)).triu_(1)
    return t - t.transpose(-1, -2)


def _expm_skew(k: torch.Tensor, scale: float) -> torch.Tensor:
    """exp(scale * K) for skew K [N, D, D] in GEMMs: scale * K capped at a row sum of
    EXP_MAX_ROW_SUM (a shorter rotation, never a wrong one), degree-4 Taylor of it / 2^s,
    s squarings."""
    row = k.abs().sum(-1).amax(-1).clamp_min(1e-30)
    k = k * ((EXP_MAX_ROW_SUM / row).clamp(max=scale) / 2 ** EXP_SQUARINGS)[:, None, None]
    eye = torch.eye(k.shape[-1], device=k.device).expand_as(k)
    u = torch.add(eye, k, alpha=1 / 4)
    for j in (3, 2, 1):
        u = torch.baddbmm(eye, k, u, alpha=1 / j)
    for _ in range(EXP_SQUARINGS):
        u = u @ u
    return u


def write_transform(basis: torch.Tensor) -> torch.Tensor:
    """R^-1 in fp32 (batched over leading dims): what sealing multiplies data by."""
    return torch.linalg.inv(basis.float())


def rotate(x: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """Into the basis for storage: x [H, ..., D] -> x @ R^-1 per head (float32). None means the
    identity (no rotation)."""
    if basis is None:
        return x.float()
    h, d = basis.shape[0], basis.shape[-1]
    return (x.float().reshape(h, -1, d) @ write_transform(basis)).reshape(x.shape)


def unrotate(x: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """Back from the basis: x @ R (float32)."""
    if basis is None:
        return x.float()
    h, d = basis.shape[0], basis.shape[-1]
    return (x.float().reshape(h, -1, d) @ basis.float()).reshape(x.shape)


def kernel_transform(basis: torch.Tensor) -> torch.Tensor:
    """R^T in fp32, contiguous, batched over leading dims: the kernels read q @ it (into the
    basis), o_rot @ it^T and x_rot @ it^T (back from it)."""
    return basis.transpose(-1, -2).to(torch.float32, memory_format=torch.contiguous_format)


def rotate_query(q: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """A query into the basis so that (q R^T) . (k R^-1) == q . k exactly: q @ R^T."""
    if basis is None:
        return q.float()
    h, d = basis.shape[0], basis.shape[-1]
    return (q.float().reshape(h, -1, d) @ basis.float().transpose(-1, -2)).reshape(q.shape)


def resolve_fit_solver(solver: str, device: torch.device) -> str:
    """The solver `fit_solver: auto` means for pages on `device`: the GEMM-only jacobi fit on a
    GPU (a Llama-8B block: 28 ms vs host's 496 ms on the H200, RESULTS.md), LAPACK on a CPU."""
    if solver != "auto":
        return solver
    return "jacobi" if torch.device(device).type == "cuda" else "host"
