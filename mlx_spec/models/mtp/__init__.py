"""The MTP head of Qwen3-Next / Qwen3.5 checkpoints: module, weights, loading.

- :class:`MTPHead` (``head.py``): the head as an MLX module sharing the
  target's embedding and output head; :class:`MTPKVCache`, its float16 cache.
- ``discovery.py``: :func:`find_mtp_weights`, the head's weights wherever
  they are (model shards, every sidecar name) with a report of what it read;
  ``layouts.py`` maps every published layout to one, ``norm_shift.py``
  decides the norms' ``+1`` once per head.
- ``weights.py``: the model a head belongs to; the ``mtp.safetensors``
  sidecar written by ``mlx_spec convert``.
- ``attach.py``: :func:`attach_mtp_head` (called by ``mlx_spec.load``) puts
  the head on ``model.mtp_head``; :func:`mtp_head_of` fetches it or explains
  what to run; :func:`mtp_report`, one line on where it came from.
"""

from .attach import (
    MTPDisabledWarning,
    MTPUnavailableError,
    attach_mtp_head,
    build_head,
    load_mtp_weights,
    mtp_head_of,
    mtp_report,
)
from .discovery import MTPWeightsInfo, find_mtp_weights, hub_file_patterns
from .head import MTP_MODEL_TYPES, MTPHead, MTPKVCache
from .weights import MTP_NORMS, SIDECAR_NAME, MTPWeightsError

__all__ = [
    "MTP_MODEL_TYPES",
    "MTP_NORMS",
    "SIDECAR_NAME",
    "MTPDisabledWarning",
    "MTPHead",
    "MTPKVCache",
    "MTPUnavailableError",
    "MTPWeightsError",
    "MTPWeightsInfo",
    "attach_mtp_head",
    "build_head",
    "find_mtp_weights",
    "hub_file_patterns",
    "load_mtp_weights",
    "mtp_head_of",
    "mtp_report",
]
