"""The MTP head of Qwen3-Next / Qwen3.5 checkpoints: module, weights, loading.

- :class:`MTPHead` (``head.py``): the head as an MLX module sharing the
  target's embedding and output head; :class:`MTPKVCache`, its float16 cache.
- ``weights.py``: reading ``mtp.*`` from raw checkpoints, sanitising, the
  ``mtp.safetensors`` sidecar written by ``mlx_spec convert``.
- ``attach.py``: :func:`attach_mtp_head` (called by ``mlx_spec.load``) puts
  the head on ``model.mtp_head``; :func:`mtp_head_of` fetches it or explains
  what to run.
"""

from .attach import (
    MTPUnavailableError,
    attach_mtp_head,
    build_head,
    load_mtp_weights,
    mtp_head_of,
)
from .head import MTP_MODEL_TYPES, MTPHead, MTPKVCache
from .weights import MTP_NORMS, SIDECAR_NAME, MTPWeightsError

__all__ = [
    "MTP_MODEL_TYPES",
    "MTP_NORMS",
    "SIDECAR_NAME",
    "MTPHead",
    "MTPKVCache",
    "MTPUnavailableError",
    "MTPWeightsError",
    "attach_mtp_head",
    "build_head",
    "load_mtp_weights",
    "mtp_head_of",
]
