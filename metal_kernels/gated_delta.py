"""Gated-delta recurrence for a verify pass, exposing the state after each token.

``gated_delta_steps`` is the MLX reference: it advances the recurrence one token
at a time through mlx-lm's own ``gated_delta_update``, which is exactly what
plain one-token decoding runs, so the states it returns are bit-identical to
the ones plain decoding would reach.
"""

from typing import List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_update


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
) -> Tuple[mx.array, Union[mx.array, List[mx.array]]]:
    """Run ``T`` recurrence steps.

    Shapes: q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; a, b: [B, T, Hv];
    state: [B, Hv, Dv, Dk] float32 (None: zeros); mask: [B, T] or None.
    Returns y: [B, T, Hv, Dv] and, with ``keep_states``, the list of the T
    states after each token; otherwise the final state. A state is
    [B, Hv, Dv, Dk] float32.
    """
    T = q.shape[1]
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
