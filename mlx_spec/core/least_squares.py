"""Decayed least squares of a few features, in plain Python.

The draft-length policies refit their pass-cost models after every pass;
for 3-4 features numpy's per-call overhead and its BLAS threads, woken on
each call, cost more host time (~0.2-0.7 ms a pass) than the arithmetic.
"""

from typing import List, Optional

Vector = List[float]
Matrix = List[Vector]


def outer(x: Vector, scale: float = 1.0) -> Matrix:
    """scale * x x^T."""
    return [[scale * a * b for b in x] for a in x]


def decayed(old: list, new: list, decay: float, floor: Optional[list] = None) -> list:
    """``decay * old + new (+ floor)``, elementwise, for vectors or matrices."""
    if isinstance(old[0], list):
        floor = floor or [None] * len(old)
        return [decayed(o, n, decay, f) for o, n, f in zip(old, new, floor)]
    floor = floor or [0.0] * len(old)
    return [decay * o + n + f for o, n, f in zip(old, new, floor)]


def solve_linear(A: Matrix, b: Vector) -> Vector:
    """x with ``A x = b`` (Gaussian elimination with partial pivoting; A
    square and non-singular; A and b are left unchanged)."""
    A, b, n = [row[:] for row in A], b[:], len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(A[r][col]))
        A[col], A[pivot], b[col], b[pivot] = A[pivot], A[col], b[pivot], b[col]
        for r in range(col + 1, n):
            f = A[r][col] / A[col][col]
            A[r] = [a - f * p for a, p in zip(A[r], A[col])]
            b[r] -= f * b[col]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (b[r] - sum(A[r][c] * x[c] for c in range(r + 1, n))) / A[r][r]
    return x
