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

import torch

BASIS_DTYPE = torch.bfloat16


def fit_basis(x: torch.Tensor) -> torch.Tensor:
    """Principal axes of x [..., S, D] per leading index, as the bf16 read transform R
    [..., D, D] (rows sorted by energy).

    The axes are orthonormalized again after the bf16 cast (QR) so that R stays close to an
    isometry; uncentered SVD, because attention uses raw dot products.
    """
    x = x.float()
    cov = x.transpose(-1, -2) @ x  # [..., D, D]
    _, eigvecs = torch.linalg.eigh(cov)  # ascending eigenvalues
    u = eigvecs.flip(-1)
    u = u.to(BASIS_DTYPE).float()
    q, r = torch.linalg.qr(u)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return q.transpose(-1, -2).to(BASIS_DTYPE)


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
    return basis.float().transpose(-1, -2).contiguous()


def rotate_query(q: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """A query into the basis so that (q R^T) . (k R^-1) == q . k exactly: q @ R^T."""
    if basis is None:
        return q.float()
    h, d = basis.shape[0], basis.shape[-1]
    return (q.float().reshape(h, -1, d) @ basis.float().transpose(-1, -2)).reshape(q.shape)
