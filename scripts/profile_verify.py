"""Where a T-token verify pass spends its time, part by part.

Decodes through a :class:`~mlx_spec.core.sequence.SpeculativeDecoder` (so the
GDN layers run their verify forward with per-token states, as in a real
pass) and wraps each part of the model in a timer that evaluates the part's
output before reading the clock. The forced evaluations add a little to every
part, so the parts sum to slightly more than an unwrapped pass (printed too).
The unwrapped pass is timed twice, interleaved (medians): with each GDN
layer's output starting to evaluate once built (what mlx-spec does) and with
nothing evaluated before the end, whose graph-building time is printed too.
Then how long ``mx.async_eval`` of an unwrapped pass holds the host before
returning, against the wait that is left after it (how much of a pass can
overlap the host's own work).
With ``--head``, also one draft step of the model's MTP head over a cache of
``--context`` rows, stored in float16 and in the head's compute dtype. With
``--recurrence``, only the Gated-DeltaNet recurrence as a verify pass runs it
(the reference, mlx-lm's ops, without Metal), per token for 1, 2, 4 and 8
rows of the model's GDN dimensions and for one head of 8 x 8 (what a step
costs whatever its state). With ``--conv``,
only a GDN layer's causal conv, its ``Conv1d`` against the shifted products
mlx-spec computes it with. With
``--head-prefill``, only the head's prefill over a ``--context``-token prompt
(random hidden states), with its attention window and attending to all rows.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python scripts/profile_verify.py [--model DIR] [--context 256] [--tokens 1 4 9]
        [--head | --head-prefill | --recurrence | --conv]
"""

import argparse
import statistics
import time
from collections import defaultdict

import mlx.core as mx
import mlx.nn as nn

import mlx_spec
from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.core.state import GDNSlotCache
from mlx_spec.demo import default_model_path
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.models.depthwise_conv import depthwise_conv
from mlx_spec.kernels.gated_delta import gated_delta_steps_reference
from mlx_spec.models.mtp import MTPKVCache


class Timed(nn.Module):
    """Runs ``inner`` and adds the seconds to ``totals[name]`` (output evaluated)."""

    def __init__(self, inner, name, totals):
        super().__init__()
        self.inner, self.name, self.totals = inner, name, totals

    def __call__(self, *args, **kwargs):
        tic = time.perf_counter()
        out = self.inner(*args, **kwargs)
        mx.eval(out)
        self.totals[self.name] += time.perf_counter() - tic
        return out


def instrument(model, totals):
    """Wrap the mixers, MLPs, embedding and lm_head of ``model`` in timers."""
    for layer in model.layers:
        if getattr(layer, "linear_attn", None) is not None:
            layer.linear_attn = Timed(layer.linear_attn, "gdn mixer", totals)
        else:
            layer.self_attn = Timed(layer.self_attn, "attention", totals)
        layer.mlp = Timed(layer.mlp, "mlp (moe)", totals)
    model.model.embed_tokens = Timed(model.model.embed_tokens, "embed", totals)
    model.lm_head = Timed(model.lm_head, "lm_head", totals)


def pass_seconds(decoder, T):
    """Seconds of a T-token target pass (begin, forward, commit one token)
    and, of them: the host's time building the forward's graph, the time
    ``mx.async_eval`` of its outputs held the host, and the wait left after
    it (on a GPU the call returns at once; on the CPU, MLX's eval loop waits
    whenever more than a few tasks are in flight, so it holds the host until
    nearly all of the pass has run)."""
    tokens = mx.array(decoder.history[-1:] * T)
    mx.eval(tokens)
    tic = time.perf_counter()
    decoder.cache.begin(T)
    logits, hidden = decoder.target.forward(tokens)
    built = time.perf_counter()
    mx.async_eval(logits, hidden)
    returned = time.perf_counter()
    mx.eval(logits, hidden)
    ready = time.perf_counter()
    decoder.cache.commit(1)
    mx.eval([c.state for c in decoder.cache.caches])
    return time.perf_counter() - tic, built - tic, returned - built, ready - returned


def early_and_not(decoder, T, repeats):
    """Median pass times with the GDN layers started as soon as built (the
    default) and evaluated only at the end, interleaved; and the second's
    graph-building time (the first's includes layers computed meanwhile),
    ``async_eval`` time and wait after it."""
    times = {True: [], False: []}
    for _ in range(repeats):
        for early in times:
            for c in decoder.cache.caches:
                if isinstance(c, GDNSlotCache):
                    c.evaluate_early = early
            times[early].append(pass_seconds(decoder, T))
    early, late = ([statistics.median(x) for x in zip(*times[e])] for e in times)
    return early[0], *late


def head_step_seconds(head, context, stored, repeats):
    """Best time of one draft step of ``head`` over ``context`` cached rows
    kept in ``stored`` (None: the compute dtype)."""
    cache = [MTPKVCache(stored)]
    ids = mx.zeros((1, context), mx.uint32)
    mx.eval(
        head.head_hidden(ids, mx.random.normal((1, context, head.hidden_size)), cache)
    )
    token, hidden = mx.zeros((1, 1), mx.uint32), mx.random.normal(
        (1, 1, head.hidden_size)
    )
    best = float("inf")
    for _ in range(repeats + 2):  # two warm-up steps
        tic = time.perf_counter()
        mx.eval(head(token, hidden, cache)[0])
        best = min(best, time.perf_counter() - tic)
        cache[0].trim(1)
    return best


def head_prefill_seconds(head, context, window, repeats=2):
    """Best time of the head's prefill over a ``context``-token prompt, each
    row attending to its last ``window`` positions (None: all)."""
    kept, head.attention_window = head.attention_window, window
    try:
        prompt = [1 + i % 1000 for i in range(context)]
        dtype = head.pre_fc_norm_hidden.weight.dtype
        hidden = mx.random.normal((context - 1, head.hidden_size)).astype(dtype)
        mx.eval(hidden)
        best = float("inf")
        for _ in range(repeats):
            drafter = MTPDrafter(head)
            drafter.hindsight()  # judging on, as ``auto`` turns it
            tic = time.perf_counter()
            drafter.reset(prompt, hidden)
            mx.eval(drafter.rows.next_logits())
            best = min(best, time.perf_counter() - tic)
        return best
    finally:
        head.attention_window = kept


def recurrence_step_seconds(rows, heads, dims, steps=64, repeats=7):
    """Median seconds per token of ``steps`` recurrence steps, keeping every
    state as a verify pass does. heads: (key, value); dims: (key, value)."""
    (hk, hv), (dk, dv) = heads, dims
    q, k = (0.1 * mx.random.normal((rows, steps, hk, dk)) for _ in range(2))
    v = mx.random.normal((rows, steps, hv, dv))
    a, b = (mx.random.normal((rows, steps, hv)) for _ in range(2))
    gates = (mx.zeros((hv,)), mx.zeros((hv,)))  # A_log, dt_bias
    state = mx.zeros((rows, hv, dv, dk))
    mx.eval(q, k, v, a, b, state)
    times = []
    for _ in range(repeats + 1):  # one warm-up
        tic = time.perf_counter()
        mx.eval(gated_delta_steps_reference(q, k, v, a, b, *gates, state))
        times.append(time.perf_counter() - tic)
    return statistics.median(times[1:]) / steps


def first_gdn(model, flag):
    mixers = (getattr(layer, "linear_attn", None) for layer in model.layers)
    gdn = next((m for m in mixers if m is not None), None)
    if gdn is None:
        raise SystemExit(f"{flag}: the model has no Gated-DeltaNet layer")
    return gdn


def print_conv(model, repeats):
    """A GDN layer's causal conv: its ``Conv1d`` against the shifted products
    mlx-spec runs (``models/depthwise_conv.py``), medians of interleaved
    calls, each evaluated."""
    gdn = first_gdn(model, "--conv")
    K, C = gdn.conv_kernel_size, gdn.conv_dim
    for rows, T in ((1, 1), (4, 1), (1, 9), (4, 9), (1, 256)):
        x = mx.random.normal((rows, K - 1 + T, C)).astype(gdn.conv1d.weight.dtype)
        times = {"Conv1d": [], "products": []}
        for _ in range(repeats + 1):  # one warm-up
            for name, conv in (
                ("Conv1d", lambda: gdn.conv1d(x)),
                ("products", lambda: depthwise_conv(gdn.conv1d, x)),
            ):
                tic = time.perf_counter()
                mx.eval(conv())
                times[name].append(time.perf_counter() - tic)
        us = {n: 1e6 * statistics.median(t[1:]) for n, t in times.items()}
        print(
            f"GDN conv, {rows} x {T} tokens of {C} channels: Conv1d "
            f"{us['Conv1d']:.0f} us, products {us['products']:.0f} us"
        )


def print_recurrence(model):
    """Per-token cost of the recurrence for the model's GDN dimensions."""
    gdn = first_gdn(model, "--recurrence")
    heads = (gdn.num_k_heads, gdn.num_v_heads)
    dims = (gdn.head_k_dim, gdn.head_v_dim)
    for rows in (1, 2, 4, 8):
        us = 1e6 * recurrence_step_seconds(rows, heads, dims)
        rows_of = f"{rows} row{'s' * (rows > 1)}"
        print(f"GDN recurrence, {rows_of} of {heads[1]} x {dims}: {us:.0f} us/token")
    us = 1e6 * recurrence_step_seconds(1, (1, 1), (8, 8))
    print(f"GDN recurrence, 1 row of one 8 x 8 head: {us:.0f} us/token")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 9])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--head", action="store_true", help="also time an MTP draft step")
    p.add_argument(
        "--head-prefill", action="store_true", help="only time the MTP head's prefill"
    )
    p.add_argument(
        "--recurrence", action="store_true", help="only time the GDN recurrence"
    )
    p.add_argument("--conv", action="store_true", help="only time the GDN conv")
    a = p.parse_args()
    least = 2 if a.head_prefill else 1  # a prompt of one token has no head row
    if a.context < least:
        p.error(f"--context must be at least {least}, got {a.context}")
    model, _ = mlx_spec.load(a.model)
    if a.recurrence:
        print_recurrence(model)
        return
    if a.conv:
        print_conv(model, a.repeats)
        return
    for flag, wanted in (("--head", a.head), ("--head-prefill", a.head_prefill)):
        if wanted and getattr(model, "mtp_head", None) is None:
            p.error(f"{flag}: the model at {a.model} has no MTP head")
    if a.head_prefill:
        head = model.mtp_head
        for window in dict.fromkeys((head.attention_window, None)):
            ms = 1e3 * head_prefill_seconds(head, a.context, window)
            reach = "every row" if window is None else f"a window of {window}"
            print(f"MTP head prefill, {a.context} tokens, {reach}: {ms:.0f} ms")
        return
    if a.head:
        for stored in (mx.float16, None):
            ms = 1e3 * head_step_seconds(model.mtp_head, a.context, stored, a.repeats)
            name = "float16" if stored else "compute dtype"
            print(
                f"MTP head draft step over {a.context} rows, cache {name}: {ms:.2f} ms"
            )
    decoder = SpeculativeDecoder(model, None, max_draft=max(a.tokens))
    decoder.feed([1 + i % 1000 for i in range(a.context)])  # ids in any vocabulary
    plain = {T: early_and_not(decoder, T, a.repeats) for T in a.tokens}
    for T in a.tokens:
        returned, waited = (1e3 * t for t in plain[T][3:])
        print(
            f"T={T}: mx.async_eval of the pass returned after {returned:.2f} ms, "
            f"then the host waited {waited:.2f} ms more"
        )
    totals = defaultdict(float)
    instrument(model, totals)
    print(f"context {a.context} tokens, ms per pass (median of {a.repeats}):")
    for T in a.tokens:
        for _ in range(2):  # warm the wrapped shapes
            pass_seconds(decoder, T)
        totals.clear()
        for _ in range(a.repeats):
            pass_seconds(decoder, T)
        parts = {k: 1e3 * v / a.repeats for k, v in totals.items()}
        line = "  ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items()))
        early, late, building = (1e3 * t for t in plain[T][:3])
        print(
            f"T={T}: pass {early:.2f} ({late:.2f} with no layer started early, "
            f"its graph built in {building:.2f}) | parts (timed apart) "
            f"{sum(parts.values()):.2f}: {line}"
        )


if __name__ == "__main__":
    main()
