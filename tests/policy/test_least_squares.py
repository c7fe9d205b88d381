"""The plain-Python least squares behind the pass-cost fits."""

import numpy as np
import pytest

from mlx_spec.core.least_squares import decayed, outer, solve_linear, solve_nonnegative


@pytest.mark.parametrize("n", [1, 3, 4])
def test_solve_linear_matches_numpy_and_leaves_its_inputs(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        A = rng.normal(size=(n, n)) + n * np.eye(n)
        b = rng.normal(size=n)
        A_list, b_list = A.tolist(), b.tolist()
        x = solve_linear(A_list, b_list)
        assert np.allclose(x, np.linalg.solve(A, b))
        assert A_list == A.tolist() and b_list == b.tolist()
    # a zero first pivot needs the row swap
    assert solve_linear([[0.0, 1.0], [2.0, 0.0]], [3.0, 4.0]) == [2.0, 3.0]


def test_decayed_sums_of_outer_products_are_normal_equations():
    """Accumulating decayed outer products reproduces the weighted normal
    equations numpy builds, so the fit is weighted least squares."""
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(30, 3)), rng.normal(size=30)
    A, b = outer([0.0] * 3), [0.0] * 3
    for x, t in zip(X.tolist(), y):
        A = decayed(A, outer(x), 0.9)
        b = decayed(b, [v * t for v in x], 0.9)
    w = 0.9 ** np.arange(29, -1, -1)
    assert np.allclose(A, (X * w[:, None]).T @ X)
    assert np.allclose(
        solve_linear(A, b),
        np.linalg.lstsq(X * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)[0],
    )
    assert decayed([1.0], [2.0], 0.5, [0.25]) == [2.75]


def _best_over_supports(A, b, free):
    """The bounded minimum by brute force: for every set of coefficients
    held at 0, the unconstrained minimum over the rest, kept if feasible."""
    n, best, best_value = len(b), None, None
    for mask in range(1 << n):
        held = [i for i in range(n) if mask >> i & 1]
        if any(i in free for i in held):
            continue
        keep = [i for i in range(n) if i not in held]
        x = np.zeros(n)
        x[keep] = np.linalg.solve(A[np.ix_(keep, keep)], b[keep])
        if all(x[i] >= -1e-12 for i in range(n) if i not in free):
            value = 0.5 * x @ A @ x - b @ x
            if best_value is None or value < best_value:
                best, best_value = x, value
    return best


def test_solve_nonnegative_finds_the_bounded_minimum():
    """Against a brute force over every set of coefficients held at 0, on
    confounded random fits (a constant column and one nearly equal to it);
    the first coefficient is free and may go below 0."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        X = rng.normal(size=(25, 5))
        X[:, 0] = 1.0
        X[:, 1] = 1.0 + 0.01 * rng.normal(size=25)
        y = rng.normal(size=25) - 2.0
        A, b = X.T @ X + 1e-6 * np.eye(5), X.T @ y
        x = solve_nonnegative(A.tolist(), b.tolist(), free=(0,))
        assert np.allclose(x, _best_over_supports(A, b, (0,)), atol=1e-7)
        assert min(x[1:]) >= 0.0
    # Unconstrained where nothing falls below 0: solve_linear's answer.
    A, b = [[2.0, 0.0], [0.0, 4.0]], [2.0, 4.0]
    assert solve_nonnegative(A, b) == solve_linear(A, b) == [1.0, 1.0]
