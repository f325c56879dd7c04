"""SVD rotation bases: one orthonormal D x D basis per (layer, KV head, basis block).

Rotating into the principal axes of a block concentrates a vector's energy in few coordinates,
which is what per-vector top-r selection and per-channel bit allocation exploit. Scores are
invariant and values are accumulated in the rotated basis and rotated back once, so the cache
never has to be un-rotated. The stored bf16 U is orthonormal only to ~5e-3, so reads use its
exact inverse (computed in fp32 when a read starts, never stored): data goes in as x U, comes
back as y U^-1, and queries go in as q U^-T, which keeps q.k exact for any invertible U. A basis block spans many segments (4096 tokens by
default) so its D*D bf16 entries cost ~1.6% of the bf16 K or V bytes of the block at D=64, and
less at D=128; the basis bytes are counted in every ratio we report.
"""
from __future__ import annotations

import torch

BASIS_DTYPE = torch.bfloat16


def fit_basis(x: torch.Tensor) -> torch.Tensor:
    """Principal axes of x [H, S, D] per head, as bf16 [H, D, D] (columns sorted by energy).

    The basis is orthonormalized again after the bf16 cast (QR) so that rotating with the stored
    tensor stays an isometry; uncentered SVD, because attention uses raw dot products.
    """
    x = x.float()
    cov = x.transpose(1, 2) @ x  # [H, D, D]
    _, eigvecs = torch.linalg.eigh(cov)  # ascending eigenvalues
    u = eigvecs.flip(-1)
    u = u.to(BASIS_DTYPE).float()
    q, r = torch.linalg.qr(u)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return q.to(BASIS_DTYPE)


def rotate(x: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """x [H, ..., D] -> x @ U per head (float32). None means the identity (no rotation)."""
    if basis is None:
        return x.float()
    h, d = basis.shape[0], basis.shape[-1]
    flat = x.float().reshape(h, -1, d)
    return (flat @ basis.float()).reshape(x.shape)


def inverse(basis: torch.Tensor | None) -> torch.Tensor | None:
    """fp32 U^-1 per head (a transient working copy for one read, not part of the cache)."""
    return None if basis is None else torch.linalg.inv(basis.float())


def unrotate(x: torch.Tensor, inv: torch.Tensor | None) -> torch.Tensor:
    """Back from the basis: x @ U^-1 (inv from `inverse`)."""
    if inv is None:
        return x.float()
    h, d = inv.shape[0], inv.shape[-1]
    return (x.float().reshape(h, -1, d) @ inv).reshape(x.shape)


def rotate_query(q: torch.Tensor, inv: torch.Tensor | None) -> torch.Tensor:
    """A query into the basis so that (q U^-T) . (k U) == q . k exactly: q @ U^-T."""
    if inv is None:
        return q.float()
    h, d = inv.shape[0], inv.shape[-1]
    return (q.float().reshape(h, -1, d) @ inv.transpose(1, 2)).reshape(q.shape)
