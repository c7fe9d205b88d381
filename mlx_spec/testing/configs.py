"""Configs of the tiny checkpoints: the families, their dimensions, ``config.json``.

The dimensions are small (hidden 64, 4 layers: 3 Gated-DeltaNet + 1 gated
attention) but every field a released Qwen3-Next / Qwen3.5 config carries is
there, with the nesting of each family (``text_config`` for Qwen3.5).
"""

from __future__ import annotations

from typing import Any, Dict, List

from .tokenizer import EOS_TOKEN_ID, TOKENIZER_VOCAB_SIZE

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
DTYPES = ("float32", "bfloat16", "float16")


_COMMON_DIMS: Dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10_000_000.0,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "mtp_num_hidden_layers": 1,
}
_MOE_DIMS: Dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True,
}
_FAMILY_DIMS: Dict[str, Dict[str, Any]] = {
    # Qwen3-Next has MoE on every layer; intermediate_size is still in its config.
    "qwen3_next": {**_COMMON_DIMS, **_MOE_DIMS, "intermediate_size": 128},
    "qwen3_5": {**_COMMON_DIMS, "intermediate_size": 128},
    "qwen3_5_moe": {**_COMMON_DIMS, **_MOE_DIMS},
}
_TIED_DEFAULT = {"qwen3_next": False, "qwen3_5": True, "qwen3_5_moe": False}


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def default_dims(family: str) -> Dict[str, Any]:
    """The default dimensions (flat dict, the keys ``**overrides`` accepts) of a family."""
    check_family(family)
    return {**_FAMILY_DIMS[family], "tie_word_embeddings": _TIED_DEFAULT[family]}


def resolve_dims(family: str, overrides: Dict[str, Any]) -> Dict[str, Any]:
    dims = default_dims(family)
    unknown = sorted(set(overrides) - set(dims))
    if unknown:
        raise ValueError(
            f"unknown override(s) {unknown} for family {family!r}; "
            f"accepted: {sorted(dims)}"
        )
    dims.update(overrides)
    if dims["vocab_size"] < TOKENIZER_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={dims['vocab_size']} is smaller than the tokenizer's "
            f"{TOKENIZER_VOCAB_SIZE} tokens"
        )
    if dims["linear_num_value_heads"] % dims["linear_num_key_heads"]:
        raise ValueError(
            f"linear_num_value_heads={dims['linear_num_value_heads']} is not a "
            f"multiple of linear_num_key_heads={dims['linear_num_key_heads']}"
        )
    if dims["num_attention_heads"] % dims["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads={dims['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads={dims['num_key_value_heads']}"
        )
    rot = dims["head_dim"] * dims["partial_rotary_factor"]
    if rot != int(rot) or int(rot) % 2:
        raise ValueError(
            f"head_dim * partial_rotary_factor = {rot} must be an even integer"
        )
    if dims["mtp_num_hidden_layers"] < 0:
        raise ValueError(
            f"mtp_num_hidden_layers={dims['mtp_num_hidden_layers']} must be >= 0"
        )
    if "num_experts" in dims and not (
        0 < dims["num_experts_per_tok"] <= dims["num_experts"]
    ):
        raise ValueError(
            f"num_experts_per_tok={dims['num_experts_per_tok']} must be in "
            f"1..num_experts={dims['num_experts']}"
        )
    return dims


def _mrope_section(dims: Dict[str, Any]) -> List[int]:
    # Split the rotary frequencies (rotary_dim / 2) over (t, h, w) as Qwen does:
    # 64 rotary dims -> 32 frequencies -> [11, 11, 10].
    n = int(dims["head_dim"] * dims["partial_rotary_factor"]) // 2
    base, rem = divmod(n, 3)
    return [base + (1 if i < rem else 0) for i in range(3)]


def _layer_types(dims: Dict[str, Any]) -> List[str]:
    k = dims["full_attention_interval"]
    return [
        "full_attention" if (i + 1) % k == 0 else "linear_attention"
        for i in range(dims["num_hidden_layers"])
    ]


# A tiny vision tower's config, in the shape Qwen3.5-family releases (and
# Qwen3.6 / Qwen3.8, shipped as qwen3_5 / qwen3_5_moe) carry beside text_config.
VISION_TENSORS = {
    "model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4),
    "model.visual.merger.linear_fc2.weight": (64, 16),
}


def _vision_fields(dims: Dict[str, Any]) -> Dict[str, Any]:
    V = dims["vocab_size"]  # the special ids sit in the padding rows
    return {
        "image_token_id": V - 4,
        "video_token_id": V - 3,
        "vision_start_token_id": V - 2,
        "vision_end_token_id": V - 1,
        "vision_config": {
            "deepstack_visual_indexes": [],
            "depth": 1,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 16,
            "in_channels": 3,
            "intermediate_size": 32,
            "model_type": "qwen3_5",
            "num_heads": 2,
            "num_position_embeddings": 16,
            "out_hidden_size": dims["hidden_size"],
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }


def tiny_config(
    family: str, *, dtype: str = "float32", vision: bool = False, **overrides
) -> Dict[str, Any]:
    """The ``config.json`` dict that :func:`write_tiny_checkpoint` writes.

    ``vision`` (qwen3_5 families): also the ``vision_config`` and image /
    video token ids of a released multimodal config (Qwen3.6 / Qwen3.8)."""
    dims = resolve_dims(family, overrides)
    if vision and family == "qwen3_next":
        raise ValueError("qwen3_next checkpoints have no vision tower")
    common = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "full_attention_interval": dims["full_attention_interval"],
        "head_dim": dims["head_dim"],
        "hidden_act": "silu",
        "hidden_size": dims["hidden_size"],
        "initializer_range": 0.02,
        "linear_conv_kernel_dim": dims["linear_conv_kernel_dim"],
        "linear_key_head_dim": dims["linear_key_head_dim"],
        "linear_num_key_heads": dims["linear_num_key_heads"],
        "linear_num_value_heads": dims["linear_num_value_heads"],
        "linear_value_head_dim": dims["linear_value_head_dim"],
        "max_position_embeddings": dims["max_position_embeddings"],
        "num_attention_heads": dims["num_attention_heads"],
        "num_hidden_layers": dims["num_hidden_layers"],
        "num_key_value_heads": dims["num_key_value_heads"],
        "rms_norm_eps": dims["rms_norm_eps"],
        "use_cache": True,
        "vocab_size": dims["vocab_size"],
    }
    moe = {}
    if "num_experts" in dims:
        moe = {
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": dims["moe_intermediate_size"],
            "norm_topk_prob": dims["norm_topk_prob"],
            "num_experts": dims["num_experts"],
            "num_experts_per_tok": dims["num_experts_per_tok"],
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": dims["shared_expert_intermediate_size"],
        }
    tied = bool(dims["tie_word_embeddings"])

    if family == "qwen3_next":
        # Qwen3-Next has no MTP key in its config; the checkpoint just holds mtp.*.
        cfg = {
            "architectures": ["Qwen3NextForCausalLM"],
            **common,
            **moe,
            "intermediate_size": dims["intermediate_size"],
            "bos_token_id": EOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "model_type": "qwen3_next",
            "partial_rotary_factor": dims["partial_rotary_factor"],
            "rope_scaling": None,
            "rope_theta": dims["rope_theta"],
            "tie_word_embeddings": tied,
            "torch_dtype": dtype,
            "use_sliding_window": False,
        }
        return dict(sorted(cfg.items()))

    text = {
        **common,
        **moe,
        "attn_output_gate": True,
        "bos_token_id": EOS_TOKEN_ID,
        "dtype": dtype,
        "eos_token_id": EOS_TOKEN_ID,
        "layer_types": _layer_types(dims),
        "model_type": f"{family}_text",
        "mtp_num_hidden_layers": dims["mtp_num_hidden_layers"],
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": _mrope_section(dims),
            "partial_rotary_factor": dims["partial_rotary_factor"],
            "rope_theta": dims["rope_theta"],
            "rope_type": "default",
        },
        "tie_word_embeddings": tied,
    }
    if family == "qwen3_5":
        text["intermediate_size"] = dims["intermediate_size"]
        arch = "Qwen3_5ForConditionalGeneration"
    else:
        arch = "Qwen3_5MoeForConditionalGeneration"
    config = {
        "architectures": [arch],
        "eos_token_id": EOS_TOKEN_ID,
        "model_type": family,
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": tied,
        "transformers_version": "4.57.0.dev0",
    }
    if vision:
        config.update(_vision_fields(dims))
    return dict(sorted(config.items()))
