"""Measure the two GDN rollback strategies on one real-size GDN layer.

For a verify pass of T tokens followed by ``commit(n)``, times
- "store":  keep the recurrent state after every token, rollback picks a slot;
- "replay": keep the recurrence inputs, rollback re-runs the first n tokens.

Usage: python scripts/bench_rollback.py [--dims qwen3_next|qwen3_5_35b|tiny]
On Linux preload OpenBLAS for GPU-like matmul scaling (say so in results):
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
"""

import argparse
import json
import os
import platform
import statistics
import time

import mlx.core as mx
from mlx_lm.models import qwen3_next

from mlx_spec.core.state import GDNSlotCache
from mlx_spec.models.gdn import make_verifiable

DIMS = {
    # Qwen3-Next-80B-A3B GDN layer (docs/rollback.md)
    "qwen3_next": dict(hidden_size=2048, k_heads=16, v_heads=32, head_dim=128),
    # Qwen3.5-35B-A3B uses the same GDN geometry
    "qwen3_5_35b": dict(hidden_size=2048, k_heads=16, v_heads=32, head_dim=128),
    "tiny": dict(hidden_size=64, k_heads=2, v_heads=4, head_dim=32),
}


def make_layer(d, dtype):
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=d["hidden_size"],
        num_hidden_layers=1,
        intermediate_size=1,
        num_attention_heads=1,
        linear_num_value_heads=d["v_heads"],
        linear_num_key_heads=d["k_heads"],
        linear_key_head_dim=d["head_dim"],
        linear_value_head_dim=d["head_dim"],
        linear_conv_kernel_dim=4,
        num_experts=0,
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        mlp_only_layers=[],
        moe_intermediate_size=0,
        rms_norm_eps=1e-6,
        vocab_size=1,
        num_key_value_heads=1,
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        head_dim=d["head_dim"],
    )
    layer = qwen3_next.Qwen3NextGatedDeltaNet(args)
    layer.set_dtype(dtype)
    make_verifiable(layer)
    mx.eval(layer.parameters())
    return layer


def time_step(layer, cache, x, n):
    """Seconds of one verify pass over x [1, T, H] plus commit(n);
    ``n=None`` times mlx-lm's own forward (no capture, no rollback)."""
    mx.eval(cache.cache)
    tic = time.perf_counter()
    cache.capturing = n is not None
    mx.eval(layer(x, cache=cache), cache.cache)
    if n is not None:
        cache.commit([n])
        mx.eval(cache.cache)
    return time.perf_counter() - tic


STRATEGIES = ("plain", "store", "replay")


def measure(layer, x, n, repeats, hidden_size):
    """Median ms per strategy, the strategies interleaved (A B C A B C ...)."""
    caches = {}
    for s in STRATEGIES:
        caches[s] = GDNSlotCache(9, "store" if s == "plain" else s)
        layer(mx.random.normal((1, 8, hidden_size)).astype(x.dtype), cache=caches[s])
    times = {s: [] for s in STRATEGIES}
    for i in range(repeats + 2):
        for s in STRATEGIES:
            t = time_step(layer, caches[s], x, None if s == "plain" else n)
            if i >= 2:  # warm-up
                times[s].append(t)
    return {s: 1e3 * statistics.median(v) for s, v in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", choices=DIMS, default="qwen3_next")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    d = DIMS[args.dims]
    layer = make_layer(d, mx.bfloat16 if args.dims != "tiny" else mx.float32)
    rows = []
    print(f"GDN rollback, {args.dims} dims, device {mx.default_device()}")
    print(f"{'T':>3} {'n':>3} {'plain ms':>9} {'store ms':>9} {'replay ms':>10}")
    for T in (2, 4, 9):
        x = mx.random.normal((1, T, d["hidden_size"])).astype(layer.A_log.dtype)
        for n in sorted({1, (T + 1) // 2, T}):
            res = {
                "T": T,
                "n": n,
                **measure(layer, x, n, args.repeats, d["hidden_size"]),
            }
            rows.append(res)
            print(
                f"{T:>3} {n:>3} {res['plain']:>9.2f} {res['store']:>9.2f} "
                f"{res['replay']:>10.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": platform.platform(),
                    "dims": args.dims,
                    "rows": rows,
                    "ld_preload": os.environ.get("LD_PRELOAD", ""),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
