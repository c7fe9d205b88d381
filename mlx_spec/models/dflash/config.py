"""A DFlash drafter's ``config.json``, read and checked against its target.

A drafter's config is untrusted input: every field the forward relies on is
checked here, and a bad one is an :class:`~mlx_spec.errors.InputError` whose
one-line message names the field and its value. Two steps, because some
checks need the target: :func:`parse_config` reads the file alone, and
:func:`fit_to_target` checks it against the target's dimensions (and fills
``target_layer_ids`` when the config leaves them out).
"""

from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

from ...errors import InputError

# The one architecture built here. The second version adds grouped dynamic
# convolutions and a candidate selector, which this module does not implement:
# it is refused by name rather than loaded as if it were the first.
SUPPORTED_ARCHITECTURE = "DFlashDraftModel"
REFUSED_ARCHITECTURES = ("DFlash2DraftModel",)
LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 16  # every published drafter uses 16


@dataclass(frozen=True)
class TargetDims:
    """What a drafter must agree with in its target model."""

    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass(frozen=True)
class DFlashConfig:
    """The checked fields of a ``DFlashDraftModel`` config."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    max_position_embeddings: Optional[int]
    layer_types: Tuple[str, ...]
    sliding_window: Optional[int]
    is_causal: Optional[bool]
    block_size: int
    # None until fit_to_target fills them (a config may leave them out).
    target_layer_ids: Optional[Tuple[int, ...]]
    num_target_layers: Optional[int]
    mask_token_id: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None

    def causal(self, layer: int) -> bool:
        """Whether block position i sees only block positions <= i in
        ``layer``: the config's ``is_causal`` when set, else only sliding
        layers are causal (the released drafters attend both ways)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> Optional[int]:
        """The attention window of ``layer`` (None: it sees every position)."""
        if self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None


def _field(where: str, name: str, value: Any, why: str) -> InputError:
    return InputError(f"{where}: {name}={value!r} {why}")


def _int(where: str, raw: Dict[str, Any], name: str, minimum: int = 1) -> int:
    value = raw.get(name)
    if value is None:
        raise InputError(f"{where}: {name} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _field(where, name, value, f"is not an integer >= {minimum}")
    return value


def _positive_float(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _field(where, name, value, "is not a positive number")
    return float(value)


def _optional_float(where: str, name: str, value: Any) -> Optional[float]:
    return None if value is None else _positive_float(where, name, value)


def _head_dim(where: str, raw: Dict[str, Any], heads: int) -> int:
    # Qwen3 configs name it; a config without it means hidden_size / heads.
    if raw.get("head_dim") is None:
        hidden = _int(where, raw, "hidden_size")
        if hidden % heads:
            raise _field(
                where, "hidden_size", hidden, f"does not divide into {heads} heads"
            )
        return hidden // heads
    return _int(where, raw, "head_dim")


def _architecture(where: str, raw: Dict[str, Any]) -> None:
    names = raw.get("architectures")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _field(where, "architectures", names, "is not a list of names")
    for refused in REFUSED_ARCHITECTURES:
        if refused in names:
            raise InputError(
                f"{where}: architectures names {refused}, which mlx-spec does not "
                f"support yet (only {SUPPORTED_ARCHITECTURE})"
            )
    if SUPPORTED_ARCHITECTURE not in names:
        raise _field(
            where, "architectures", names, f"does not name {SUPPORTED_ARCHITECTURE}"
        )


def _rope(where: str, raw: Dict[str, Any]) -> Tuple[float, Optional[Dict[str, Any]]]:
    # Newer configs nest the rope fields in rope_parameters; older ones use
    # rope_theta and rope_scaling at top level.
    scaling = raw.get("rope_parameters", raw.get("rope_scaling"))
    if scaling is not None and not isinstance(scaling, dict):
        raise _field(where, "rope_parameters", scaling, "is not an object")
    theta = raw.get("rope_theta", (scaling or {}).get("rope_theta", 10_000.0))
    return _positive_float(where, "rope_theta", theta), scaling


def _layer_types(where: str, raw: Dict[str, Any], layers: int) -> Tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:
        return ("full_attention",) * layers
    if not isinstance(types, list) or len(types) != layers:
        raise _field(where, "layer_types", types, f"is not a list of {layers} names")
    for t in types:
        if t not in LAYER_TYPES:
            raise _field(
                where, "layer_types", types, f"has {t!r}; known: {LAYER_TYPES}"
            )
    return tuple(types)


def _layer_ids(where: str, value: Any) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        raise _field(where, "target_layer_ids", value, "is not a list of layer numbers")
    if len(set(value)) != len(value) or min(value) < 0:
        raise _field(where, "target_layer_ids", value, "repeats a layer or is negative")
    return tuple(value)


def parse_config(raw: Any, where: str = "drafter config.json") -> DFlashConfig:
    """The checked config of a ``DFlashDraftModel`` from its ``config.json``
    object ``raw``; ``where`` starts every error message."""
    if not isinstance(raw, dict):
        raise InputError(f"{where}: not a JSON object")
    _architecture(where, raw)
    dflash = raw.get("dflash_config", {})
    if not isinstance(dflash, dict):
        raise _field(where, "dflash_config", dflash, "is not an object")

    def pick(name: str, default: Any = None) -> Any:
        # Older configs carry the DFlash fields at top level.
        return dflash.get(name, raw.get(name, default))

    layers = _int(where, raw, "num_hidden_layers")
    heads = _int(where, raw, "num_attention_heads")
    kv_heads = _int(where, raw, "num_key_value_heads")
    if heads % kv_heads:
        raise _field(
            where, "num_key_value_heads", kv_heads, f"does not divide {heads} heads"
        )
    vocab = _int(where, raw, "vocab_size")
    theta, scaling = _rope(where, raw)
    layer_types = _layer_types(where, raw, layers)
    window = None  # without a sliding layer the field is unused (often a placeholder)
    if "sliding_attention" in layer_types:
        window = _int(where, raw, "sliding_window", minimum=2)
    causal = raw.get("is_causal")
    if causal is not None and not isinstance(causal, bool):
        raise _field(where, "is_causal", causal, "is not true, false or null")
    block = pick("block_size", DEFAULT_BLOCK_SIZE)
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise _field(where, "block_size", block, "is not an integer >= 2")
    mask = pick("mask_token_id")
    if mask is None:
        raise InputError(f"{where}: dflash_config.mask_token_id is missing")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
        raise _field(where, "mask_token_id", mask, f"is not a token id below {vocab}")
    targets = raw.get("num_target_layers")
    if targets is not None:
        targets = _int(where, raw, "num_target_layers")
    max_positions = raw.get("max_position_embeddings")
    if max_positions is not None:
        max_positions = _int(where, raw, "max_position_embeddings")
    eps = _positive_float(where, "rms_norm_eps", raw.get("rms_norm_eps", 1e-6))
    return DFlashConfig(
        hidden_size=_int(where, raw, "hidden_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=_head_dim(where, raw, heads),
        intermediate_size=_int(where, raw, "intermediate_size"),
        vocab_size=vocab,
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_positions,
        layer_types=layer_types,
        sliding_window=window,
        is_causal=causal,
        block_size=block,
        target_layer_ids=_layer_ids(where, pick("target_layer_ids")),
        num_target_layers=targets,
        mask_token_id=mask,
        input_embedding_scale=_positive_float(
            where, "input_embedding_scale", pick("input_embedding_scale", 1.0)
        ),
        output_multiplier=_positive_float(
            where, "output_multiplier", pick("output_multiplier", 1.0)
        ),
        final_logit_softcapping=_optional_float(
            where, "final_logit_softcapping", pick("final_logit_softcapping")
        ),
    )


def spread_layer_ids(count: int, num_target_layers: int) -> Tuple[int, ...]:
    """``count`` target layers spread evenly from layer 1 to layer
    ``num_target_layers - 3`` (what the released tooling assumes when a config
    names none); one layer: the middle one (a choice of this module)."""
    if count == 1:
        return (num_target_layers // 2,)
    first, last = 1, max(1, num_target_layers - 3)
    span = last - first
    return tuple(int(round(first + i * span / (count - 1))) for i in range(count))


def fit_to_target(
    config: DFlashConfig, target: TargetDims, where: str = "drafter config.json"
) -> DFlashConfig:
    """``config`` checked against ``target``, with ``target_layer_ids`` filled
    in (spread over the target's layers) when the config names none."""
    if config.hidden_size != target.hidden_size:
        raise InputError(
            f"{where}: hidden_size={config.hidden_size} but the target's hidden "
            f"size is {target.hidden_size}"
        )
    if config.vocab_size != target.vocab_size:
        raise InputError(
            f"{where}: vocab_size={config.vocab_size} but the target's vocabulary "
            f"has {target.vocab_size} entries"
        )
    if (
        config.num_target_layers is not None
        and config.num_target_layers != target.num_layers
    ):
        raise InputError(
            f"{where}: num_target_layers={config.num_target_layers} but the target "
            f"has {target.num_layers} layers (a drafter trained for another model?)"
        )
    ids = config.target_layer_ids
    if ids is None:
        ids = spread_layer_ids(config.num_hidden_layers, target.num_layers)
    beyond = [i for i in ids if i >= target.num_layers]
    if beyond:
        raise InputError(
            f"{where}: target_layer_ids={list(ids)} names layer {beyond[0]}, beyond "
            f"the target's {target.num_layers} layers (0..{target.num_layers - 1})"
        )
    return replace(
        config, target_layer_ids=tuple(ids), num_target_layers=target.num_layers
    )
