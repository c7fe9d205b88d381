"""Custom Metal kernels for the verify and draft paths.

Installed as ``mlx_spec.kernels`` (the folder is ``metal_kernels/``). Every
kernel is paired with an MLX-ops reference of the same signature, a support
check (``kernel_supported``; for the experts ``kernel_plan``, None where the
kernel does not apply) and a dispatcher that falls back to the reference
where Metal is unavailable or the switch says so (``switch.py``,
``MLX_SPEC_KERNELS``):

* ``gated_delta.gated_delta_steps``: the GDN recurrence of a verify pass with
  the state after every token;
* ``attention.verify_attention``: causal GQA attention of T <= 16 query
  tokens over a KV cache;
* ``attention.mtp_attention``: the MTP head's attention over its float16 cache;
* ``moe.moe_experts``: the routed experts of few tokens (``SwitchGLU``'s
  per-(token, expert) outputs), each selected expert read once.

``cases.py`` holds the shapes of ``mlx_spec bench-kernels``; the wiring into
mlx-lm's layers is ``mlx_spec.models.fast_layers``. See docs/kernels.md for
the designs and what they save.
"""
