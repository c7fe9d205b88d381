"""Building the MTP head from weights and attaching it to a loaded target.

Where the head lives: ``model.mtp_head`` is a plain Python attribute of the
target (set with ``object.__setattr__``), NOT a child module. So the head's
weights are not in ``model.parameters()``: ``mlx_lm.utils.save_model(model)``,
``nn.quantize(model)`` and mlx-lm's memory accounting see only the target,
exactly as mlx-lm loaded it. ``model.mtp_head`` is None when the directory has
no MTP weights; ``model.mtp_missing`` then says why, and :func:`mtp_head_of`
raises an error saying what to run.
"""

import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .discovery import SIDECAR_FILES, MTPWeightsInfo, find_mtp_weights
from .head import MTP_MODEL_TYPES, MTPHead, text_args
from .layouts import PREFIX, affine_quantization
from .weights import MTPWeightsError, load_config


class MTPUnavailableError(ValueError):
    """MTP drafting was asked for a model without MTP weights."""


class MTPDisabledWarning(UserWarning):
    """MTP weights were found but refused; the model loads without its head."""


def _howto(where: str) -> str:
    return (
        "mlx-lm's conversion drops the mtp.* tensors. Fetch them with "
        "`mlx_spec convert --mtp-from <raw Hugging Face repo or checkpoint dir> "
        f"--mlx-path {where}` "
        "(or load the raw checkpoint, or pass mtp_path=<sidecar>)"
    )


def check_head_params(head: MTPHead, weights: Dict[str, mx.array], source: str):
    """Check each parameter of ``head`` is in ``weights`` with its shape."""
    params = dict(tree_flatten(head.parameters()))
    for name, p in params.items():
        key = PREFIX + name
        if key not in weights:
            raise MTPWeightsError(f"{source}: MTP tensor {key} is missing")
        if tuple(weights[key].shape) != tuple(p.shape):
            raise MTPWeightsError(
                f"{source}: MTP tensor {key} has shape {tuple(weights[key].shape)}, "
                f"the model expects {tuple(p.shape)}"
            )
    unexpected = sorted(k for k in weights if k[len(PREFIX) :] not in params)
    if unexpected:
        raise MTPWeightsError(f"{source}: unexpected MTP tensor(s) {unexpected[:4]}")


def build_head(
    args,
    model_type: str,
    weights: Dict[str, mx.array],
    source: str,
    bits: int = 0,
    group_size: int = 64,
) -> MTPHead:
    """An unbound :class:`MTPHead` holding canonical, shifted ``weights``.

    Layers with ``.scales`` in ``weights`` become quantised layers first (as
    mlx-lm loads), each with the bits and group size its shapes say
    (:func:`~.layouts.affine_quantization`); ``bits`` and ``group_size`` are
    not needed for that and are ignored (kept for callers).
    """
    head = MTPHead(args, model_type)
    float_shapes = {k: tuple(v.shape) for k, v in tree_flatten(head.parameters())}
    quant = affine_quantization(weights, float_shapes, source)
    if quant:
        nn.quantize(
            head,
            class_predicate=lambda p, m: (
                {"bits": quant[p][0], "group_size": quant[p][1]}
                if p in quant
                else False
            ),
        )
    check_head_params(head, weights, source)
    head.load_weights([(k[len(PREFIX) :], v) for k, v in weights.items()])
    return head


def load_mtp_weights(
    model_dir: Path,
    args,
    model_type: str,
    mtp_path: Optional[Union[str, Path]] = None,
    progress: bool = False,
    model=None,
) -> Optional[Tuple[Dict[str, mx.array], int, int, str]]:
    """``(weights, bits, group_size, source)`` for a model, or None.

    :func:`~.discovery.find_mtp_weights` (which see) in the shape ``convert``
    uses: ``bits`` is the widest quantised layer's (0: none).
    """
    found = find_mtp_weights(model_dir, args, model_type, mtp_path, model=model)
    if found is None:
        return None
    weights, info = found
    return weights, info.bits, info.group_size, info.files[0]


def _declared_but_missing(model_dir: Path, declared: int) -> str:
    return (
        f"{model_dir}/config.json declares an MTP head ({declared} layer) but the "
        "model ships no MTP weights (none in its shards, no "
        f"{', '.join(SIDECAR_FILES)}); fetch them with `mlx_spec convert "
        f"--mtp-from <raw Hugging Face repo or checkpoint dir> --mlx-path {model_dir}`"
    )


def _find_head(model, model_dir: Path, model_type: str, mtp_path, lazy: bool):
    """``(head, info, reason)``: the head, or None and why."""
    declared = declared_mtp_layers(model_dir)
    if declared == 0 and mtp_path is None:
        return None, None, f"{model_dir}/config.json says mtp_num_hidden_layers=0"
    args = text_args(model)
    found = find_mtp_weights(model_dir, args, model_type, mtp_path, model=model)
    if found is None:
        if declared:
            return None, None, _declared_but_missing(model_dir, declared)
        reason = f"{model_dir} has no MTP weights. " + _howto(str(model_dir))
        return None, None, reason
    weights, info = found
    head = build_head(args, model_type, weights, info.files[0])
    head.attention_window = declared_attention_window(model_dir)
    head.bind(model)
    if not lazy:
        mx.eval(head.parameters())
    return head, info, None


def attach_mtp_head(
    model,
    model_dir: Union[str, Path],
    mtp_path: Optional[Union[str, Path]] = None,
    lazy: bool = False,
) -> Optional[MTPHead]:
    """Find the MTP weights of ``model`` (loaded from ``model_dir``), attach the head.

    Sets ``model.mtp_head`` (None when there is none; ``model.mtp_missing``
    then holds the reason) and ``model.mtp_info`` (an
    :class:`~.discovery.MTPWeightsInfo`: which files and layout). Weights
    found with the model that do not fit it (broken, another model's, an
    ambiguous norm shift) disable the head with an
    :class:`MTPDisabledWarning` naming the file: the model still loads, for
    n-gram or plain decoding. The same from an explicit ``mtp_path`` raise
    :class:`MTPWeightsError` (the caller asked for that head), and a
    ``mtp_path`` that does not exist raises FileNotFoundError.
    """
    model_type = getattr(model, "model_type", None)
    head, info, reason = None, None, None
    if model_type not in MTP_MODEL_TYPES:
        if mtp_path is not None:
            raise MTPWeightsError(
                f"model type {model_type!r} has no MTP head support "
                f"(supported: {', '.join(MTP_MODEL_TYPES)})"
            )
        reason = f"model type {model_type!r} has no MTP head"
    else:
        try:
            head, info, reason = _find_head(
                model, Path(model_dir), model_type, mtp_path, lazy
            )
        except MTPWeightsError as e:
            if mtp_path is not None:
                raise
            reason = f"MTP disabled: {e}"
            warnings.warn(reason, MTPDisabledWarning, stacklevel=3)
    # Plain attributes: the head must not become part of the target's tree.
    object.__setattr__(model, "mtp_head", head)
    object.__setattr__(model, "mtp_missing", reason)
    object.__setattr__(model, "mtp_info", info)
    return head


def mtp_report(model) -> Optional[str]:
    """One line on the model's MTP head: the file and layout it came from, or
    why there is none; None for model types without MTP heads."""
    state = getattr(model, "__dict__", {})
    info: Optional[MTPWeightsInfo] = state.get("mtp_info")
    if info is not None:
        return info.describe()
    if getattr(model, "model_type", None) not in MTP_MODEL_TYPES:
        return None
    reason = state.get("mtp_missing")
    return f"MTP head: none ({reason})" if reason else None


def _mtp_setting(model_dir: Path, key: str):
    """``key`` of the config (top level, or ``text_config`` for Qwen3.5)."""
    config = load_config(model_dir)
    text = config.get("text_config")
    return (text if isinstance(text, dict) else config).get(key, config.get(key))


def declared_mtp_layers(model_dir: Path) -> Optional[int]:
    """``mtp_num_hidden_layers`` of the config; None when the config does not
    say (then the checkpoint's ``mtp.*`` tensors decide). More than one layer
    is refused."""
    key = "mtp_num_hidden_layers"
    value = _mtp_setting(model_dir, key)
    if value is None:
        key = "num_nextn_predict_layers"
        value = _mtp_setting(model_dir, key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MTPWeightsError(
            f"{model_dir}/config.json: {key}={value!r} is not a non-negative integer"
        )
    if value > 1:
        raise MTPWeightsError(
            f"{model_dir}/config.json: {key}={value}; only one MTP layer is supported"
        )
    return value


def declared_attention_window(model_dir: Path) -> Optional[int]:
    """``mtp_attention_window`` of the config: the positions the head was
    trained to attend to (an mlx-spec key; released checkpoints do not set
    it, and their heads attend to every position)."""
    value = _mtp_setting(model_dir, "mtp_attention_window")
    if value is not None and (
        not isinstance(value, int) or isinstance(value, bool) or value < 1
    ):
        raise MTPWeightsError(
            f"{model_dir}/config.json: mtp_attention_window={value!r} is not a "
            "positive integer"
        )
    return value


def mtp_head_of(model) -> MTPHead:
    """The attached head, or :class:`MTPUnavailableError` saying what to run."""
    head = getattr(model, "__dict__", {}).get("mtp_head")
    if head is not None:
        return head
    reason = getattr(model, "__dict__", {}).get("mtp_missing")
    if reason is None:
        reason = (
            "this model has no MTP head attached; load it with mlx_spec.load(path). "
            + _howto("<mlx model dir>")
        )
    raise MTPUnavailableError(f"MTP drafting is not available: {reason}")
