"""The MSL harness on small kernels: signature, types, shapes and layout."""

import mlx.core as mx
import numpy as np
import pytest

from .harness import metal_kernel
from .kernel_texts import EXP_SOURCE, run1


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
