"""``linalg_solve_triangular`` and ``triangular_solve`` (no torch_lib translation) as
substitution in elementwise ops and slices, ``lu_unpack`` as masks and the pivots'
row swaps, and ``linalg_lu_solve`` as the row swaps and two substitutions, registered by
``decompositions.table``.

A X = B with A lower triangular is solved row by row in the order of the reference BLAS
``trsm``: x_k = r_k / a_kk, then every remaining residual row r_i -= a_ik x_k (k = 0, 1,
...; upper triangular A from the last row up). X A = B is the same substitution on the
transposes. Only the triangle ``upper`` names is read, as LAPACK reads it. Systems of more
than ``MAX_SIZE`` unknowns, complex and non-float dtypes stay whole (in PyTorch): the
substitution is ``n`` steps of the graph.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

#: The largest n (A is n x n) solved as substitution steps.
MAX_SIZE = 64


def _solve_left(a, b, upper: bool, unitriangular: bool):
    """X with a @ X = b (a: (..., n, n), b: (..., n, k), batch dims already equal)."""
    n = a.shape[-1]
    residual = b
    rows = [None] * n
    for k in (range(n - 1, -1, -1) if upper else range(n)):
        r_k = aten.slice.Tensor(residual, -2, k, k + 1)
        x_k = r_k if unitriangular else aten.div.Tensor(r_k, aten.slice.Tensor(aten.slice.Tensor(a, -2, k, k + 1), -1, k, k + 1))
        rows[k] = x_k
        # The rows still to solve: above k for upper A, below k for lower A.
        lo, hi = (0, k) if upper else (k + 1, n)
        if hi > lo:
            column = aten.slice.Tensor(aten.slice.Tensor(a, -1, k, k + 1), -2, lo, hi)
            rest = aten.slice.Tensor(residual, -2, lo, hi)
            updated = aten.sub.Tensor(rest, aten.mul.Tensor(column, x_k))
            parts = [updated] if upper else [aten.slice.Tensor(residual, -2, 0, lo), updated]
            if upper:
                parts.append(aten.slice.Tensor(residual, -2, hi, n))
            residual = aten.cat.default(parts, -2)
    return aten.cat.default(rows, -2)


def linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float64):
        return NotImplemented
    if a.dim() < 2 or b.dim() < 2:
        return NotImplemented
    n = a.shape[-1]
    if n > MAX_SIZE or n == 0 or b.numel() == 0:
        return NotImplemented
    if not left:  # X A = B  <=>  A^T X^T = B^T
        x_t = linalg_solve_triangular(
            aten.transpose.int(a, -2, -1), aten.transpose.int(b, -2, -1), upper=not upper, left=True,
            unitriangular=unitriangular,
        )
        return x_t if x_t is NotImplemented else aten.clone.default(
            aten.transpose.int(x_t, -2, -1), memory_format=torch.contiguous_format
        )
    batch = list(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    a = aten.expand.default(a, batch + list(a.shape[-2:]))
    b = aten.expand.default(b, batch + list(b.shape[-2:]))
    return _solve_left(a, b, upper, unitriangular)


def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    """aten.triangular_solve: (solution of op(a) X = b, a copy of a broadcast to the batch);
    op(a) = a^T when ``transpose`` (its other triangle then holds the coefficients)."""
    coefficients = aten.transpose.int(a, -2, -1) if transpose else a
    x = linalg_solve_triangular(coefficients, b, upper=upper != transpose, left=True, unitriangular=unitriangular)
    if x is NotImplemented:
        return NotImplemented
    batch = list(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    return x, aten.clone.default(aten.expand.default(a, batch + list(a.shape[-2:])), memory_format=torch.contiguous_format)


def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    """aten.lu_unpack: P from the 1-based row swaps of ``pivots`` applied in order
    (P[r, c] = 1 where the permuted row c is r), L = the strict lower triangle plus the
    identity (m x k), U = the upper triangle (k x n), k = min(m, n)."""
    if not (unpack_data and unpack_pivots) or lu.dtype not in (torch.float32, torch.float64) or lu.dim() < 2:
        return NotImplemented
    m, n = lu.shape[-2], lu.shape[-1]
    k = min(m, n)
    if k == 0 or k > MAX_SIZE or pivots.shape[-1] != k:
        return NotImplemented
    rows, perm = _permutation(pivots, m, k, lu.device)
    p = aten._to_copy.default(
        aten.eq.Tensor(aten.unsqueeze.default(perm, -2), aten.unsqueeze.default(rows, -1)), dtype=lu.dtype
    )
    eye = aten.eye.m(m, k, dtype=lu.dtype, device=lu.device)
    lower = aten.add.Tensor(aten.tril.default(aten.slice.Tensor(lu, -1, 0, k), -1), eye)
    upper = aten.triu.default(aten.slice.Tensor(lu, -2, 0, k))
    return p, lower, upper


def _permutation(pivots, m: int, k: int, device):
    """(0..m-1, perm): the 1-based row swaps of ``pivots`` applied in order to the rows;
    row c of P^T A is row perm[c] of A."""
    rows = aten.arange.default(m, dtype=torch.int64, device=device)
    perm = aten.expand.default(rows, list(pivots.shape[:-1]) + [m])
    swaps = aten.sub.Tensor(aten._to_copy.default(pivots, dtype=torch.int64), 1)
    for i in range(k):
        j = aten.slice.Tensor(swaps, -1, i, i + 1)
        at_i = aten.slice.Tensor(perm, -1, i, i + 1)
        at_j = aten.gather.default(perm, -1, j)
        perm = aten.where.self(aten.eq.Scalar(rows, i), at_j, aten.where.self(aten.eq.Tensor(rows, j), at_i, perm))
    return rows, perm


def linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    """aten.linalg_lu_solve: X with A X = B (A^T X = B with ``adjoint``; X A = B, or
    X A^T = B, with ``left=False``) for A = P L U given as ``lu_factor``'s (LU, pivots),
    as LAPACK's getrs: the row swaps (a gather, or its inverse, a scatter: exact, where a
    product with P would turn inf into NaN), then the two triangular substitutions."""
    if lu.dtype != b.dtype or lu.dtype not in (torch.float32, torch.float64) or lu.dim() < 2 or b.dim() < 2:
        return NotImplemented
    n = lu.shape[-1]
    if lu.shape[-2] != n or n == 0 or n > MAX_SIZE or b.numel() == 0 or pivots.shape[-1] != n:
        return NotImplemented
    if not left:  # X op(A) = B  <=>  op(A)^T X^T = B^T
        x_t = linalg_lu_solve(lu, pivots, aten.transpose.int(b, -2, -1), left=True, adjoint=not adjoint)
        return x_t if x_t is NotImplemented else aten.clone.default(
            aten.transpose.int(x_t, -2, -1), memory_format=torch.contiguous_format)
    batch = list(torch.broadcast_shapes(lu.shape[:-2], pivots.shape[:-1], b.shape[:-2]))
    lu = aten.expand.default(lu, batch + [n, n])
    b = aten.expand.default(b, batch + list(b.shape[-2:]))
    _, perm = _permutation(aten.expand.default(pivots, batch + [n]), n, n, lu.device)
    index = aten.expand.default(aten.unsqueeze.default(perm, -1), batch + list(b.shape[-2:]))
    if not adjoint:  # U X = L^-1 P^T B
        y = aten.gather.default(b, -2, index)
        z = _solve_left(lu, y, upper=False, unitriangular=True)
        return _solve_left(lu, z, upper=True, unitriangular=False)
    lu_t = aten.transpose.int(lu, -2, -1)  # U^T L^T P^T X = B
    z = _solve_left(lu_t, b, upper=False, unitriangular=False)
    y = _solve_left(lu_t, z, upper=True, unitriangular=True)
    return aten.scatter.src(aten.zeros_like.default(y), -2, index, y)


def table() -> dict:
    return {
        aten.linalg_solve_triangular.default: linalg_solve_triangular,
        aten.triangular_solve.default: triangular_solve,
        aten.lu_unpack.default: lu_unpack,
        aten.linalg_lu_solve.default: linalg_lu_solve,
    }
