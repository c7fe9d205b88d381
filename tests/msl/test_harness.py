"""The MSL harness on small kernels: signature, types, memory, SIMD, atomics."""

import mlx.core as mx
import numpy as np
import pytest

from . import harness
from .harness import MSLCompileError, metal_kernel

EXP_SOURCE = """
    uint elem = thread_position_in_grid.x;
    T tmp = inp[elem];
    out[elem] = metal::exp(tmp);
"""


def run1(kernel, inputs, grid, threadgroup, shape, dtype=mx.float32, **kw):
    return kernel(
        inputs=inputs,
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[shape],
        output_dtypes=[dtype],
        **kw,
    )[0]


# ---------------------------------------------------------------------------
# Elementwise kernels and types
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,tol", [(mx.float32, 1e-6), (mx.float16, 1e-3), (mx.bfloat16, 1e-2)]
)
def test_elementwise_template_types(dtype, tol):
    k = metal_kernel(
        name="myexp", input_names=["inp"], output_names=["out"], source=EXP_SOURCE
    )
    a = (mx.random.normal((4, 16), key=mx.random.key(0))).astype(dtype)
    out = run1(
        k, [a], (a.size, 1, 1), (256, 1, 1), a.shape, dtype, template=[("T", dtype)]
    )
    assert out.dtype == dtype
    ref = mx.exp(a.astype(mx.float32))
    assert mx.allclose(out.astype(mx.float32), ref, rtol=tol, atol=tol).item()


def test_half_and_bfloat_arithmetic_rounds_like_the_types():
    # half*half stays half (rounded), bf16 op float is float, as in MSL/MLX.
    src = """
        uint i = thread_position_in_grid.x;
        half h = static_cast<half>(a[i]);
        bfloat16_t b = static_cast<bfloat16_t>(a[i]);
        out[3 * i + 0] = static_cast<float>(h * h);
        out[3 * i + 1] = static_cast<float>(b * b);
        out[3 * i + 2] = b * 1.0001f;
    """
    k = metal_kernel(
        name="rounding", input_names=["a"], output_names=["out"], source=src
    )
    a = mx.array([1.1, 3.3, -7.77, 1000.1], dtype=mx.float32)
    out = np.array(run1(k, [a], (4, 1, 1), (4, 1, 1), (12,))).reshape(4, 3)
    an = np.array(a)
    h = an.astype(np.float16)
    with np.errstate(over="ignore"):
        assert np.array_equal(out[:, 0], (h * h).astype(np.float32))  # 1000.1^2 -> inf
    b = a.astype(mx.bfloat16)
    assert np.array_equal(out[:, 1], np.array((b * b).astype(mx.float32)))
    assert np.allclose(out[:, 2], np.array(b.astype(mx.float32)) * 1.0001, rtol=1e-6)


def test_half_literals_vectors_and_math():
    src = """
        uint i = thread_position_in_grid.x;
        float4 v = float4(x[4 * i], x[4 * i + 1], float2(x[4 * i + 2], x[4 * i + 3]));
        v = v * 2.0f + float4(0.5h);
        float4 w = metal::max(v, float4(1.0f));
        out[i] = dot(w, float4(1.0f)) + metal::precise::exp(0.0f) + fast::tanh(0.0f)
                 + clamp(-3.0f, 0.0f, 1.0f) + select(1.0f, 2.0f, v.x > 100.0f);
    """
    k = metal_kernel(
        name="vecmath", input_names=["x"], output_names=["out"], source=src
    )
    x = mx.arange(8, dtype=mx.float32) - 2
    out = run1(k, [x], (2, 1, 1), (2, 1, 1), (2,))
    v = np.array(x).reshape(2, 4) * 2 + 0.5
    expect = np.maximum(v, 1).sum(1) + 1.0 + 0.0 + 0.0 + 1.0
    assert np.allclose(np.array(out), expect)


def test_scalar_and_small_inputs():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = x[i] * scale + float(offset) + coeffs[i % 3];
    """
    k = metal_kernel(
        name="scalars",
        input_names=["x", "scale", "offset", "coeffs"],
        output_names=["out"],
        source=src,
    )
    x = mx.arange(10, dtype=mx.float32)
    coeffs = mx.array([100.0, 200.0, 300.0])
    out = run1(k, [x, 2.0, 7, coeffs], (10, 1, 1), (16, 1, 1), (10,))
    expect = np.arange(10) * 2 + 7 + np.array([100, 200, 300])[np.arange(10) % 3]
    assert np.allclose(np.array(out), expect)
    # the signature follows MLX's rules: 0-d -> constant reference, fewer
    # than 8 elements -> constant pointer, else device pointer
    text = k.metal_source([x, 2.0, 7, coeffs], [mx.float32])
    assert "const device float* x [[buffer(0)]]" in text
    assert "const constant float& scale [[buffer(1)]]" in text
    assert "const constant int32_t& offset [[buffer(2)]]" in text
    assert "const constant float* coeffs [[buffer(3)]]" in text
    assert "device float* out [[buffer(4)]]" in text
    assert "uint3 thread_position_in_grid [[thread_position_in_grid]]" in text
    assert "thread_index_in_simdgroup" not in text


def test_signature_templates_shapes_and_atomics():
    src = "uint n = inp_shape[0] + inp_ndim; (void)n; out[0] = 0;"
    k = metal_kernel(
        name="sig",
        input_names=["inp"],
        output_names=["out"],
        source=src,
        atomic_outputs=True,
    )
    text = k.metal_source(
        [mx.zeros((3, 4))],
        [mx.int32],
        template=[("T", mx.float16), ("N", 3), ("B", True)],
    )
    assert text.startswith("template <typename T, int N, bool B>\n")
    assert "const constant int* inp_shape [[buffer(1)]]" in text
    assert "inp_strides" not in text
    assert "const constant int& inp_ndim [[buffer(2)]]" in text
    assert "device atomic<int32_t>* out [[buffer(3)]]" in text
    # MLX's naming: name, "_", then the template list with <, > and ", " as "_"
    assert "void custom_kernel_sig__float16_t_3_1_float_int32_t(" in text
    assert (
        "decltype(custom_kernel_sig__float16_t_3_1_float_int32_t<float16_t, 3, 1>)"
        in text
    )


def test_verbose_prints_generated_source(capsys):
    k = metal_kernel(
        name="myexp", input_names=["inp"], output_names=["out"], source=EXP_SOURCE
    )
    a = mx.ones((8,))
    run1(k, [a], (8, 1, 1), (8, 1, 1), (8,), template=[("T", mx.float32)], verbose=True)
    printed = capsys.readouterr().out
    assert "[[kernel]] void custom_kernel_myexp__float_float_float(" in printed
    assert "const device float* inp [[buffer(0)]]" in printed


# ---------------------------------------------------------------------------
# Shapes, strides, layout
# ---------------------------------------------------------------------------
def test_shape_parameter():
    # one thread per row; the row length comes from inp_shape
    src = """
        uint row = thread_position_in_grid.x;
        int cols = inp_shape[inp_ndim - 1];
        float s = 0.0f;
        for (int c = 0; c < cols; ++c) s += inp[row * cols + c];
        out[row] = s;
    """
    k = metal_kernel(
        name="rowsum", input_names=["inp"], output_names=["out"], source=src
    )
    x = mx.random.normal((5, 7), key=mx.random.key(1))
    out = run1(k, [x], (5, 1, 1), (8, 1, 1), (5,))
    assert mx.allclose(out, x.sum(axis=1), atol=1e-5).item()


def test_ensure_row_contiguous_copies_transposed_input():
    src = "uint i = thread_position_in_grid.x; out[i] = inp[i];"
    k = metal_kernel(name="copy", input_names=["inp"], output_names=["out"], source=src)
    x = mx.arange(12, dtype=mx.float32).reshape(3, 4).T  # not row contiguous
    out = run1(k, [x], (12, 1, 1), (12, 1, 1), (4, 3))
    assert mx.array_equal(out, x).item()


def test_strided_input_without_copy():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = inp[elem_to_loc<int64_t>(i, inp_shape, inp_strides, inp_ndim)];
    """
    k = metal_kernel(
        name="strided",
        input_names=["inp"],
        output_names=["out"],
        source=src,
        ensure_row_contiguous=False,
    )
    base = mx.arange(24, dtype=mx.float32).reshape(4, 6)
    for x in (
        base.T,
        base[:, ::2],
        base[::-1],
        mx.broadcast_to(mx.arange(6.0), (3, 6)),
    ):
        out = run1(k, [x], (x.size, 1, 1), (32, 1, 1), x.shape, debug=True)
        assert mx.array_equal(out, x).item()


def test_init_value_and_unwritten_outputs_are_poisoned():
    src = "uint i = thread_position_in_grid.x; if (i % 2 == 0) out[i] = 1.0f;"
    k = metal_kernel(
        name="half_write", input_names=["x"], output_names=["out"], source=src
    )
    x = mx.zeros((8,))
    out = np.array(run1(k, [x], (8, 1, 1), (8, 1, 1), (8,), init_value=-3.0))
    assert np.array_equal(out, [1, -3, 1, -3, 1, -3, 1, -3])
    # no init_value: memory the kernel never writes is NaN, not zero
    out = np.array(run1(k, [x], (8, 1, 1), (8, 1, 1), (8,)))
    assert np.all(out[::2] == 1) and np.all(np.isnan(out[1::2]))


def test_thread_position_attributes_with_partial_threadgroups():
    src = """
        uint3 g = thread_position_in_grid;
        uint idx = (g.z * grid_size.y + g.y) * grid_size.x + g.x;
        device int* o = out + idx * 8;
        o[0] = thread_position_in_threadgroup.x;
        o[1] = thread_position_in_threadgroup.y;
        o[2] = threadgroup_position_in_grid.x;
        o[3] = threads_per_threadgroup.x * threads_per_threadgroup.y;
        o[4] = thread_index_in_threadgroup;
        o[5] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
        o[6] = threadgroups_per_grid.x;
        o[7] = simdgroups_per_threadgroup * 1000 + threads_per_simdgroup;
    """
    k = metal_kernel(name="attrs", input_names=["x"], output_names=["out"], source=src)
    grid, tg = (70, 3, 1), (32, 2, 1)
    out = np.array(
        run1(k, [mx.zeros((1,))], grid, tg, (70 * 3 * 8,), mx.int32)
    ).reshape(3, 70, 8)
    for y in range(3):
        for x in range(70):
            gx, gy = x // 32, y // 2
            tx = min(32, 70 - gx * 32)
            ty = min(2, 3 - gy * 2)
            lx, ly = x % 32, y % 2
            tid = ly * tx + lx
            n = tx * ty
            expect = [lx, ly, gx, n, tid, (tid // 32) * 100 + tid % 32, 3]
            expect.append(((n + 31) // 32) * 1000 + 32)
            assert list(out[y, x]) == expect, (x, y)


def test_large_3d_grid_matches_numpy():
    src = """
        uint3 p = thread_position_in_grid;
        uint i = (p.z * 9 + p.y) * 33 + p.x;
        out[i] = a[i] * 2.0f + float(p.z);
    """
    k = metal_kernel(name="grid3", input_names=["a"], output_names=["out"], source=src)
    a = mx.random.normal((5, 9, 33), key=mx.random.key(2))
    out = run1(k, [a], (33, 9, 5), (16, 4, 2), a.shape)
    expect = np.array(a) * 2 + np.arange(5)[:, None, None]
    assert np.allclose(np.array(out), expect)


# ---------------------------------------------------------------------------
# Threadgroup memory
# ---------------------------------------------------------------------------
TREE_REDUCE = """
    uint t = thread_position_in_threadgroup.x;
    threadgroup float buf[256];
    buf[t] = x[thread_position_in_grid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = threads_per_threadgroup.x / 2; s > 0; s /= 2) {
        if (t < s) buf[t] += buf[t + s];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (t == 0) out[threadgroup_position_in_grid.x] = buf[0];
"""


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
SIMD_SOURCE = """
    uint i = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    float v = x[i];
    // butterfly all-reduce
    float b = v;
    for (ushort m = 1; m < 32; m <<= 1) b += simd_shuffle_xor(b, m);
    // tree reduce toward lane 0
    float d = v;
    for (ushort off = 16; off > 0; off >>= 1) d += simd_shuffle_down(d, off);
    out[8 * i + 0] = b;
    out[8 * i + 1] = simd_broadcast(d, 0);
    out[8 * i + 2] = simd_sum(v);
    out[8 * i + 3] = simd_max(v);
    out[8 * i + 4] = simd_min(v);
    out[8 * i + 5] = simd_prefix_exclusive_sum(v);
    out[8 * i + 6] = simd_shuffle_up(v, 1);
    out[8 * i + 7] = simd_shuffle(v, (lane + 5) % 32);
"""


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
