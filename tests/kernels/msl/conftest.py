"""Fixtures for running mx.fast.metal_kernel kernels under the MSL harness.

* ``msl_harness``: ``mx.fast.metal_kernel`` builds harness kernels (and
  ``mx.metal.is_available()`` is True) for the duration of the test; the
  fixture's value is the patched ``metal_kernel``.
* ``msl_debug_harness``: the same with debug checks on.
* ``msl_kernel``: the harness's own ``metal_kernel`` (nothing patched).

Every test here is skipped when no C++ compiler is installed.
"""

import pytest

from . import harness


@pytest.fixture(autouse=True)
def _require_cxx():
    if not harness.available():
        pytest.skip("the MSL harness needs a C++ compiler (g++ or $CXX)")


@pytest.fixture
def msl_harness():
    with harness.use_harness() as metal_kernel:
        yield metal_kernel


@pytest.fixture
def msl_debug_harness():
    with harness.use_harness(debug=True) as metal_kernel:
        yield metal_kernel


@pytest.fixture
def msl_kernel():
    return harness.metal_kernel
