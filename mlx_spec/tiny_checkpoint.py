"""Tiny, random, offline Qwen3-Next / Qwen3.5 checkpoints in the raw Hugging Face layout.

:func:`write_tiny_checkpoint` writes a directory that looks like a real Qwen release
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``)
but with a few hundred thousand random parameters, so that ``mlx_lm.load(path)`` builds
the real model class (3 Gated-DeltaNet layers + 1 gated-attention layer per block of
``full_attention_interval``, MoE or dense MLP) and runs it on a CPU in milliseconds.

Layout (as the real releases ship it, i.e. *before* mlx-lm's ``sanitize()``):

* ``qwen3_next``: flat config, backbone ``model.*``, per-expert MoE
  ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, ``lm_head.weight``.
* ``qwen3_5`` (dense SwiGLU, tied embeddings) and ``qwen3_5_moe`` (fused experts
  ``experts.gate_up_proj`` ``[E, 2*moe_inter, H]`` gate rows first and
  ``experts.down_proj`` ``[E, H, moe_inter]``, no ``.weight`` suffix): nested
  ``text_config``, backbone ``model.language_model.*``, top-level ``lm_head.weight``
  (absent when tied).
* All families: the MTP head at top level, ``mtp.*`` (one layer by default).
* Every zero-centred RMSNorm gamma (decoder norms, final norm, q/k norms and the seven
  MTP norms) is stored zero-centred with non-trivial values, so a missing or doubled
  ``+1`` changes the outputs. The gated GDN output norm (``linear_attn.norm``) is a
  plain gamma around 1. ``conv1d`` weights are ``[conv_dim, 1, K]``.

Values are a pure function of ``(seed, tensor name, shape)``: each tensor has its own
numpy Generator seeded from the seed and a CRC of its name, so the same seed always
gives the same bytes, and changing one dimension leaves unrelated tensors unchanged.

The tokenizer (``tiny_tokenizer.py``) is a 400-token byte-level BPE with
``<|endoftext|>`` (id 399) as EOS and pad.
"""

from __future__ import annotations

import json
import math
import pathlib
import zlib
from typing import Any, Dict, List, Tuple, Union

import numpy as np

from .tiny_tokenizer import (
    EOS_TOKEN,
    EOS_TOKEN_ID,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer,
    tokenizer_config,
    tokenizer_json,
)

__all__ = [
    "FAMILIES",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "TOKENIZER_VOCAB_SIZE",
    "DTYPES",
    "default_dims",
    "tiny_config",
    "tensor_shapes",
    "build_tokenizer",
    "eos_token_id",
    "write_tiny_checkpoint",
]

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
DTYPES = ("float32", "bfloat16", "float16")


# Standard deviation of the zero-centred norm gammas (stored value; the model uses 1 + w).
_NORM_STD = 0.2
# Rows of the embedding / lm_head past the tokenizer's vocabulary (padding, as in the
# real checkpoints) are scaled down so that greedy decoding rarely picks them.
_PAD_ROW_SCALE = 0.1

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


# --------------------------------------------------------------------------- config


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def default_dims(family: str) -> Dict[str, Any]:
    """The default dimensions (flat dict, the keys ``**overrides`` accepts) of a family."""
    _check_family(family)
    return {**_FAMILY_DIMS[family], "tie_word_embeddings": _TIED_DEFAULT[family]}


def _resolve_dims(family: str, overrides: Dict[str, Any]) -> Dict[str, Any]:
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


def tiny_config(family: str, *, dtype: str = "float32", **overrides) -> Dict[str, Any]:
    """The ``config.json`` dict that :func:`write_tiny_checkpoint` writes."""
    dims = _resolve_dims(family, overrides)
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
    return {
        "architectures": [arch],
        "eos_token_id": EOS_TOKEN_ID,
        "model_type": family,
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": tied,
        "transformers_version": "4.57.0.dev0",
    }


# --------------------------------------------------------------------------- tensors

# kinds: "linear" (N(0, 1/fan_in), fan_in = last dim), "embed", "norm0" (zero-centred
# gamma), "gdn_norm" (gamma around 1), "conv", "A_log", "dt_bias".
_Spec = Tuple[str, Tuple[int, ...], str]


def _attention_specs(p: str, d: Dict[str, Any]) -> List[_Spec]:
    H, hd = d["hidden_size"], d["head_dim"]
    nq, nkv = d["num_attention_heads"], d["num_key_value_heads"]
    return [
        (f"{p}q_proj.weight", (2 * nq * hd, H), "linear"),  # [q_h | gate_h] per head
        (f"{p}k_proj.weight", (nkv * hd, H), "linear"),
        (f"{p}v_proj.weight", (nkv * hd, H), "linear"),
        (f"{p}o_proj.weight", (H, nq * hd), "linear"),
        (f"{p}q_norm.weight", (hd,), "norm0"),
        (f"{p}k_norm.weight", (hd,), "norm0"),
    ]


def _gdn_specs(p: str, d: Dict[str, Any], family: str) -> List[_Spec]:
    H = d["hidden_size"]
    nk, nv = d["linear_num_key_heads"], d["linear_num_value_heads"]
    key_dim = nk * d["linear_key_head_dim"]
    value_dim = nv * d["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    if family == "qwen3_next":
        proj = [
            (f"{p}in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, H), "linear"),
            (f"{p}in_proj_ba.weight", (2 * nv, H), "linear"),
        ]
    else:
        proj = [
            (f"{p}in_proj_qkv.weight", (conv_dim, H), "linear"),
            (f"{p}in_proj_z.weight", (value_dim, H), "linear"),
            (f"{p}in_proj_b.weight", (nv, H), "linear"),
            (f"{p}in_proj_a.weight", (nv, H), "linear"),
        ]
    return proj + [
        (f"{p}conv1d.weight", (conv_dim, 1, d["linear_conv_kernel_dim"]), "conv"),
        (f"{p}dt_bias", (nv,), "dt_bias"),
        (f"{p}A_log", (nv,), "A_log"),
        (f"{p}norm.weight", (d["linear_value_head_dim"],), "gdn_norm"),
        (f"{p}out_proj.weight", (H, value_dim), "linear"),
    ]


def _swiglu_specs(p: str, H: int, inter: int) -> List[_Spec]:
    return [
        (f"{p}gate_proj.weight", (inter, H), "linear"),
        (f"{p}up_proj.weight", (inter, H), "linear"),
        (f"{p}down_proj.weight", (H, inter), "linear"),
    ]


def _mlp_specs(p: str, d: Dict[str, Any], family: str) -> List[_Spec]:
    H = d["hidden_size"]
    if family == "qwen3_5":
        return _swiglu_specs(p, H, d["intermediate_size"])
    E, inter = d["num_experts"], d["moe_intermediate_size"]
    specs: List[_Spec] = [(f"{p}gate.weight", (E, H), "linear")]
    if family == "qwen3_next":
        for e in range(E):
            specs += _swiglu_specs(f"{p}experts.{e}.", H, inter)
    else:
        specs += [
            (f"{p}experts.gate_up_proj", (E, 2 * inter, H), "linear"),
            (f"{p}experts.down_proj", (E, H, inter), "linear"),
        ]
    specs += _swiglu_specs(
        f"{p}shared_expert.", H, d["shared_expert_intermediate_size"]
    )
    specs.append((f"{p}shared_expert_gate.weight", (1, H), "linear"))
    return specs


def _decoder_specs(p: str, d: Dict[str, Any], family: str, linear: bool) -> List[_Spec]:
    H = d["hidden_size"]
    specs: List[_Spec] = [(f"{p}input_layernorm.weight", (H,), "norm0")]
    if linear:
        specs += _gdn_specs(f"{p}linear_attn.", d, family)
    else:
        specs += _attention_specs(f"{p}self_attn.", d)
    specs.append((f"{p}post_attention_layernorm.weight", (H,), "norm0"))
    specs += _mlp_specs(f"{p}mlp.", d, family)
    return specs


def _specs(family: str, d: Dict[str, Any]) -> List[_Spec]:
    H, V = d["hidden_size"], d["vocab_size"]
    base = "model." if family == "qwen3_next" else "model.language_model."
    specs: List[_Spec] = [(f"{base}embed_tokens.weight", (V, H), "embed")]
    k = d["full_attention_interval"]
    for i in range(d["num_hidden_layers"]):
        linear = (i + 1) % k != 0
        specs += _decoder_specs(f"{base}layers.{i}.", d, family, linear)
    specs.append((f"{base}norm.weight", (H,), "norm0"))
    if not d["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (V, H), "embed"))
    if d["mtp_num_hidden_layers"] > 0:
        specs += [
            ("mtp.fc.weight", (H, 2 * H), "linear"),
            ("mtp.pre_fc_norm_embedding.weight", (H,), "norm0"),
            ("mtp.pre_fc_norm_hidden.weight", (H,), "norm0"),
            ("mtp.norm.weight", (H,), "norm0"),
        ]
        for j in range(d["mtp_num_hidden_layers"]):
            specs += _decoder_specs(f"mtp.layers.{j}.", d, family, linear=False)
    return specs


def tensor_shapes(family: str, **overrides) -> Dict[str, Tuple[int, ...]]:
    """Name -> shape of every tensor in the ``model.safetensors`` of a family."""
    d = _resolve_dims(family, overrides)
    return {name: shape for name, shape, _ in _specs(family, d)}


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])


def _values(seed: int, name: str, shape: Tuple[int, ...], kind: str) -> np.ndarray:
    rng = _rng(seed, name)
    if kind == "linear":
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= 1.0 / math.sqrt(shape[-1])
    elif kind == "embed":
        # std 1/sqrt(H): unit-scale logits for a unit-RMS hidden state, whether the
        # matrix is the (tied) output head or only the input table.
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= 1.0 / math.sqrt(shape[-1])
        w[TOKENIZER_VOCAB_SIZE:] *= _PAD_ROW_SCALE
    elif kind == "norm0":
        w = rng.standard_normal(shape, dtype=np.float32) * _NORM_STD
    elif kind == "gdn_norm":
        w = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    elif kind == "conv":
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= 1.0 / math.sqrt(shape[-1])
    elif kind == "A_log":
        w = np.log(rng.uniform(1.0, 16.0, shape))
    elif kind == "dt_bias":
        w = rng.uniform(0.5, 1.5, shape)
    else:  # pragma: no cover - internal
        raise AssertionError(kind)
    return np.ascontiguousarray(w, dtype=np.float32)


def eos_token_id(path: Union[str, pathlib.Path]) -> int:
    """The EOS id recorded in a checkpoint's ``config.json``."""
    cfg = json.loads((pathlib.Path(path) / "config.json").read_text())
    eos = cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id"))
    return eos[0] if isinstance(eos, list) else eos


# ---------------------------------------------------------------------------- writer


def _save(tensors: Dict[str, np.ndarray], file: pathlib.Path, dtype: str) -> None:
    metadata = {"format": "pt"}
    if dtype == "float32":
        from safetensors.numpy import save_file

        save_file(tensors, str(file), metadata=metadata)
    elif dtype == "float16":
        from safetensors.numpy import save_file

        save_file(
            {k: v.astype(np.float16) for k, v in tensors.items()},
            str(file),
            metadata=metadata,
        )
    else:  # bfloat16: numpy has no bf16, mlx writes it
        import mlx.core as mx

        arrays = {k: mx.array(v).astype(mx.bfloat16) for k, v in tensors.items()}
        mx.save_safetensors(str(file), arrays, metadata=metadata)


def write_tiny_checkpoint(
    path: Union[str, pathlib.Path],
    family: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    **overrides,
) -> pathlib.Path:
    """Write a tiny random raw-HF checkpoint of ``family`` into directory ``path``.

    ``overrides`` change dimensions (keys of :func:`default_dims`, e.g.
    ``num_hidden_layers=8``); they apply to the text config. Writes ``config.json``,
    ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``
    (overwriting those four files) and returns the directory as a ``Path``.
    """
    _check_family(family)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    dims = _resolve_dims(family, overrides)
    config = tiny_config(family, dtype=dtype, **overrides)

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: _values(int(seed), name, shape, kind)
        for name, shape, kind in _specs(family, dims)
    }
    _save(tensors, out / "model.safetensors", dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tokenizer_json())
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(dims["max_position_embeddings"]), indent=2) + "\n"
    )
    return out
