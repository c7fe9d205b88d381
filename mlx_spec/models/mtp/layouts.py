"""Every published layout of the MTP head's tensors, turned into one.

Checkpoints and sidecars store the same head in several ways (see
docs/mtp_head.md, "Where the head's weights come from"):

- key prefixes ``mtp.``, ``language_model.mtp.``, ``model.mtp.`` and
  ``model.language_model.mtp.``;
- experts per expert (``experts.{e}.{proj}.weight``), fused
  (``experts.gate_up_proj`` [E, 2I, H] gate rows first, ``experts.down_proj``
  [E, H, I], no ``.weight`` suffix) or stacked (``switch_mlp.{proj}``);
- floating point (bf16, f16, f32), MLX affine quantised (``.scales`` /
  ``.biases`` beside a packed ``uint32`` ``.weight``) or FP8 e4m3 with a
  block-wise ``weight_scale_inv``.

:func:`canonical_tensors` maps all of them to the head's own parameter names
(``mtp.`` + the :class:`~.head.MTPHead` path, experts stacked for mlx-lm's
``SwitchGLU``), FP8 dequantised, affine quantisation kept as published. It
never touches the norms: whether they take the ``+1`` is decided once for
the whole head by :mod:`.norm_shift`.
"""

import math
import re
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx

from .weights import MTPWeightsError

PREFIX = "mtp."
# Longest first: "model.language_model.mtp." also starts with "model.".
MTP_PREFIXES = (
    "model.language_model.mtp.",
    "language_model.mtp.",
    "model.mtp.",
    PREFIX,
)

EXPERT_LAYOUTS = ("dense", "per_expert", "fused", "stacked")
_MLP = "mtp.layers.0.mlp."
_PROJS = ("gate_proj", "up_proj", "down_proj")
_PARTS = ("weight", "scales", "biases")
_PER_EXPERT = re.compile(
    r"^mtp\.layers\.0\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$"
)
FP8_BLOCK = (128, 128)  # Qwen's FP8 releases: quantization_config.weight_block_size


@dataclass(frozen=True)
class LayoutInfo:
    """How a set of MTP tensors was stored (for the one-line report)."""

    prefix: str
    experts: str  # one of EXPERT_LAYOUTS
    dtype: str  # of the floating-point weights as stored ("float8_e4m3" for FP8)
    fp8: bool


def mtp_prefix(name: str) -> Optional[str]:
    """The MTP key prefix ``name`` starts with, or None."""
    return next((p for p in MTP_PREFIXES if name.startswith(p)), None)


def strip_prefix(
    tensors: Dict[str, mx.array], source: str
) -> Tuple[Dict[str, mx.array], str]:
    """``(tensors renamed to mtp.*, the prefix they had)``; other keys are
    dropped. One head has one prefix: several are refused (two heads?)."""
    found: Dict[str, Dict[str, mx.array]] = {}
    for name, value in tensors.items():
        prefix = mtp_prefix(name)
        if prefix is not None:
            found.setdefault(prefix, {})[PREFIX + name[len(prefix) :]] = value
    if not found:
        raise MTPWeightsError(
            f"{source}: no MTP tensors (keys starting with "
            f"{', '.join(MTP_PREFIXES[::-1])})"
        )
    if len(found) > 1:
        raise MTPWeightsError(
            f"{source}: MTP tensors under several prefixes {sorted(found)}; "
            "expected one head"
        )
    prefix, renamed = found.popitem()
    return renamed, prefix


def expert_layout(names: Sequence[str]) -> str:
    """Which of :data:`EXPERT_LAYOUTS` the (``mtp.``-prefixed) names use."""
    names = set(names)
    if any(n.startswith(_MLP + "switch_mlp.") for n in names):
        return "stacked"
    if any(n.startswith(_MLP + "experts.gate_up_proj") for n in names):
        return "fused"
    if any(n.startswith(_MLP + "experts.") for n in names):
        return "per_expert"
    return "dense"


# ------------------------------------------------------------------ FP8


def dequantize_fp8(
    weight: mx.array,
    scale_inv: mx.array,
    block: Tuple[int, int],
    name: str,
    dtype=mx.bfloat16,
) -> mx.array:
    """An FP8 e4m3 ``weight`` [out, in] (stored as uint8) times its block-wise
    ``scale_inv`` [ceil(out/b0), ceil(in/b1)] -> ``dtype``."""
    if weight.ndim != 2 or weight.dtype != mx.uint8:
        raise MTPWeightsError(
            f"{name}: an FP8 weight must be 2-D e4m3 bytes, got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    (m, n), (b0, b1) = weight.shape, block
    want = (math.ceil(m / b0), math.ceil(n / b1))
    if tuple(scale_inv.shape) != want:
        raise MTPWeightsError(
            f"{name}_scale_inv has shape {tuple(scale_inv.shape)}; blocks of "
            f"{b0}x{b1} over {(m, n)} need {want}"
        )
    w = mx.from_fp8(weight, dtype=mx.float32)
    pad = ((0, want[0] * b0 - m), (0, want[1] * b1 - n))
    w = mx.pad(w, pad).reshape(want[0], b0, want[1], b1)
    w = w * scale_inv.astype(mx.float32)[:, None, :, None]
    return w.reshape(want[0] * b0, want[1] * b1)[:m, :n].astype(dtype)


def _dequantize_all_fp8(tensors, block, source) -> bool:
    scale_names = [n for n in tensors if n.endswith(".weight_scale_inv")]
    for scale_name in scale_names:
        name = scale_name[: -len("_scale_inv")]
        if name not in tensors:
            raise MTPWeightsError(f"{source}: {scale_name} without {name}")
        tensors[name] = dequantize_fp8(
            tensors[name], tensors.pop(scale_name), block, f"{source}: {name}"
        )
    return bool(scale_names)


# -------------------------------------------------------------- experts


def _stack_per_expert(tensors, num_experts: int, source: str):
    grouped: Dict[Tuple[str, str], Dict[int, mx.array]] = {}
    for name in [n for n in tensors if _PER_EXPERT.match(n)]:
        e, proj, part = _PER_EXPERT.match(name).groups()
        grouped.setdefault((proj, part), {})[int(e)] = tensors.pop(name)
    for (proj, part), experts in grouped.items():
        missing = sorted(set(range(num_experts)) - set(experts))
        extra = sorted(set(experts) - set(range(num_experts)))
        if missing or extra:
            bad = missing or extra
            raise MTPWeightsError(
                f"{source}: MTP tensor {_MLP}experts.{bad[0]}.{proj}.{part} "
                f"{'is missing' if missing else 'is past'} the config's "
                f"num_experts={num_experts}"
            )
        stacked = mx.stack([experts[e] for e in range(num_experts)])
        tensors[f"{_MLP}switch_mlp.{proj}.{part}"] = stacked


def _split_fused(tensors, source: str):
    for fused, outs in (
        ("gate_up_proj", ("gate_proj", "up_proj")),
        ("down_proj", ("down_proj",)),
    ):
        for part in _PARTS:
            # the weight of a fused expert tensor has no ".weight" suffix
            name = f"{_MLP}experts.{fused}" + ("" if part == "weight" else f".{part}")
            if name not in tensors:
                continue
            value = tensors.pop(name)
            if value.ndim != 3 or value.shape[1] % len(outs):
                raise MTPWeightsError(
                    f"{source}: MTP tensor {name} has shape {tuple(value.shape)}; "
                    "expected [experts, rows, columns] with gate rows then up rows"
                )
            rows = value.shape[1] // len(outs)
            for i, proj in enumerate(outs):
                sliced = value[:, i * rows : (i + 1) * rows, :]
                tensors[f"{_MLP}switch_mlp.{proj}.{part}"] = sliced
    leftover = sorted(n for n in tensors if n.startswith(_MLP + "experts."))
    if leftover:
        raise MTPWeightsError(f"{source}: unexpected MTP tensor(s) {leftover[:4]}")


def canonical_tensors(
    tensors: Dict[str, mx.array],
    num_experts: int,
    source: str,
    fp8_block: Tuple[int, int] = FP8_BLOCK,
) -> Tuple[Dict[str, mx.array], LayoutInfo]:
    """Any published layout -> the head's parameter names (norms untouched).

    ``tensors`` may hold other keys (a whole shard): only those under an MTP
    prefix are kept. Raises :class:`MTPWeightsError` naming ``source`` and
    the tensor for what does not fit.
    """
    out, prefix = strip_prefix(tensors, source)
    extra_layers = sorted(
        {n.split(".")[2] for n in out if n.startswith("mtp.layers.")} - {"0"}
    )
    if extra_layers:
        raise MTPWeightsError(
            f"{source}: MTP layers {extra_layers} found; only one MTP layer "
            "(mtp.layers.0) is supported"
        )
    fp8 = _dequantize_all_fp8(out, fp8_block, source)
    experts = expert_layout(out)
    if (experts != "dense") != (num_experts > 0):
        raise MTPWeightsError(
            f"{source}: the MTP MLP has {experts} experts but the config has "
            f"num_experts={num_experts}"
        )
    if experts == "per_expert":
        _stack_per_expert(out, num_experts, source)
    elif experts == "fused":
        _split_fused(out, source)
    floats = [v.dtype for v in out.values() if mx.issubdtype(v.dtype, mx.floating)]
    weight_dtypes = {
        v.dtype
        for n, v in out.items()
        if n.endswith(".weight") and mx.issubdtype(v.dtype, mx.floating)
    }
    dtype = "float8_e4m3" if fp8 else _dtype_name(weight_dtypes or set(floats))
    return out, LayoutInfo(prefix=prefix, experts=experts, dtype=dtype, fp8=fp8)


def _dtype_name(dtypes) -> str:
    names = sorted(str(d).replace("mlx.core.", "") for d in dtypes)
    return "+".join(names) if names else "none"


# ------------------------------------------------------- MLX affine quantised

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)


def affine_quantization(
    tensors: Dict[str, mx.array],
    float_shapes: Dict[str, Tuple[int, ...]],
    source: str,
) -> Dict[str, Tuple[int, int]]:
    """Layer path (no ``mtp.``) -> ``(bits, group_size)`` of every MLX affine
    quantised layer in ``tensors`` (canonical names).

    Read from the shapes, which fix both exactly: a packed ``uint32`` weight
    [.., out, in * bits / 32] and scales [.., out, in / group_size], ``in``
    being the layer's input size (``float_shapes``: the unquantised head's
    parameter shapes). A config's declared quantisation can only agree.
    """
    quant = {}
    for name in sorted(n for n in tensors if n.endswith(".scales")):
        layer = name[len(PREFIX) : -len(".scales")]
        weight = tensors.get(f"{PREFIX}{layer}.weight")
        if f"{layer}.weight" not in float_shapes or weight is None:
            raise MTPWeightsError(f"{source}: unexpected MTP tensor {name}")
        if f"{PREFIX}{layer}.biases" not in tensors:
            raise MTPWeightsError(
                f"{source}: {name} without {PREFIX}{layer}.biases; only MLX "
                "affine quantisation is supported"
            )
        in_features = float_shapes[f"{layer}.weight"][-1]
        packed, groups = weight.shape[-1], tensors[name].shape[-1]
        bits, group_size = packed * 32 // in_features, in_features // max(groups, 1)
        if (
            weight.dtype != mx.uint32
            or packed * 32 != bits * in_features
            or bits not in AFFINE_BITS
            or group_size * groups != in_features
            or group_size not in AFFINE_GROUP_SIZES
        ):
            raise MTPWeightsError(
                f"{source}: MTP tensor {PREFIX}{layer}.weight ({weight.dtype} "
                f"{tuple(weight.shape)}, scales {tuple(tensors[name].shape)}) is no "
                f"MLX affine quantisation of a layer with {in_features} inputs"
            )
        quant[layer] = (bits, group_size)
    return quant


def describe_quantization(quant: Dict[str, Tuple[int, int]]) -> str:
    """``""`` (not quantised), ``"4-bit affine, group 64"`` or the mix."""
    if not quant:
        return ""
    kinds = sorted(set(quant.values()))
    if len(kinds) == 1:
        bits, group = kinds[0]
        return f"{bits}-bit affine, group {group}"
    counts = {k: sum(v == k for v in quant.values()) for k in kinds}
    return "affine " + ", ".join(
        f"{b}-bit/group {g} ({n} layers)" for (b, g), n in counts.items()
    )
