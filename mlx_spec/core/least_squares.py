"""Decayed least squares of a few features, in plain Python.

The draft-length policies refit their pass-cost models after every pass;
for 3-4 features numpy's per-call overhead and its BLAS threads, woken on
each call, cost more host time (~0.2-0.7 ms a pass) than the arithmetic.
"""

from typing import List, Optional, Sequence

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


def solve_nonnegative(A: Matrix, b: Vector, free: Sequence[int] = ()) -> Vector:
    """x minimising ``x^T A x / 2 - b^T x`` with every ``x[i] >= 0`` but the
    indices in ``free`` (A symmetric positive definite: the normal equations
    of a least-squares fit, ``A x = b`` unconstrained). Active sets as
    Lawson and Hanson's: a coefficient the unconstrained solution puts below
    0 is held at 0 and the others are solved again, so the coefficients it
    is confounded with take its part (cutting it to 0 alone would leave
    their compensation in place); a held one is let go when raising it
    would fit better. Bounded: after ``3 n`` rounds the last solution, cut."""
    n = len(b)
    held: set = set()
    x = [0.0] * n
    for _ in range(3 * n):
        keep = [i for i in range(n) if i not in held]
        solved = solve_linear(
            [[A[i][j] for j in keep] for i in keep], [b[i] for i in keep]
        )
        x = [0.0] * n
        for i, value in zip(keep, solved):
            x[i] = value
        negative = [i for i in keep if i not in free and x[i] < 0]
        if negative:
            held.add(min(negative, key=lambda i: x[i]))
            continue
        # The objective's slope along each held coefficient: below 0, the
        # fit improves by letting it rise.
        slope = {i: sum(a * v for a, v in zip(A[i], x)) - b[i] for i in held}
        tolerance = 1e-12 * max(1.0, max((abs(v) for v in b), default=0.0))
        rising = [i for i in held if slope[i] < -tolerance]
        if not rising:
            return x
        held.discard(min(rising, key=lambda i: slope[i]))
    return [v if i in free else max(v, 0.0) for i, v in enumerate(x)]
