"""Kernel texts and a launch helper shared by the harness's own tests."""

import mlx.core as mx

EXP_SOURCE = """
    uint elem = thread_position_in_grid.x;
    T tmp = inp[elem];
    out[elem] = metal::exp(tmp);
"""

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


def run1(kernel, inputs, grid, threadgroup, shape, dtype=mx.float32, **kw):
    return kernel(
        inputs=inputs,
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[shape],
        output_dtypes=[dtype],
        **kw,
    )[0]
