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

The tokenizer (``tokenizer.py``) is a 400-token byte-level BPE with
``<|endoftext|>`` (id 399) as EOS and pad.
"""

from __future__ import annotations

import json
import math
import pathlib
import zlib
from typing import Any, Dict, List, Tuple, Union

import numpy as np

from .configs import (
    DTYPES,
    VISION_TENSORS,
    FAMILIES,
    check_family,
    default_dims,
    resolve_dims,
    tiny_config,
)
from .tokenizer import (
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

# Standard deviation of the zero-centred norm gammas (stored value; the model uses 1 + w).
_NORM_STD = 0.2
# Rows of the embedding / lm_head past the tokenizer's vocabulary (padding, as in the
# real checkpoints) are scaled down so that greedy decoding rarely picks them.
_PAD_ROW_SCALE = 0.1

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
    d = resolve_dims(family, overrides)
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
    vision: bool = False,
    **overrides,
) -> pathlib.Path:
    """Write a tiny random raw-HF checkpoint of ``family`` into directory ``path``.

    ``overrides`` change dimensions (keys of :func:`default_dims`, e.g.
    ``num_hidden_layers=8``); they apply to the text config. Writes ``config.json``,
    ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``
    (overwriting those four files) and returns the directory as a ``Path``.
    ``vision`` (qwen3_5 families): the shape of a released multimodal
    checkpoint such as Qwen3.6 / Qwen3.8 (``vision_config`` and image / video
    token ids in the config, a few ``model.visual.*`` tensors in the shard).
    """
    check_family(family)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    dims = resolve_dims(family, overrides)
    config = tiny_config(family, dtype=dtype, vision=vision, **overrides)

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: _values(int(seed), name, shape, kind)
        for name, shape, kind in _specs(family, dims)
    }
    if vision:  # a few tower tensors: loaders of the text model must skip them
        tensors.update(
            {
                n: _values(int(seed), n, shape, "linear")
                for n, shape in VISION_TENSORS.items()
            }
        )
    _save(tensors, out / "model.safetensors", dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tokenizer_json())
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(dims["max_position_embeddings"]), indent=2) + "\n"
    )
    return out


def fine_tune_copy(
    src: Union[str, pathlib.Path],
    dst: Union[str, pathlib.Path],
    layer: int = 3,
    factor: float = 1.5,
) -> str:
    """Copy the model directory ``src`` to ``dst`` with one tensor changed,
    as a fine-tune of one layer would: the attention output projection of
    ``layer`` (or, where that layer has none, its first projection) scaled
    by ``factor``. Everything else, the config and the other tensors
    included, is byte for byte the same. Returns the changed tensor's name."""
    import shutil

    import mlx.core as mx

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    shutil.copytree(src, dst)
    (shard,) = [f for f in dst.glob("*.safetensors") if f.name.startswith("model")]
    tensors, metadata = mx.load(str(shard), return_metadata=True)
    names = sorted(n for n in tensors if f"layers.{layer}." in n and "mtp" not in n)
    name = next((n for n in names if "o_proj.weight" in n), None) or next(
        n for n in names if n.endswith("proj.weight")
    )
    weight = tensors[name]
    tensors[name] = (weight.astype(mx.float32) * factor).astype(weight.dtype)
    shard.unlink()  # a new file, as a trainer's save writes one
    mx.save_safetensors(str(shard), tensors, metadata)
    return name
