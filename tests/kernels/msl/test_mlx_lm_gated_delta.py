"""mlx-lm's gated-delta Metal kernels, run by the harness, against mlx-lm's ops.

The kernels are built by mlx-lm's own factories with the harness standing in
for ``mx.fast.metal_kernel`` (and ``mx.metal.is_available`` patched true), so
the exact kernel text that runs on Apple GPUs runs here.  These kernels are
known to be correct on the GPU, so agreement with ``gated_delta_ops`` checks
the harness as much as the kernels.
"""

import mlx.core as mx
import pytest

from . import harness

gd = pytest.importorskip("mlx_lm.models.gated_delta")

# (B, T, Hk, Hv, Dk, Dv)
SHAPES = [
    (1, 1, 2, 4, 32, 16),
    (2, 3, 2, 4, 32, 32),
    (1, 9, 2, 4, 64, 48),
    (2, 5, 2, 2, 64, 64),
    (1, 4, 4, 4, 128, 128),
    (2, 9, 2, 4, 128, 64),
    (1, 2, 1, 2, 128, 16),
]
PACKED_SHAPES = [s for s in SHAPES if s[4] == 128 and s[5] % 8 == 0]
TOL = 1e-4


def _factory(name):
    f = getattr(gd, name, None)
    if f is None:
        pytest.skip(f"this mlx-lm has no {name}")
    return f


@pytest.fixture(scope="module")
def kernels():
    """mlx-lm's kernels, built through the harness."""
    with harness.use_harness():
        make = _factory("_make_gated_delta_kernel")
        built = {
            "plain": make(has_mask=False, vectorized=False),
            "mask": make(has_mask=True, vectorized=False),
            "vec": make(has_mask=False, vectorized=True),
            "vec_mask": make(has_mask=True, vectorized=True),
        }
        for key, name in (
            ("packed", "_make_gated_delta_packed_kernel"),
            ("xtree", "_make_gated_delta_kernel_xtree"),
        ):
            f = getattr(gd, name, None)
            built[key] = f() if f is not None else None
    for k in built.values():
        assert k is None or isinstance(k, harness.HarnessKernel)
    return built


@pytest.fixture
def dispatch(kernels, monkeypatch):
    """mlx-lm's module-level kernels replaced by the harness-built ones, so
    its own dispatcher (gated_delta_kernel) picks kernel, grid and
    threadgroup exactly as on the GPU."""
    names = {
        "plain": "_gated_delta_kernel",
        "mask": "_gated_delta_kernel_masked",
        "vec": "_gated_delta_kernel_vec",
        "vec_mask": "_gated_delta_kernel_vec_masked",
        "packed": "_gated_delta_kernel_packed",
        "xtree": "_gated_delta_kernel_xtree",
    }
    for key, attr in names.items():
        if hasattr(gd, attr):
            monkeypatch.setattr(gd, attr, kernels[key])
    return gd


def make_inputs(
    B, T, Hk, Hv, Dk, Dv, vectorized=False, masked=False, dtype=mx.float32, seed=0
):
    keys = mx.random.split(mx.random.key(seed), 8)
    q = mx.random.normal((B, T, Hk, Dk), key=keys[0]) * Dk**-0.5
    k = mx.random.normal((B, T, Hk, Dk), key=keys[1]) * Dk**-0.5
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2])
    g_shape = (B, T, Hv, Dk) if vectorized else (B, T, Hv)
    g = mx.random.uniform(0.3, 1.0, g_shape, key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv), key=keys[4])
    state = mx.random.normal((B, Hv, Dv, Dk), key=keys[5]) * 0.1
    mask = None
    if masked:
        mask = mx.random.uniform(shape=(B, T), key=keys[6]) > 0.4
        mask[:, 0] = True  # at least one live step per sequence
    q, k, v, beta = (x.astype(dtype) for x in (q, k, v, beta))
    return q, k, v, g, beta, state, mask


def reference(q, k, v, g, beta, state, mask):
    y, s = gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    if mask is not None:
        # the kernels write y = 0 for masked steps; the ops compute it anyway
        y = mx.where(mask[:, :, None, None], y, mx.zeros_like(y))
    return y, s


def max_err(a, b):
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: "B{}T{}Hk{}Hv{}Dk{}Dv{}".format(*s)
)
@pytest.mark.parametrize(
    "vectorized,masked",
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["scalar", "scalar-mask", "vec", "vec-mask"],
)
def test_kernels_match_ops(dispatch, shape, vectorized, masked):
    q, k, v, g, beta, state, mask = make_inputs(
        *shape, vectorized=vectorized, masked=masked
    )
    y, s = dispatch.gated_delta_kernel_unpacked(q, k, v, g, beta, state, mask)
    y_ref, s_ref = reference(q, k, v, g, beta, state, mask)
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    assert max_err(y, y_ref) < TOL
    assert max_err(s, s_ref) < TOL


@pytest.mark.parametrize(
    "shape", PACKED_SHAPES, ids=lambda s: "B{}T{}Hk{}Hv{}Dk{}Dv{}".format(*s)
)
def test_packed_kernel_matches_ops_and_is_bitwise_the_explicit_tree(
    kernels, dispatch, shape
):
    if kernels["packed"] is None or kernels["xtree"] is None:
        pytest.skip("this mlx-lm has no packed kernel")
    q, k, v, g, beta, state, _ = make_inputs(*shape, seed=1)
    # the dispatcher takes the packed path for these shapes
    y_p, s_p = dispatch.gated_delta_kernel(q, k, v, g, beta, state)
    y_ref, s_ref = reference(q, k, v, g, beta, state, None)
    assert max_err(y_p, y_ref) < TOL and max_err(s_p, s_ref) < TOL
    # mlx-lm's contract: packed == explicit-tree comparator, bit for bit
    y_x, s_x = dispatch.gated_delta_kernel_xtree(q, k, v, g, beta, state)
    assert mx.array_equal(y_p, y_x).item() and mx.array_equal(s_p, s_x).item()
    # and simd_sum in the harness reduces in the same butterfly order, so
    # the generic kernel is bit-identical too (as on current Apple GPUs)
    y_u, s_u = dispatch.gated_delta_kernel_unpacked(q, k, v, g, beta, state)
    assert mx.array_equal(y_u, y_x).item() and mx.array_equal(s_u, s_x).item()


def test_packed_kernel_runs_the_packed_path(kernels, dispatch, monkeypatch):
    if kernels["packed"] is None:
        pytest.skip("this mlx-lm has no packed kernel")
    calls = []
    real = kernels["packed"].__call__

    class Spy:
        def __call__(self, **kw):
            calls.append((kw["grid"], kw["threadgroup"]))
            return real(**kw)

    monkeypatch.setattr(gd, "_gated_delta_kernel_packed", Spy())
    q, k, v, g, beta, state, _ = make_inputs(1, 2, 2, 4, 128, 32)
    gd.gated_delta_kernel(q, k, v, g, beta, state)
    assert calls == [((32, 4, 4), (32, 2, 1))]


def test_bfloat16_inputs(dispatch):
    shape = (1, 4, 2, 4, 64, 32)
    q, k, v, g, beta, state, _ = make_inputs(*shape, dtype=mx.bfloat16, seed=2)
    y, s = dispatch.gated_delta_kernel_unpacked(q, k, v, g, beta, state)
    assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
    f32 = [x.astype(mx.float32) for x in (q, k, v, beta)]
    y_ref, s_ref = reference(f32[0], f32[1], f32[2], g, f32[3], state, None)
    assert max_err(y, y_ref) < 2e-2
    assert max_err(s, s_ref) < 1e-4


def test_kernels_are_clean_under_debug_checks():
    """Bounds-checked buffers, checked local arrays, both thread orders."""
    shape = (2, 3, 2, 4, 64, 16)
    with harness.use_harness(debug=True, race_check=True):
        make = _factory("_make_gated_delta_kernel")
        plain = make(has_mask=False, vectorized=False)
        vec_mask = make(has_mask=True, vectorized=True)
    for kernel, vectorized, masked in ((plain, False, False), (vec_mask, True, True)):
        q, k, v, g, beta, state, mask = make_inputs(
            *shape, vectorized=vectorized, masked=masked
        )
        B, T, Hk, Dk = k.shape
        Hv, Dv = v.shape[2:]
        inputs = [q, k, v, g, beta, state, T] + ([mask] if masked else [])
        y, s = kernel(
            inputs=inputs,
            template=[
                ("InT", q.dtype),
                ("StT", state.dtype),
                ("Dk", Dk),
                ("Dv", Dv),
                ("Hk", Hk),
                ("Hv", Hv),
            ],
            grid=(32, Dv, B * Hv),
            threadgroup=(32, 4, 1),
            output_shapes=[(B, T, Hv, Dv), state.shape],
            output_dtypes=[q.dtype, state.dtype],
        )
        y_ref, s_ref = reference(q, k, v, g, beta, state, mask)
        assert max_err(y, y_ref) < TOL and max_err(s, s_ref) < TOL


def test_generated_signature_matches_mlx_rules(kernels):
    q, k, v, g, beta, state, mask = make_inputs(1, 3, 2, 4, 32, 16, masked=True)
    text = kernels["mask"].metal_source(
        [q, k, v, g, beta, state, 3, mask],
        [mx.float32, mx.float32],
        template=[("InT", mx.float32), ("StT", mx.float32), ("Dk", 32), ("Dv", 16)]
        + [("Hk", 2), ("Hv", 4)],
    )
    assert (
        "template <typename InT, typename StT, int Dk, int Dv, int Hk, int Hv>" in text
    )
    assert "const constant int32_t& T [[buffer(6)]]" in text
    assert "const constant bool* mask [[buffer(7)]]" in text  # 3 elements < 8
    assert "device float* state_out [[buffer(9)]]" in text
    for attr in (
        "thread_position_in_grid",
        "thread_position_in_threadgroup",
        "thread_index_in_simdgroup",
    ):
        assert f"[[{attr}]]" in text
    assert "threadgroup_position_in_grid" not in text
