"""Custom Metal kernels for the verify and draft paths.

Every kernel here is paired with an MLX-ops reference of the same signature and
a dispatcher that falls back to the reference where Metal is unavailable (the
switch is ``MLX_SPEC_KERNELS``, see ``mlx_spec.kernels``):

* ``gated_delta.gated_delta_steps``: the GDN recurrence of a verify pass with
  the state after every token;
* ``attention.verify_attention``: causal GQA attention of T <= 16 query
  tokens over a KV cache;
* ``attention.mtp_attention``: the MTP head's attention over its float16 cache;
* ``moe.moe_experts``: the routed experts of few tokens (``SwitchGLU``'s
  per-(token, expert) outputs), each selected expert read once.

See docs/kernels.md for the designs and what they save.
"""


def bench_cases(quick: bool = False, only=None):
    """The cases of ``mlx_spec bench-kernels`` (see ``metal_kernels.bench``)."""
    from .bench import bench_cases as cases

    return cases(quick=quick, only=only)
