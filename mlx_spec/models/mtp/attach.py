"""Building the MTP head from weights and attaching it to a loaded target.

Where the head lives: ``model.mtp_head`` is a plain Python attribute of the
target (set with ``object.__setattr__``), NOT a child module. So the head's
weights are not in ``model.parameters()``: ``mlx_lm.utils.save_model(model)``,
``nn.quantize(model)`` and mlx-lm's memory accounting see only the target,
exactly as mlx-lm loaded it. ``model.mtp_head`` is None when the directory has
no MTP weights; ``model.mtp_missing`` then says why, and :func:`mtp_head_of`
raises an error saying what to run.
"""

from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .head import MTP_MODEL_TYPES, MTPHead, text_args
from .weights import (
    PREFIX,
    SIDECAR_NAME,
    MTPWeightsError,
    check_sidecar_model,
    load_config,
    read_checkpoint_mtp,
    read_sidecar,
    sanitize_mtp,
)


class MTPUnavailableError(ValueError):
    """MTP drafting was asked for a model without MTP weights."""


def _howto(where: str) -> str:
    return (
        "mlx-lm's conversion drops the mtp.* tensors. Write the sidecar with "
        "`mlx_spec convert --hf-path <raw Hugging Face checkpoint> "
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
    """An unbound :class:`MTPHead` holding sanitised ``weights``.

    ``bits`` > 0: the weights are quantised; the layers that have ``.scales``
    in ``weights`` become quantised layers first (as mlx-lm loads).
    """
    head = MTPHead(args, model_type)
    if bits:
        nn.quantize(
            head,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda p, m: f"{PREFIX}{p}.scales" in weights,
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
    """``(sanitised weights, bits, group_size, source)`` for a model, or None.

    Order: ``mtp_path`` (a sidecar file, or a directory holding one), the
    directory's own ``mtp.safetensors``, then ``mtp.*`` tensors in its shards.
    Sidecars are checked against the model (``model_type``, ``args``, and
    the shared weights of the loaded ``model`` when given).
    """
    model_dir = Path(model_dir)
    sidecar = None
    if mtp_path is not None:
        sidecar = Path(mtp_path)
        if not sidecar.exists():
            raise FileNotFoundError(f"MTP path {str(mtp_path)!r} does not exist")
        if sidecar.is_dir():
            sidecar = sidecar / SIDECAR_NAME
            if not sidecar.exists():
                raise FileNotFoundError(f"no {SIDECAR_NAME} in {str(mtp_path)!r}")
    elif (model_dir / SIDECAR_NAME).exists():
        sidecar = model_dir / SIDECAR_NAME
    if sidecar is not None:
        weights, meta = read_sidecar(sidecar)
        check_sidecar_model(meta, model_type, args, sidecar, model)
        bits = int(meta.get("mlx_spec.bits", "0") or 0)
        group_size = int(meta.get("mlx_spec.group_size", "64") or 64)
        return weights, bits, group_size, str(sidecar)
    found = read_checkpoint_mtp(model_dir, progress=progress)
    if found is None:
        return None
    tensors, sanitized, source = found
    if not sanitized:
        tensors = sanitize_mtp(tensors, args, source)
    return tensors, 0, 64, source


def attach_mtp_head(
    model,
    model_dir: Union[str, Path],
    mtp_path: Optional[Union[str, Path]] = None,
    lazy: bool = False,
) -> Optional[MTPHead]:
    """Find the MTP weights of ``model`` (loaded from ``model_dir``), attach the head.

    Sets ``model.mtp_head`` (None when there are none; ``model.mtp_missing``
    then holds the reason). Raises for weights that do not fit the model and
    for a ``mtp_path`` that does not exist.
    """
    model_type = getattr(model, "model_type", None)
    if model_type not in MTP_MODEL_TYPES:
        if mtp_path is not None:
            raise MTPWeightsError(
                f"model type {model_type!r} has no MTP head support "
                f"(supported: {', '.join(MTP_MODEL_TYPES)})"
            )
        head, reason = None, f"model type {model_type!r} has no MTP head"
    elif declared_mtp_layers(Path(model_dir)) == 0 and mtp_path is None:
        head, reason = None, f"{model_dir}/config.json says mtp_num_hidden_layers=0"
    else:
        args = text_args(model)
        found = load_mtp_weights(
            Path(model_dir), args, model_type, mtp_path, model=model
        )
        if found is None:
            head = None
            reason = (
                f"{model_dir} has no MTP weights (no mtp.* tensors, no "
                f"{SIDECAR_NAME}). " + _howto(str(model_dir))
            )
        else:
            weights, bits, group_size, source = found
            head = build_head(args, model_type, weights, source, bits, group_size)
            head.attention_window = declared_attention_window(Path(model_dir))
            head.bind(model)
            if not lazy:
                mx.eval(head.parameters())
            reason = None
    # Plain attributes: the head must not become part of the target's tree.
    object.__setattr__(model, "mtp_head", head)
    object.__setattr__(model, "mtp_missing", reason)
    return head


def _mtp_setting(model_dir: Path, key: str):
    """``key`` of the config (top level, or ``text_config`` for Qwen3.5)."""
    config = load_config(model_dir)
    return config.get("text_config", config).get(key, config.get(key))


def declared_mtp_layers(model_dir: Path) -> Optional[int]:
    """``mtp_num_hidden_layers`` of the config; None when the config does not
    say (then the checkpoint's ``mtp.*`` tensors decide). More than one layer
    is refused."""
    value = _mtp_setting(model_dir, "mtp_num_hidden_layers")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MTPWeightsError(
            f"{model_dir}/config.json: mtp_num_hidden_layers={value!r} is not a "
            "non-negative integer"
        )
    if value > 1:
        raise MTPWeightsError(
            f"{model_dir}/config.json: mtp_num_hidden_layers={value}; only one MTP "
            "layer is supported"
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
