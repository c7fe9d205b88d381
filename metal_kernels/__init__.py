"""Custom Metal kernels for the verify and draft paths.

Every kernel here is paired with an MLX-ops reference of the same signature and
a dispatcher that falls back to the reference where Metal is unavailable.
"""
