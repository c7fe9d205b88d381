"""The classic GPU-kernel bugs, and how the harness reports them."""

import mlx.core as mx
import numpy as np
import pytest

from .harness import MSLKernelError, MSLRaceError, metal_kernel


def run(source, x=None, grid=(64, 1, 1), threadgroup=(64, 1, 1), out_shape=(64,), **kw):
    k = metal_kernel(
        name=kw.pop("name", "buggy"),
        input_names=["x"],
        output_names=["out"],
        source=source,
    )
    if x is None:
        x = mx.arange(64, dtype=mx.float32)
    return k(
        inputs=[x],
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[out_shape],
        output_dtypes=[mx.float32],
        **kw,
    )[0]


# ---------------------------------------------------------------------------
# Missing barriers
# ---------------------------------------------------------------------------
REDUCE = """
    uint t = thread_position_in_threadgroup.x;
    threadgroup float s[64];
    s[t] = x[thread_position_in_grid.x];
    BARRIER_AFTER_STORE
    for (uint stride = 32; stride > 0; stride /= 2) {
        if (t < stride) s[t] += s[t + stride];
        BARRIER_IN_LOOP
    }
    if (t == 0) out[threadgroup_position_in_grid.x] = s[0];
"""
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def reduce_source(after_store: bool, in_loop: bool) -> str:
    return REDUCE.replace(
        "BARRIER_AFTER_STORE", BARRIER if after_store else ""
    ).replace("BARRIER_IN_LOOP", BARRIER if in_loop else "")


def test_correct_reduction_passes_both_thread_orders():
    x = mx.random.normal((4 * 64,), key=mx.random.key(0))
    out = run(
        reduce_source(True, True), x, (256, 1, 1), (64, 1, 1), (4,), race_check=True
    )
    assert mx.allclose(out, x.reshape(4, 64).sum(axis=1), atol=1e-4).item()


@pytest.mark.parametrize(
    "after_store,in_loop", [(False, True), (True, False), (False, False)]
)
def test_missing_barrier_gives_wrong_result(after_store, in_loop):
    # Each thread runs until it blocks, so a reader that is not held back by
    # a barrier runs before the writers: it sees stale or uninitialised
    # (NaN-filled) threadgroup memory.
    x = mx.random.normal((4 * 64,), key=mx.random.key(1))
    out = run(reduce_source(after_store, in_loop), x, (256, 1, 1), (64, 1, 1), (4,))
    expect = x.reshape(4, 64).sum(axis=1)
    assert not mx.allclose(out, expect, atol=1e-3).item()


@pytest.mark.parametrize("after_store,in_loop", [(False, True), (True, False)])
def test_missing_barrier_is_detected_by_race_check(after_store, in_loop):
    x = mx.random.normal((4 * 64,), key=mx.random.key(2))
    with pytest.raises(MSLRaceError, match="depends on the order threads run in"):
        run(
            reduce_source(after_store, in_loop),
            x,
            (256, 1, 1),
            (64, 1, 1),
            (4,),
            race_check=True,
        )


def test_neighbour_exchange_without_barrier_is_a_race():
    # The last thread reads what thread 0 wrote: right in index order, wrong
    # in reverse order.  race_check runs both and compares.
    src = """
        uint t = thread_position_in_threadgroup.x;
        threadgroup float s[64];
        s[t] = x[t];
        out[t] = s[(t + 1) % 64];
    """
    out = np.array(run(src, schedule="forward"))
    assert np.isnan(out[:-1]).all() and out[-1] == 0  # readers ran before writers
    with pytest.raises(MSLRaceError):
        run(src, race_check=True)
    fixed = src.replace("s[t] = x[t];", "s[t] = x[t];" + BARRIER)
    out = np.array(run(fixed, race_check=True))
    assert np.array_equal(out, np.roll(np.arange(64), -1))


def test_uninitialised_threadgroup_memory_reads_nan():
    src = """
        threadgroup float s[64];
        out[thread_position_in_grid.x] = s[thread_position_in_threadgroup.x];
    """
    assert np.isnan(np.array(run(src))).all()


# ---------------------------------------------------------------------------
# Out-of-bounds accesses (debug mode)
# ---------------------------------------------------------------------------
def test_out_of_bounds_write_is_reported_in_debug_mode():
    src = "uint i = thread_position_in_grid.x; out[i + 1] = x[i];"
    with pytest.raises(MSLKernelError) as e:
        run(src, debug=True, name="shift_write")
    msg = str(e.value)
    assert "kernel 'shift_write'" in msg
    assert "out-of-bounds access to buffer 'out'" in msg
    assert "element 64 of a buffer of 64 element(s)" in msg
    assert "thread_position_in_grid=(63,0,0)" in msg


def test_debug_mode_from_the_environment(monkeypatch):
    src = "uint i = thread_position_in_grid.x; out[i + 1] = x[i];"
    monkeypatch.setenv("MLX_SPEC_MSL_DEBUG", "1")
    with pytest.raises(MSLKernelError, match="out-of-bounds access to buffer 'out'"):
        run(src)
    # debug=False on the call wins over the environment
    run(src.replace("i + 1", "i"), debug=False)


def test_out_of_bounds_read_is_reported_in_debug_mode():
    src = "uint i = thread_position_in_grid.x; out[i] = x[i] + x[int(i) - 1];"
    with pytest.raises(MSLKernelError, match="buffer 'x': element -1 "):
        run(src, debug=True)


def test_out_of_bounds_through_moved_pointer():
    src = """
        auto p = x + thread_position_in_grid.x * 2;
        p += 1;
        out[thread_position_in_grid.x] = *p;
    """
    with pytest.raises(MSLKernelError, match="buffer 'x': element 65 "):
        run(src, debug=True)
    # the same pointer arithmetic staying inside the buffer is fine
    ok = run(src, grid=(32, 1, 1), threadgroup=(32, 1, 1), out_shape=(32,), debug=True)
    assert np.array_equal(np.array(ok), np.arange(32) * 2 + 1)


def test_out_of_bounds_threadgroup_and_local_arrays():
    tg = """
        uint t = thread_position_in_threadgroup.x;
        threadgroup float s[32];
        s[t] = x[t];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = s[t];
    """
    with pytest.raises(
        MSLKernelError,
        match=r"index 32 into array of type 'float \[32\]' at source line 4",
    ):
        run(tg, debug=True)
    local = """
        float acc[4] = {0, 0, 0, 0};
        uint t = thread_position_in_grid.x;
        acc[t % 5] += x[t];
        out[t] = acc[0];
    """
    with pytest.raises(
        MSLKernelError,
        match=r"index 4 into array of type 'float \[4\]' at source line 4",
    ):
        run(local, debug=True)


def test_unsigned_index_wraparound_with_negative_strides():
    # elem_to_loc with a uint index wraps for negative strides: on a GPU that
    # reads far outside the buffer; here it is caught.
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = x[elem_to_loc(i, x_shape, x_strides, x_ndim)];
    """
    k = metal_kernel(
        name="wrap",
        input_names=["x"],
        output_names=["out"],
        source=src,
        ensure_row_contiguous=False,
    )
    x = mx.arange(24, dtype=mx.float32).reshape(4, 6)[::-1]
    with pytest.raises(MSLKernelError, match="out-of-bounds access to buffer 'x'"):
        k(
            inputs=[x],
            grid=(24, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[x.shape],
            output_dtypes=[mx.float32],
            debug=True,
        )


def test_wild_write_without_debug_is_an_error_not_a_crash():
    src = "uint i = thread_position_in_grid.x; out[i + (1u << 30)] = x[i];"
    with pytest.raises(MSLKernelError, match="segmentation fault in kernel code"):
        run(src, debug=False)
    # the process and the harness carry on
    out = run("uint i = thread_position_in_grid.x; out[i] = x[i];")
    assert np.array_equal(np.array(out), np.arange(64))


# ---------------------------------------------------------------------------
# SIMD-group divergence and width assumptions
# ---------------------------------------------------------------------------
def test_simd_sum_from_only_some_lanes():
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        if (thread_index_in_simdgroup < 16) {
            v = simd_sum(v);
        }
        out[i] = v;
    """
    with pytest.raises(MSLKernelError) as e:
        run(src)
    msg = str(e.value)
    assert "divergent SIMD collective" in msg
    assert "lane 16 returned while lane(s) 0-15 of SIMD group 0 wait in simd_sum" in msg
    assert "source line 5, column 17" in msg


def test_simd_sum_at_different_call_sites():
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        if (i % 2 == 0) v = simd_sum(v);
        else v = simd_sum(v * 2.0f);
        out[i] = v;
    """
    with pytest.raises(MSLKernelError) as e:
        run(src)
    msg = str(e.value)
    assert "lane 1 calls simd_sum at source line 5" in msg
    assert "wait in simd_sum at source line 4" in msg


def test_simd_collective_in_loop_with_lane_dependent_trip_count():
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        for (uint k = 0; k < 1 + thread_index_in_simdgroup % 3; ++k) {
            v = simd_shuffle_down(v, 1) + v;
        }
        out[i] = v;
    """
    with pytest.raises(MSLKernelError, match="divergent SIMD collective"):
        run(src)


def test_kernel_assuming_64_lane_simdgroups_fails_loudly():
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        for (ushort m = 32; m > 0; m >>= 1) v += simd_shuffle_xor(v, m);
        out[i] = v;
    """
    with pytest.raises(MSLKernelError, match="outside the 32-lane SIMD group"):
        run(src)
    src = "uint i = thread_position_in_grid.x; out[i] = simd_broadcast(x[i], 40);"
    with pytest.raises(MSLKernelError, match="reads lane 40, outside the 32-lane"):
        run(src)


def test_kernel_assuming_16_lane_simdgroups_gives_wrong_sums():
    # meant: one sum per 16 threads; simd_sum adds 32 lanes on Apple GPUs
    src = """
        uint i = thread_position_in_grid.x;
        float s = simd_sum(x[i]);
        if (i % 16 == 0) out[i / 16] = s;
    """
    x = mx.random.normal((64,), key=mx.random.key(3))
    out = run(src, x, out_shape=(4,), init_value=0)
    assert not mx.allclose(out, x.reshape(4, 16).sum(axis=1), atol=1e-3).item()


def test_shuffle_from_lanes_outside_a_partial_simdgroup_is_poison():
    # 40 threads: the second SIMD group has 8 lanes; lane 7 + 1 does not exist
    src = "uint i = thread_position_in_grid.x; out[i] = simd_shuffle_xor(x[i], 8);"
    out = np.array(run(src, grid=(40, 1, 1), out_shape=(40,)))
    assert np.array_equal(out[:32], np.arange(32) ^ 8)
    assert np.isnan(out[32:]).all()


# ---------------------------------------------------------------------------
# Barrier divergence
# ---------------------------------------------------------------------------
def test_barrier_in_divergent_branch():
    src = """
        uint i = thread_position_in_grid.x;
        if (i < 32) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[i] = 1.0f;
    """
    with pytest.raises(
        MSLKernelError, match="every thread of the threadgroup must reach"
    ):
        run(src)


def test_early_return_before_barrier():
    src = """
        uint i = thread_position_in_grid.x;
        if (i >= 60) return;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[i] = 1.0f;
    """
    with pytest.raises(MSLKernelError, match="returned while 60 thread"):
        run(src)


def test_different_barriers_in_branches():
    src = """
        uint i = thread_position_in_grid.x;
        if (i % 2) threadgroup_barrier(mem_flags::mem_threadgroup);
        else threadgroup_barrier(mem_flags::mem_device);
        out[i] = 1.0f;
    """
    with pytest.raises(MSLKernelError, match="divergent barriers"):
        run(src)


def test_barrier_against_simd_collective_deadlocks():
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        if (thread_index_in_simdgroup < 16) threadgroup_barrier(mem_flags::mem_threadgroup);
        else v = simd_sum(v);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[i] = v;
    """
    with pytest.raises(MSLKernelError, match="deadlock") as e:
        run(src, grid=(32, 1, 1), threadgroup=(32, 1, 1), out_shape=(32,))
    assert "wait in simd_sum at source line 5" in str(e.value)


# ---------------------------------------------------------------------------
# Resource limits and faults
# ---------------------------------------------------------------------------
def test_threadgroup_memory_limit():
    src = """
        threadgroup float big[9000];
        big[thread_position_in_threadgroup.x] = 1.0f;
        out[thread_position_in_grid.x] = 0.0f;
    """
    with pytest.raises(MSLKernelError, match="allow 32768 bytes per threadgroup"):
        run(src)


def test_stack_overflow_is_reported():
    src = """
        volatile float big[200000];
        uint i = thread_position_in_grid.x;
        big[i] = x[i];
        out[i] = big[i];
    """
    with pytest.raises(MSLKernelError, match="stack overflow"):
        run(src)


def test_integer_division_by_zero_is_reported():
    src = "uint i = thread_position_in_grid.x; out[i] = float(int(i) / int(x[0]));"
    with pytest.raises(MSLKernelError, match="integer division by zero"):
        run(src)
