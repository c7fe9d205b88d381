"""The GDN verify kernel (mlx_spec.kernels.gated_delta) run by the MSL harness.

Checks: against its reference (token-by-token mlx-lm) on the real
Qwen3-Next-80B-A3B / Qwen3.5-35B-A3B GDN dims and on tiny odd shapes;
bit-for-bit against mlx-lm's own Metal kernels run one token at a time (what
plain decoding on a Mac runs); the slot-pool layout and the state manager's
"store" and "replay" rollbacks through the kernel.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gated_delta as gd

from mlx_spec.kernels import switch as kernels
from mlx_spec.kernels.gated_delta import (
    gated_delta_steps,
    gated_delta_steps_reference,
    lanes_per_row,
)

from . import harness

# (B, T, Hk, Hv, Dk, Dv); both real models have 16 key / 32 value heads of 128
REAL = [(1, 1, 16, 32, 128, 128), (1, 9, 16, 32, 128, 128)]
TINY = [(2, 3, 1, 3, 32, 5), (1, 5, 2, 4, 64, 24), (3, 2, 2, 2, 96, 7)]


def rel_err(a, b) -> float:
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def make_inputs(B, T, Hk, Hv, Dk, Dv, dtype=mx.float32, seed=0, masked=False):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk)).astype(dtype)
    k = mx.random.normal((B, T, Hk, Dk)).astype(dtype)
    q, k = gd.normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    a = mx.random.normal((B, T, Hv)).astype(dtype)
    b = mx.random.normal((B, T, Hv)).astype(dtype)
    A_log, dt_bias = mx.random.normal((Hv,)), mx.random.normal((Hv,))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk))
    mask = None
    if masked:
        mask = mx.random.uniform(shape=(B, T)) > 0.3
        mask[:, 0] = True
    return (q, k, v, a, b, A_log, dt_bias, state), mask


def run_kernel(args, mask=None, keep_states=True):
    """y and the per-token states stacked [T, B, Hv, Dv, Dk] (or the final
    state), through the dispatcher with kernels on."""
    with harness.use_harness(), kernels.use_mode("on"):
        y, states = gated_delta_steps(*args, mask, keep_states=keep_states)
        states = mx.stack(states) if keep_states else states
        mx.eval(y, states)
    return y, states


@pytest.mark.parametrize("shape", REAL + TINY)
def test_matches_reference_float32(shape):
    args, _ = make_inputs(*shape)
    y, states = run_kernel(args)
    y_ref, states_ref = gated_delta_steps_reference(*args)
    assert isinstance(states, mx.array) and states.shape[0] == shape[1]
    assert rel_err(y, y_ref) < 1e-5
    assert rel_err(states, mx.stack(states_ref)) < 1e-5


@pytest.mark.parametrize("shape", [(1, 4, 16, 32, 128, 128), TINY[1]])
def test_matches_reference_float16_masked(shape):
    args, mask = make_inputs(*shape, dtype=mx.float16, masked=True)
    y, states = run_kernel(args, mask)
    # the exact answer for these inputs: the reference in float32
    exact = [x.astype(mx.float32) for x in args]
    y_ref, states_ref = gated_delta_steps_reference(*exact, mask)
    # masked tokens: mlx-lm's kernels write y = 0, its ops compute y anyway;
    # the state is left unchanged by both
    keep = mask[..., None, None]
    assert rel_err(mx.where(keep, y, 0), mx.where(keep, y_ref, 0)) < 1e-3
    assert rel_err(states, mx.stack(states_ref)) < 1e-3


@pytest.fixture
def mlx_lm_kernels(monkeypatch):
    """mlx-lm's kernels built through the harness, put into its module."""
    with harness.use_harness():
        built = {
            "_gated_delta_kernel": gd._make_gated_delta_kernel(False, False),
            "_gated_delta_kernel_masked": gd._make_gated_delta_kernel(True, False),
        }
        if hasattr(gd, "_make_gated_delta_packed_kernel"):
            built["_gated_delta_kernel_packed"] = gd._make_gated_delta_packed_kernel()
    for name, k in built.items():
        monkeypatch.setattr(gd, name, k)


def mlx_lm_token_by_token(q, k, v, a, b, A_log, dt_bias, state, mask=None):
    beta, g = mx.sigmoid(b), gd.compute_g(A_log, a, dt_bias)
    ys, states = [], []
    for t in range(q.shape[1]):
        sl = slice(t, t + 1)
        m = None if mask is None else mask[:, sl]
        y, state = gd.gated_delta_kernel(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state, m
        )
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), mx.stack(states)


@pytest.mark.parametrize(
    "shape,dtype,masked",
    [
        ((1, 4, 16, 32, 128, 128), mx.bfloat16, False),  # packed layout
        ((1, 3, 16, 32, 128, 128), mx.float32, True),
        ((2, 3, 1, 3, 32, 5), mx.bfloat16, True),
        ((1, 5, 2, 4, 64, 24), mx.float32, False),
    ],
)
def test_bit_identical_to_mlx_lm_kernels_per_token(
    mlx_lm_kernels, shape, dtype, masked
):
    args, mask = make_inputs(*shape, dtype=dtype, masked=masked)
    y, states = run_kernel(args, mask)
    with harness.use_harness():
        y_lm, states_lm = mlx_lm_token_by_token(*args, mask)
    assert lanes_per_row(shape[4], shape[5], masked) == (
        4 if shape[4] == 128 and not masked else 32
    )
    assert mx.array_equal(y, y_lm) and mx.array_equal(states, states_lm)


def test_states_layout_and_final_state():
    args, _ = make_inputs(1, 3, 2, 4, 32, 16)
    y, states = run_kernel(args)
    assert states.shape == (3, 1, 4, 16, 32)
    y2, final = run_kernel(args, keep_states=False)
    _, states_ref = gated_delta_steps_reference(*args)
    assert mx.array_equal(y, y2)
    assert mx.array_equal(final, states[2])
    assert rel_err(states, mx.stack(states_ref)) < 1e-5


def test_dispatcher_returns_the_references_types():
    """Kernel and reference both give the list of T per-token states."""
    args, _ = make_inputs(1, 3, 2, 4, 32, 16)
    for mode in ("on", "off"):
        with harness.use_harness(), kernels.use_mode(mode):
            _, states = gated_delta_steps(*args)
            mx.eval(states)
        assert isinstance(states, list) and len(states) == 3
        assert all(s.shape == (1, 4, 16, 32) for s in states)


@pytest.mark.parametrize("rollback", ["store", "replay"])
def test_state_manager_rollback_through_kernel(rollback):
    from mlx_spec.core.state import GDNSlotCache

    (q, k, v, a, b, A_log, dt_bias, state), _ = make_inputs(1, 4, 2, 4, 32, 16)
    conv = mx.random.normal((1, 3 + 4, 8))
    inputs = (q, k, v, a, b, A_log, dt_bias)

    def verify_and_commit(n, use_kernel):
        cache = GDNSlotCache(max_tokens=5, rollback=rollback)
        cache[0], cache[1] = conv[:, :3], state
        with harness.use_harness(), kernels.use_mode("on" if use_kernel else "off"):
            cache.capturing = True
            cache.verify_recurrence(conv, inputs, None)
            cache.commit([n])
            mx.eval(cache[1])
        return cache

    for n in (1, 3, 4):
        got, want = verify_and_commit(n, True), verify_and_commit(n, False)
        assert mx.array_equal(got[0], want[0])
        assert rel_err(got[1], want[1]) < 1e-5
        assert got.rollback_nbytes == want.rollback_nbytes == 0  # nothing kept
