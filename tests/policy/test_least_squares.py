"""The plain-Python least squares behind the pass-cost fits."""

import numpy as np
import pytest

from mlx_spec.core.least_squares import decayed, outer, solve_linear


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
