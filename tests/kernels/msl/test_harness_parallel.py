"""The MSL harness on small kernels: threadgroup memory, SIMD-group functions, atomics."""

import mlx.core as mx
import numpy as np
import pytest

from .harness import metal_kernel
from .kernel_texts import SIMD_SOURCE, TREE_REDUCE, run1

# ---------------------------------------------------------------------------
# Threadgroup memory
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("debug", [False, True])
def test_threadgroup_tree_reduction(debug):
    k = metal_kernel(
        name="tree", input_names=["x"], output_names=["out"], source=TREE_REDUCE
    )
    x = mx.random.normal((8 * 256,), key=mx.random.key(3))
    out = run1(k, [x], (x.size, 1, 1), (256, 1, 1), (8,), debug=debug, race_check=True)
    assert mx.allclose(out, x.reshape(8, 256).sum(axis=1), atol=1e-4).item()


def test_threadgroup_memory_is_per_threadgroup():
    # every group writes its own id into shared memory; no group sees another's
    src = """
        threadgroup int slot[2];
        uint g = threadgroup_position_in_grid.x;
        if (thread_index_in_threadgroup == 0) { slot[0] = g; slot[1] = 7; }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = slot[0] * 10 + slot[1];
    """
    k = metal_kernel(name="tgmem", input_names=["x"], output_names=["out"], source=src)
    out = np.array(
        run1(k, [mx.zeros((1,))], (40 * 6, 1, 1), (40, 1, 1), (240,), mx.int32)
    )
    assert np.array_equal(out, np.repeat(np.arange(6) * 10 + 7, 40))


def test_simd_then_threadgroup_reduction_with_header_helper():
    header = """
    template <typename T>
    METAL_FUNC T block_sum(T v, threadgroup T* scratch, uint sg, uint lane, uint nsg) {
        v = simd_sum(v);
        if (lane == 0) scratch[sg] = v;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        T r = lane < nsg ? scratch[lane] : T(0);
        return metal::simd_sum(r);
    }
    """
    src = """
        threadgroup float scratch[32];
        float v = x[thread_position_in_grid.x];
        float s = block_sum(v, scratch, simdgroup_index_in_threadgroup,
                            thread_index_in_simdgroup, simdgroups_per_threadgroup);
        if (thread_index_in_threadgroup == 0) out[threadgroup_position_in_grid.x] = s;
    """
    k = metal_kernel(
        name="blocksum",
        input_names=["x"],
        output_names=["out"],
        source=src,
        header=header,
    )
    x = mx.random.normal((3 * 512,), key=mx.random.key(4))
    out = run1(k, [x], (x.size, 1, 1), (512, 1, 1), (3,))
    assert mx.allclose(out, x.reshape(3, 512).sum(axis=1), atol=1e-4).item()


# ---------------------------------------------------------------------------
# SIMD-group functions
# ---------------------------------------------------------------------------


def test_simd_functions():
    k = metal_kernel(
        name="simd", input_names=["x"], output_names=["out"], source=SIMD_SOURCE
    )
    x = mx.random.normal((128,), key=mx.random.key(5))
    out = np.array(run1(k, [x], (128, 1, 1), (64, 1, 1), (128 * 8,))).reshape(4, 32, 8)
    xv = np.array(x).reshape(4, 32)
    for g in range(4):
        v = xv[g]
        assert np.allclose(out[g, :, 0], v.sum(), atol=1e-5)
        assert np.allclose(out[g, :, 1], v.sum(), atol=1e-5)
        assert np.allclose(out[g, :, 2], v.sum(), atol=1e-5)
        assert np.all(out[g, :, 3] == v.max()) and np.all(out[g, :, 4] == v.min())
        assert np.allclose(
            out[g, :, 5], np.concatenate([[0], np.cumsum(v)[:-1]]), atol=1e-5
        )
        assert np.array_equal(out[g, :, 6], np.concatenate([[v[0]], v[:-1]]))
        assert np.array_equal(out[g, :, 7], v[(np.arange(32) + 5) % 32])
    # simd_sum is the xor-butterfly tree: bit-identical to the written-out one
    assert np.array_equal(out[:, :, 0], out[:, :, 2])


def test_simd_sum_of_partial_simdgroup_uses_active_lanes():
    src = "uint i = thread_position_in_grid.x; out[i] = simd_sum(x[i]);"
    k = metal_kernel(
        name="partial", input_names=["x"], output_names=["out"], source=src
    )
    x = mx.arange(40, dtype=mx.float32)
    out = np.array(run1(k, [x], (40, 1, 1), (64, 1, 1), (40,)))
    assert np.all(out[:32] == np.arange(32).sum()) and np.all(
        out[32:] == np.arange(32, 40).sum()
    )


def test_simd_vector_and_integer_values():
    src = """
        uint i = thread_position_in_grid.x;
        float2 v = float2(x[i], 1.0f);
        float2 s = simd_sum(v);
        int c = simd_sum(int(i));
        bool any_big = simd_any(x[i] > 30.0f);
        bool all_pos = simd_all(x[i] >= 0.0f);
        out[4 * i + 0] = s.x;
        out[4 * i + 1] = s.y;
        out[4 * i + 2] = float(c);
        out[4 * i + 3] = float(any_big) * 10 + float(all_pos);
    """
    k = metal_kernel(
        name="simdvec", input_names=["x"], output_names=["out"], source=src
    )
    x = mx.arange(32, dtype=mx.float32)
    out = np.array(run1(k, [x], (32, 1, 1), (32, 1, 1), (128,))).reshape(32, 4)
    assert np.all(out == [496, 32, 496, 11])


# ---------------------------------------------------------------------------
# Atomics
# ---------------------------------------------------------------------------
def test_atomic_histogram_outputs():
    src = """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&hist[bins[i]], 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&total[0], 1, memory_order_relaxed);
    """
    k = metal_kernel(
        name="hist",
        input_names=["bins"],
        output_names=["hist", "total"],
        source=src,
        atomic_outputs=True,
    )
    bins = mx.random.randint(0, 10, (1000,), key=mx.random.key(6)).astype(mx.uint32)
    for debug in (False, True):
        hist, total = k(
            inputs=[bins],
            grid=(1000, 1, 1),
            threadgroup=(128, 1, 1),
            output_shapes=[(10,), (1,)],
            output_dtypes=[mx.int32, mx.int32],
            init_value=0,
            debug=debug,
        )
        assert np.array_equal(np.array(hist), np.bincount(np.array(bins), minlength=10))
        assert int(total[0]) == 1000


def test_atomic_float_and_threadgroup_atomics():
    src = """
        threadgroup atomic<int> count;
        threadgroup atomic_float acc;
        if (thread_index_in_threadgroup == 0) {
            atomic_store_explicit(&count, 0, memory_order_relaxed);
            atomic_store_explicit(&acc, 0.0f, memory_order_relaxed);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&count, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&acc, x[i], memory_order_relaxed);
        atomic_fetch_max_explicit((device atomic_float*)&out[2], x[i], memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (thread_index_in_threadgroup == 0) {
            atomic_fetch_add_explicit(&out[0], float(atomic_load_explicit(&count, memory_order_relaxed)), memory_order_relaxed);
            atomic_fetch_add_explicit(&out[1], atomic_load_explicit(&acc, memory_order_relaxed), memory_order_relaxed);
        }
    """
    k = metal_kernel(
        name="atomf",
        input_names=["x"],
        output_names=["out"],
        source=src,
        atomic_outputs=True,
    )
    x = mx.arange(256, dtype=mx.float32) / 8
    out = np.array(run1(k, [x], (256, 1, 1), (64, 1, 1), (3,), init_value=0))
    assert (
        out[0] == 256
        and np.isclose(out[1], float(np.array(x).sum()))
        and out[2] == 255 / 8
    )


def test_more_simd_functions():
    src = """
        uint i = thread_position_in_grid.x;
        uint lane = thread_index_in_simdgroup;
        float v = x[i];
        simdgroup_barrier(mem_flags::mem_none);
        simd_vote vote = simd_ballot(lane % 3 == 0);
        out[6 * i + 0] = float(static_cast<simd_vote::vote_t>(vote) == 0x49249249u);
        out[6 * i + 1] = float(simd_is_first());
        out[6 * i + 2] = simd_broadcast_first(v);
        out[6 * i + 3] = simd_prefix_inclusive_sum(v);
        out[6 * i + 4] = simd_product(lane < 4 ? 2.0f : 1.0f);
        out[6 * i + 5] = simd_shuffle_rotate_down(v, 3);
    """
    k = metal_kernel(name="simd2", input_names=["x"], output_names=["out"], source=src)
    x = mx.arange(32, dtype=mx.float32)
    out = np.array(run1(k, [x], (32, 1, 1), (32, 1, 1), (32 * 6,))).reshape(32, 6)
    assert np.all(out[:, 0] == 1)
    assert np.array_equal(out[:, 1], (np.arange(32) == 0).astype(np.float32))
    assert np.all(out[:, 2] == 0)
    assert np.array_equal(out[:, 3], np.cumsum(np.arange(32)))
    assert np.all(out[:, 4] == 16)
    assert np.array_equal(out[:, 5], (np.arange(32) + 3) % 32)
