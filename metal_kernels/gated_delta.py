"""Gated-delta recurrence for a verify pass, exposing the state after each token.

``gated_delta_steps`` is the dispatcher (see ``mlx_spec.kernels.switch`` for the
switch). Its MLX reference, ``gated_delta_steps_reference``, advances the
recurrence one token at a time exactly as plain one-token decoding does, so
the states it returns are bit-identical to the ones plain decoding would
reach: where mlx-lm's ``gated_delta_update`` runs its ops path (the CPU, CUDA),
the gates, ``beta`` and the head repeat are computed once for all tokens
(elementwise, so each token's values are the same) and each token runs
mlx-lm's own one-step function; elsewhere each token goes through
``gated_delta_update`` whole.

The Metal kernel runs all ``T`` tokens in one launch with the state in
registers and writes the state after every token (what the "store" rollback
keeps) into one array ``[T, B, Hv, Dv, Dk]``.
Each lane owns the same state elements and sums in the same order as
mlx-lm's kernels (the one-value-row-per-SIMD-group ``simd_sum`` kernel, or
for Dk = 128 the packed eight-rows-per-SIMD-group kernel), so its states and
outputs are bit-identical to plain decoding through mlx-lm's kernels (checked
in the MSL harness; on Metal as far as the compiler treats both alike).

Grid: ``(32, Dv / rows_per_simdgroup, B * Hv)``, threadgroup ``(32, 4, 1)``
(one row per SIMD group, ``L = 32`` lanes per row) or ``(32, 2, 1)`` (packed:
``L = 4`` lanes per row, 8 rows per SIMD group, each lane holding Dk / 4
state elements).
"""

from typing import List, Optional, Tuple, Union

import mlx.core as mx

from ..mlx_lm_compat import (
    compute_g,
    gated_delta_step_ops,
    gated_delta_update,
    gated_delta_update_runs_ops,
)
from .switch import cached_kernel, dispatch, kernel_stream

States = Union[mx.array, List[mx.array]]  # the T per-token states, or the final one


def gated_delta_steps_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array],
    mask: Optional[mx.array] = None,
    keep_states: bool = True,
    lengths: Optional[List[int]] = None,
) -> Tuple[mx.array, States]:
    """Run ``T`` recurrence steps token by token through mlx-lm.

    Shapes: q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; a, b: [B, T, Hv];
    state: [B, Hv, Dv, Dk] float32 (None: zeros); mask: [B, T] or None.
    Returns y: [B, T, Hv, Dv] and, with ``keep_states``, the list of the T
    states after each token; otherwise the final state. A state is
    [B, Hv, Dv, Dk] float32.

    ``lengths`` (host ints, with ``keep_states``, rows padded at the end):
    where mlx-lm's ops path runs, step ``t`` runs only over the rows with
    more than ``t`` tokens (see :func:`_ragged_steps`; ``mask`` is then not
    needed), and a state entry may be a ``(rows, state)`` pair.
    """
    T = q.shape[1]
    if gated_delta_update_runs_ops(k):
        ragged = lengths if keep_states else None
        return _steps_through_ops(
            q, k, v, a, b, A_log, dt_bias, state, mask, keep_states, ragged
        )
    ys, states = [], []
    for t in range(T):
        y, state = gated_delta_update(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            a[:, t : t + 1],
            b[:, t : t + 1],
            A_log,
            dt_bias,
            state,
            None if mask is None else mask[:, t : t + 1],
        )
        ys.append(y)
        states.append(state)
    y = mx.concatenate(ys, axis=1)
    return y, (states if keep_states else state)


def _steps_through_ops(
    q, k, v, a, b, A_log, dt_bias, state, mask, keep_states, lengths=None
):
    """The reference on mlx-lm's ops path, with the per-token setup hoisted."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    beta, g = mx.sigmoid(b), compute_g(A_log, a, dt_bias)  # [B, T, Hv]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv // Hk > 1:
        q, k = (mx.repeat(x, Hv // Hk, -2) for x in (q, k))
    if lengths is not None:
        return _ragged_steps((q, k, v, g, beta), state, lengths)
    ys, states = [], []
    for t in range(T):
        y, state = gated_delta_step_ops(
            q[:, t],
            k[:, t],
            v[:, t],
            g[:, t],
            beta[:, t],
            state,
            None if mask is None else mask[:, t],
        )
        ys.append(y)
        states.append(state)
    y = mx.stack(ys, axis=1)
    return y, (states if keep_states else state)


def _ragged_steps(inputs, state, lengths: List[int]):
    """Step ``t`` over only the rows with more than ``t`` tokens.

    inputs: (q, k [B, T, Hv, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv]);
    state: [B, Hv, Dv, Dk]. On the CPU a step's cost grows with its rows, so
    a batch pass whose rows drafted different lengths costs the tokens its
    rows hold, not ``B x T``. Each row runs mlx-lm's unmasked one-token step,
    what its plain decoding runs, so its states are the same bit for bit.
    The steps run in segments over one set of rows (until the shortest of
    them ends), whose inputs are gathered and outputs placed once.
    Returns y [B, T, Hv, Dv] (zeros past a row's length) and per token the
    state after it: [B, Hv, Dv, Dk] where every row ran, else a pair
    (rows: the ascending indices that ran, state [len(rows), Hv, Dv, Dk])."""
    B, T = inputs[0].shape[:2]
    segments, states, rows, t = [], [], list(range(B)), 0
    while t < T:
        now = [r for r in rows if lengths[r] > t]
        state = _take_rows(state, [rows.index(r) for r in now])
        rows, end = now, min(lengths[r] for r in now)
        xs = [_take_rows(x, rows) for x in inputs]
        ys = []
        for u in range(t, end):
            y, state = gated_delta_step_ops(*(x[:, u] for x in xs), state)
            ys.append(y)
            states.append(state if len(rows) == B else (rows, state))
        segments.append((rows, t, mx.stack(ys, axis=1)))
        t = end
    if len(segments) == 1 and len(rows) == B:
        return segments[0][2], states
    y = mx.zeros((B, T) + segments[0][2].shape[2:], segments[0][2].dtype)
    for rows, t, ys in segments:
        y[mx.array(rows, mx.int32), t : t + ys.shape[1]] = ys
    return y, states


def _take_rows(x: mx.array, positions: List[int]) -> mx.array:
    """Rows ``positions`` of ``x``: ``x`` itself or a view when they lead it."""
    if positions == list(range(len(positions))):
        return x if len(positions) == x.shape[0] else x[: len(positions)]
    return x[mx.array(positions, mx.int32)]


def row_state(entry, row: int) -> mx.array:
    """Row ``row`` of a per-token state entry (an array, or a ``(rows,
    state)`` pair from :func:`_ragged_steps`), shaped as one row."""
    if isinstance(entry, tuple):
        rows, entry = entry
        row = rows.index(row)
    return entry[row : row + 1]


_SOURCE = """
    // q, k: [B, T, Hk, Dk]; v, y: [B, T, Hv, Dv]; g, beta: [B, T, Hv]
    // state_in: [B, Hv, Dv, Dk]; states: [S, B, Hv, Dv, Dk] (Store) or
    // [B, Hv, Dv, Dk] (final state only)
    constexpr int G = 32 / L;    // 32-lane groups folded into one lane
    constexpr int E = Dk / 32;   // state elements per folded lane
    constexpr int PER = Dk / L;  // state elements per lane (G * E)
    constexpr int RPS = 32 / L;  // value rows per SIMD group

    auto n = thread_position_in_grid.z;  // b * Hv + hv
    auto BHv = threads_per_grid.z;
    auto b_idx = n / Hv;
    auto hv_idx = n % Hv;
    auto hk_idx = hv_idx / (Hv / Hk);
    auto lane_in_row = thread_index_in_simdgroup % L;
    auto dv_idx = thread_position_in_grid.y * RPS + thread_index_in_simdgroup / L;

    auto q_ = q + (b_idx * T * Hk + hk_idx) * Dk + lane_in_row * PER;
    auto k_ = k + (b_idx * T * Hk + hk_idx) * Dk + lane_in_row * PER;
    auto v_ = v + (b_idx * T * Hv + hv_idx) * Dv;
    auto y_ = y + (b_idx * T * Hv + hv_idx) * Dv;
    auto g_ = g + b_idx * T * Hv;
    auto beta_ = beta + b_idx * T * Hv;
    auto row = (n * Dv + dv_idx) * Dk + lane_in_row * PER;

    float st[PER];
    for (int i = 0; i < PER; ++i) {
      st[i] = static_cast<float>(state_in[row + i]);
    }

    for (int t = 0; t < T; ++t) {
      if (MASK_EXPR) {
        float gt = static_cast<float>(g_[hv_idx]);
        float part[G];
        for (int p = 0; p < G; ++p) {
          float acc = 0.0f;
          for (int i = 0; i < E; ++i) {
            int e = p * E + i;
            st[e] = st[e] * gt;
            acc += st[e] * static_cast<float>(k_[e]);
          }
          part[p] = acc;
        }
        // butterfly levels 1 .. G/2 stay in the lane (pairwise tree)
        for (int w = 1; w < G; w *= 2) {
          for (int p = 0; p < G; p += 2 * w) {
            part[p] += part[p + w];
          }
        }
        float kv_mem = part[0];
        if (L == 32) {
          kv_mem = simd_sum(kv_mem);
        } else {
          for (ushort o = 1; o < L; o <<= 1) {
            kv_mem += simd_shuffle_xor(kv_mem, o);
          }
        }

        float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) *
            static_cast<float>(beta_[hv_idx]);

        for (int p = 0; p < G; ++p) {
          float acc = 0.0f;
          for (int i = 0; i < E; ++i) {
            int e = p * E + i;
            st[e] = st[e] + static_cast<float>(k_[e]) * delta;
            acc += st[e] * static_cast<float>(q_[e]);
          }
          part[p] = acc;
        }
        for (int w = 1; w < G; w *= 2) {
          for (int p = 0; p < G; p += 2 * w) {
            part[p] += part[p + w];
          }
        }
        float out = part[0];
        if (L == 32) {
          out = simd_sum(out);
        } else {
          for (ushort o = 1; o < L; o <<= 1) {
            out += simd_shuffle_xor(out, o);
          }
        }
        if (lane_in_row == 0) {
          y_[dv_idx] = static_cast<InT>(out);
        }
      } else if (lane_in_row == 0) {
        y_[dv_idx] = static_cast<InT>(0);
      }
      if (Store) {
        auto o_ = states + t * BHv * Dv * Dk + row;
        for (int i = 0; i < PER; ++i) {
          o_[i] = st[i];
        }
      }
      q_ += Hk * Dk;
      k_ += Hk * Dk;
      v_ += Hv * Dv;
      y_ += Hv * Dv;
      g_ += Hv;
      beta_ += Hv;
    }
    if (!Store) {
      for (int i = 0; i < PER; ++i) {
        states[row + i] = st[i];
      }
    }
"""


def _make_kernel(has_mask: bool):
    inputs = ["q", "k", "v", "g", "beta", "state_in", "T"]
    if has_mask:
        inputs.append("mask")
    source = _SOURCE.replace(
        "MASK_EXPR", "static_cast<bool>(mask[b_idx * T + t])" if has_mask else "true"
    )
    return mx.fast.metal_kernel(
        name="mlx_spec_gated_delta_verify" + ("_mask" if has_mask else ""),
        input_names=inputs,
        output_names=["y", "states"],
        source=source,
    )


def kernel_supported(q, v, state, mask) -> bool:
    Dk = q.shape[-1]
    Hk, Hv = q.shape[2], v.shape[2]
    return (
        Dk >= 32
        and Dk % 32 == 0
        and Hv % Hk == 0
        and q.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and (state is None or state.dtype == mx.float32)
        and (mask is None or mask.shape == q.shape[:2])
    )


def lanes_per_row(Dk: int, Dv: int, masked: bool) -> int:
    """4 (mlx-lm's packed layout) where mlx-lm uses it for T = 1, else 32."""
    return 4 if (Dk == 128 and Dv % 8 == 0 and not masked) else 32


def gated_delta_steps_kernel(q, k, v, g, beta, state, mask=None, keep_states=True):
    """The Metal kernel on precomputed ``g`` (float32) and ``beta``.

    Shapes as ``gated_delta_steps``; g, beta: [B, T, Hv]. Returns y and either
    the states [T, B, Hv, Dv, Dk] float32 in one array (state t = after token
    t) or, without ``keep_states``, the final state.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    L = lanes_per_row(Dk, Dv, mask is not None)
    kernel = cached_kernel(
        ("gdn", mask is not None), lambda: _make_kernel(mask is not None)
    )
    inputs = [q, k, v, g, beta, state, T]
    if mask is not None:
        inputs.append(mask)
    st_shape = (T, B, Hv, Dv, Dk) if keep_states else (B, Hv, Dv, Dk)
    rps = 32 // L
    y, states = kernel(
        inputs=inputs,
        template=[
            ("InT", q.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            ("L", L),
            ("Store", bool(keep_states)),
        ],
        grid=(32, Dv // rps, B * Hv),
        threadgroup=(32, 4 if L == 32 else 2, 1),
        output_shapes=[(B, T, Hv, Dv), st_shape],
        output_dtypes=[q.dtype, mx.float32],
        stream=kernel_stream(),
    )
    return y, states


def gated_delta_steps(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array],
    mask: Optional[mx.array] = None,
    keep_states: bool = True,
    lengths: Optional[List[int]] = None,
) -> Tuple[mx.array, States]:
    """Run ``T`` recurrence steps; the kernel where the switch allows it.

    Shapes: q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; a, b: [B, T, Hv];
    state: [B, Hv, Dv, Dk] float32 (None: zeros); mask: [B, T] or None.
    Returns y: [B, T, Hv, Dv] and, with ``keep_states``, the list of the T
    states after each token (views of the kernel's one array); without
    ``keep_states`` the final state. A state is [B, Hv, Dv, Dk] float32.
    ``lengths``: see ``gated_delta_steps_reference`` (the kernel masks).
    """

    def reference():
        return gated_delta_steps_reference(
            q, k, v, a, b, A_log, dt_bias, state, mask, keep_states, lengths
        )

    if not kernel_supported(q, v, state, mask):
        return reference()

    def kernel():
        beta = mx.sigmoid(b)
        g = compute_g(A_log, a, dt_bias)
        y, states = gated_delta_steps_kernel(q, k, v, g, beta, state, mask, keep_states)
        return y, (list(states) if keep_states else states)

    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    dims = (Hk, Hv, Dk, Dv, q.dtype, mask is not None, bool(keep_states))
    return dispatch(
        "gdn", kernel, reference, probe_key=dims + (B, T), family=dims + (B, T)
    )
