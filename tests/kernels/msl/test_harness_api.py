"""The MSL harness itself: patching, errors, caching, workers and schedules, options."""

import mlx.core as mx
import numpy as np
import pytest

from . import harness
from .harness import MSLCompileError, metal_kernel
from .kernel_texts import EXP_SOURCE, SIMD_SOURCE, TREE_REDUCE, run1


# ---------------------------------------------------------------------------
# Harness behaviour
# ---------------------------------------------------------------------------
def test_use_harness_patches_and_restores():
    original_kernel = mx.fast.metal_kernel
    original_available = mx.metal.is_available
    with harness.use_harness(debug=True) as mk:
        assert mx.metal.is_available() is True
        assert mx.fast.metal_kernel is mk
        k = mx.fast.metal_kernel(
            name="myexp", input_names=["inp"], output_names=["out"], source=EXP_SOURCE
        )
        assert isinstance(k, harness.HarnessKernel) and k.options.debug is True
        out = run1(
            k,
            [mx.zeros((4,))],
            (4, 1, 1),
            (4, 1, 1),
            (4,),
            template=[("T", mx.float32)],
        )
        assert np.array_equal(np.array(out), np.ones(4))
    assert mx.fast.metal_kernel is original_kernel
    assert mx.metal.is_available is original_available


def test_fixture(msl_harness):
    k = mx.fast.metal_kernel(
        name="myexp", input_names=["inp"], output_names=["out"], source=EXP_SOURCE
    )
    out = run1(
        k, [mx.zeros((4,))], (4, 1, 1), (4, 1, 1), (4,), template=[("T", mx.float32)]
    )
    assert np.array_equal(np.array(out), np.ones(4))


def test_argument_errors_match_mlx():
    k = metal_kernel(
        name="myexp", input_names=["inp"], output_names=["out"], source=EXP_SOURCE
    )
    with pytest.raises(ValueError, match="Expected `inputs` to have size 1"):
        run1(k, [], (4, 1, 1), (4, 1, 1), (4,))
    with pytest.raises(ValueError, match="maximum allowed threads per threadgroup"):
        run1(
            k,
            [mx.zeros((4,))],
            (4, 1, 1),
            (1024, 2, 1),
            (4,),
            template=[("T", mx.float32)],
        )


def test_compile_errors_are_reported():
    k = metal_kernel(
        name="broken", input_names=["x"], output_names=["out"], source="out[0] = nope;"
    )
    with pytest.raises(MSLCompileError, match="nope"):
        run1(k, [mx.zeros((4,))], (1, 1, 1), (1, 1, 1), (1,))


def test_compiled_libraries_are_cached():
    src = EXP_SOURCE + "// only this test uses this text\n"

    def build_and_run(dtype):
        k = metal_kernel(
            name="cached", input_names=["inp"], output_names=["out"], source=src
        )
        a = mx.ones((4,), dtype=dtype)
        run1(k, [a], (4, 1, 1), (4, 1, 1), (4,), dtype, template=[("T", dtype)])

    build_and_run(mx.float32)
    n = len(harness._kernel_libs)
    build_and_run(mx.float32)  # same source and arguments: no new library
    assert len(harness._kernel_libs) == n
    build_and_run(mx.float16)  # another template instance: one more
    assert len(harness._kernel_libs) == n + 1


@pytest.mark.parametrize(
    "workers,schedule", [(1, "forward"), (2, "reverse"), (1, "reverse")]
)
def test_worker_counts_and_schedules_agree(workers, schedule):
    k = metal_kernel(
        name="simd", input_names=["x"], output_names=["out"], source=SIMD_SOURCE
    )
    x = mx.random.normal((256,), key=mx.random.key(7))
    base = run1(k, [x], (256, 1, 1), (64, 1, 1), (256 * 8,))
    out = run1(
        k, [x], (256, 1, 1), (64, 1, 1), (256 * 8,), workers=workers, schedule=schedule
    )
    assert mx.array_equal(base, out).item()


def test_portable_ucontext_switch():
    k = metal_kernel(
        name="tree", input_names=["x"], output_names=["out"], source=TREE_REDUCE
    )
    x = mx.random.normal((2 * 256,), key=mx.random.key(8))
    out = run1(k, [x], (x.size, 1, 1), (256, 1, 1), (2,), use_ucontext=True)
    assert mx.allclose(out, x.reshape(2, 256).sum(axis=1), atol=1e-4).item()


def test_debug_checked_pointers_survive_reinterpret_cast():
    src = """
        uint i = thread_position_in_grid.x;
        auto v = reinterpret_cast<const device float4*>(x);
        auto o = (device float4*)out;
        o[i] = v[i] * 2.0f;
    """
    k = metal_kernel(name="vec4", input_names=["x"], output_names=["out"], source=src)
    x = mx.arange(16, dtype=mx.float32)
    out = run1(k, [x], (4, 1, 1), (4, 1, 1), (16,), debug=True)
    assert np.array_equal(np.array(out), np.arange(16) * 2)


def test_int_and_bool_template_parameters():
    src = """
        uint i = thread_position_in_grid.x;
        T v = x[i];
        for (int k = 1; k < N; ++k) v = v * x[i];
        out[i] = NEGATE ? -v : v;
    """
    k = metal_kernel(name="pow_n", input_names=["x"], output_names=["out"], source=src)
    x = mx.arange(6, dtype=mx.int32)
    for n, neg in ((3, True), (2, False)):
        out = run1(
            k,
            [x],
            (6, 1, 1),
            (8, 1, 1),
            (6,),
            mx.int32,
            template=[("T", mx.int32), ("N", n), ("NEGATE", neg)],
        )
        expect = np.arange(6) ** n * (-1 if neg else 1)
        assert np.array_equal(np.array(out), expect)
