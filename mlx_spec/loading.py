"""Loading models for speculative decoding."""

from pathlib import Path
from typing import Any, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import mlx_lm_compat
from .hub.resolve import resolve_drafter, resolve_model, resolve_mtp_path
from .models.dflash.weights import load_dflash
from .models.fast_layers import enable_fast_layers
from .models.gdn import make_verifiable
from .models.identity import record_sources, weight_files
from .models.mtp import attach_mtp_head
from .models.pipeline import split_model


def prepare_model(model):
    """Give the model's GDN layers the verify forward and route its attention
    and experts through the kernel dispatch (idempotent, in place; exactly
    mlx-lm's computation while kernels are not used)."""
    for layer in model.layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None:
            make_verifiable(gdn)
    enable_fast_layers(model)
    return model


def upcast_experts_on_cpu(model):
    """Cast a half-precision MoE model to float32 when it runs on the CPU.

    MLX's CPU ``gather_mm`` (the experts' matmul) runs float32 only, so a
    bfloat16 MoE checkpoint cannot decode there at all (mlx-lm alone fails with
    ``[GatherMM::eval] Currently only supports float32``); other devices and
    dense or quantized models are left exactly as loaded.
    """
    if mx.default_device().type != mx.DeviceType.cpu:
        return model
    half = (mx.bfloat16, mx.float16)
    head = getattr(model, "__dict__", {}).get("mtp_head")  # not a child module
    modules = [m for m in (model, head) if m is not None]
    quantized = (
        nn.QuantizedLinear,
        nn.QuantizedEmbedding,
        mlx_lm_compat.QuantizedSwitchLinear,
    )
    if any(isinstance(sub, quantized) for _, sub in model.named_modules()):
        return model  # a quantized model keeps its dtypes (and its scales)
    if any(
        isinstance(sub, mlx_lm_compat.SwitchLinear) and sub.weight.dtype in half
        for m in modules
        for _, sub in m.named_modules()
    ):
        for m in modules:
            m.set_dtype(mx.float32)
            # Evaluated here: a lazy cast belongs to this thread's stream, and a
            # model decoded on another thread (the server's engine) could not run it.
            mx.eval(m.parameters())
    return model


def load(
    path_or_hf_repo: Union[str, Path],
    tokenizer_config: Optional[dict] = None,
    mtp_path: Optional[Union[str, Path]] = None,
    pipeline_group=None,
    revision: Optional[str] = None,
    **kwargs: Any,
) -> Tuple[Any, Any]:
    """Load ``(model, tokenizer)`` like ``mlx_lm.load``, ready for speculation.

    For Qwen3-Next / Qwen3.5 the MTP head is attached as ``model.mtp_head``
    (see :mod:`mlx_spec.models.mtp.attach`): from ``mtp_path`` (a sidecar written by
    ``mlx_spec convert``), else the directory's ``mtp.safetensors``, else the
    ``mtp.*`` tensors of a raw checkpoint; None when there are none.

    ``path_or_hf_repo`` and ``mtp_path`` may be Hugging Face repo ids
    (``revision``: the model's branch, tag or commit): see :mod:`mlx_spec.hub.resolve`.

    ``pipeline_group`` (an ``mx.distributed`` group of more than one process):
    this process keeps only its own layers (see :mod:`mlx_spec.models.pipeline`).
    """
    path = resolve_model(path_or_hf_repo, revision)
    if mtp_path is not None:
        mtp_path = resolve_mtp_path(mtp_path)
    split = pipeline_group is not None and pipeline_group.size() > 1
    lazy = kwargs.pop("lazy", False)
    model, tokenizer = mlx_lm_compat.load(
        str(path), tokenizer_config=tokenizer_config, lazy=lazy or split, **kwargs
    )
    if split:  # only this rank's layers are ever read from the files
        split_model(model, pipeline_group)
        if not lazy:
            mx.eval(model.parameters())
    attach_mtp_head(model, path, mtp_path=mtp_path, lazy=lazy)
    model = prepare_model(upcast_experts_on_cpu(model))
    info = model.__dict__.get("mtp_info")
    head_files = [Path(f) for f in info.files] if info is not None else []
    record_sources(model, weight_files(path, kwargs.get("adapter_path")), head_files)
    return model, tokenizer


def load_drafter(
    path_or_hf_repo: Union[str, Path],
    target_model,
    quantize: Optional[int] = None,
    revision: Optional[str] = None,
):
    """Load a DFlash block drafter for ``target_model`` (a model from
    :func:`load`): a local directory or a Hugging Face repo id (``revision``:
    its branch, tag or commit) holding ``config.json`` and safetensors.

    ``quantize`` (4 or 8): its linear layers quantised in memory (affine,
    groups of 64). A drafter that does not fit the target raises
    :class:`~mlx_spec.errors.InputError` naming the field; a path that does
    not exist, ``FileNotFoundError``; a repo that cannot be fetched,
    :class:`~mlx_spec.hub.resolve.HubError`.
    """
    path = resolve_drafter(path_or_hf_repo, revision)
    return load_dflash(path, target_model, quantize_bits=quantize)


def use_draft_model(target_model, draft_model, quantize: Optional[int] = None):
    """Make ``draft_model`` the drafter ``draft="dflash"`` uses with
    ``target_model``: a path or repo id (loaded with :func:`load_drafter`)
    or a drafter :func:`load_drafter` returned for this target. Returns it."""
    from .drafters.dflash import attach_draft_model

    if isinstance(draft_model, (str, Path)):
        draft_model = load_drafter(draft_model, target_model, quantize=quantize)
    return attach_draft_model(target_model, draft_model)
