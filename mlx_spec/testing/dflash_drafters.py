"""Tiny DFlash drafters in z-lab's checkpoint layout, random, deterministic
from a seed: one fits the tiny target of each family (the hybrid families of
``checkpoints.py`` and the attention-only ``llama`` of ``attention_only.py``).

:func:`write_dflash_checkpoint` writes ``config.json`` and
``model.safetensors``; ``config`` overrides (``None`` deletes a field) and
``drop`` / ``reshape`` make the broken checkpoints the refusal tests need.
:func:`write_successor_drafter` writes a built (not random) drafter whose
drafts a cycle target accepts now and then.
"""

import json
import pathlib
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import mlx.core as mx
import numpy as np

from .attention_only import LLAMA_CONFIG
from .configs import DTYPES, default_dims

TARGET_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "llama")
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def target_dims(family: str) -> Dict[str, int]:
    """hidden_size, vocab_size and num_hidden_layers of the tiny target of
    ``family`` (its default dimensions)."""
    dims = LLAMA_CONFIG if family == "llama" else default_dims(family)
    return {k: dims[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers")}


def dflash_config(
    family: str,
    *,
    num_hidden_layers: int = 2,
    block_size: int = 4,
    target_layer_ids: Any = (0, 1),
    **overrides: Any,
) -> Dict[str, Any]:
    """The ``config.json`` of a tiny drafter for ``family``'s tiny target;
    ``overrides`` replace top-level fields (``None``: removed), the keys of
    ``dflash_config`` included (``mask_token_id=None`` removes it);
    ``target_layer_ids``: a tuple, or any value written as it is (None: left
    out)."""
    target = target_dims(family)
    H = target["hidden_size"]
    dflash = {
        "block_size": block_size,
        "target_layer_ids": target_layer_ids,
        "mask_token_id": target["vocab_size"] - 1,
    }
    if target_layer_ids is None:  # the loader spreads them over the target
        del dflash["target_layer_ids"]
    elif isinstance(target_layer_ids, tuple):
        dflash["target_layer_ids"] = list(target_layer_ids)
    config: Dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 2 * H,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000.0,
        "max_position_embeddings": 4096,
        "vocab_size": target["vocab_size"],
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": dflash,
    }
    for key, value in overrides.items():
        owner = dflash if key in dflash else config
        if value is None:
            owner.pop(key, None)
        else:
            owner[key] = value
    return config


def tensor_shapes(config: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """Every tensor of a ``DFlashDraftModel`` checkpoint with ``config``."""
    H = config["hidden_size"]
    D = config.get("head_dim") or H // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * D, config["num_key_value_heads"] * D
    inter = config["intermediate_size"]
    ids = config.get("dflash_config", {}).get("target_layer_ids")
    n = len(ids) if ids else config["num_hidden_layers"]
    shapes = {
        "fc.weight": (H, n * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (q, H),
                p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H),
                p + "self_attn.o_proj.weight": (H, q),
                p + "self_attn.q_norm.weight": (D,),
                p + "self_attn.k_norm.weight": (D,),
                p + "mlp.gate_proj.weight": (inter, H),
                p + "mlp.up_proj.weight": (inter, H),
                p + "mlp.down_proj.weight": (H, inter),
            }
        )
    return shapes


def _values(rng: np.random.Generator, name: str, shape) -> np.ndarray:
    if name.endswith("norm.weight"):  # near 1, as trained norms are
        return 1.0 + 0.1 * rng.standard_normal(shape)
    # Scaled so that activations stay O(1) through the layers.
    return rng.standard_normal(shape) / np.sqrt(shape[-1])


def write_dflash_checkpoint(
    path: Union[str, pathlib.Path],
    family: str = "qwen3_5",
    *,
    seed: int = 0,
    dtype: str = "float32",
    drop: Iterable[str] = (),
    reshape: Optional[Dict[str, Tuple[int, ...]]] = None,
    **config_overrides: Any,
) -> pathlib.Path:
    """Write a random drafter for ``family``'s tiny target into directory
    ``path`` and return it. ``config_overrides``: see :func:`dflash_config`;
    ``drop``: tensor names left out; ``reshape``: tensors written with
    another shape."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    config = dflash_config(family, **config_overrides)
    shapes = tensor_shapes(config)
    shapes.update(reshape or {})
    rng = np.random.default_rng(seed)
    dropped = set(drop)
    tensors = {
        name: mx.array(_values(rng, name, shape).astype(np.float32)).astype(
            _DTYPES[dtype]
        )
        for name, shape in sorted(shapes.items())
        if name not in dropped
    }
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def random_features(
    config: Dict[str, Any], positions: int, seed: int = 0, rows: int = 1
) -> mx.array:
    """Random target features [rows, positions, n * hidden] for a drafter with
    ``config`` (what the target's selected layer outputs would be)."""
    n = len(config["dflash_config"]["target_layer_ids"])
    rng = np.random.default_rng(seed)
    shape = (rows, positions, n * config["hidden_size"])
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def write_successor_drafter(
    path: Union[str, pathlib.Path],
    target,
    family: str = "qwen3_5",
    *,
    block_size: int = 4,
    gain: float = 1e4,
) -> pathlib.Path:
    """Write a one-layer drafter for ``target`` (``family``'s tiny target,
    loaded) whose every block position proposes the target's bigram successor
    of the pending token, ``argmax(lm_head(embed(pending)))``.

    With a cycle target (``mtp_heads.write_cycle_checkpoint``: ``lm_head[next(t)]
    = embed[t]``) the first draft is right whenever the target follows its
    cycle, and the later ones repeat it, so they are wrong: a block of 4 accepts
    one draft or none each pass, a block of 2 all or none. Built, not random:

    - ``fc = 0``: the context vectors are zero, so are their keys and values;
    - ``q_proj = k_proj = 0``: every position attends to every key equally;
    - ``v_proj = gain · (I - u uᵀ)``, ``u`` the unit direction of the mask
      token's normalised embedding: mask positions carry no value, so the
      attention output is the pending token's normalised embedding (less its
      part along ``u``) over the number of keys;
    - ``o_proj = I``, ``down_proj = 0``, norms 1: ``h`` at a mask position is
      the mask's embedding plus that output, dominated by it when ``gain`` is
      large against the context length (1e4: a few hundred positions).

    Needs ``num_attention_heads · head_dim == hidden_size`` (4 · 16 for the
    tiny targets) so that ``v_proj`` and ``o_proj`` are square."""
    config = dflash_config(
        family,
        num_hidden_layers=1,
        block_size=block_size,
        target_layer_ids=(1,),
        num_key_value_heads=4,
    )
    H = config["hidden_size"]
    if config["num_attention_heads"] * config["head_dim"] != H:
        raise ValueError(f"{family}: heads · head_dim must equal hidden size {H}")
    embed = getattr(target, "language_model", target).model.embed_tokens
    mask = config["dflash_config"]["mask_token_id"]
    e = np.array(embed(mx.array([mask])).astype(mx.float32))[0]
    u = e / np.linalg.norm(e)
    tensors = {
        name: np.ones(shape) if name.endswith("norm.weight") else np.zeros(shape)
        for name, shape in tensor_shapes(config).items()
    }
    tensors["layers.0.self_attn.v_proj.weight"] = gain * (np.eye(H) - np.outer(u, u))
    tensors["layers.0.self_attn.o_proj.weight"] = np.eye(H)
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "model.safetensors"),
        {k: mx.array(v.astype(np.float32)) for k, v in sorted(tensors.items())},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
