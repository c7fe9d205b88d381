"""The model an MTP head belongs to, and the ``mtp.safetensors`` sidecar
that ``mlx_spec convert`` writes.

A sidecar written here is already sanitised, which its safetensors metadata
says (``mlx_spec.sanitized = "true"``), together with the model it belongs
to (model type, hidden size, vocabulary size, a fingerprint of the
architecture config, and the signature of the weights the head shares with
its target: see :mod:`mlx_spec.models.fingerprint`). Finding heads in every
published layout is :mod:`.discovery`'s job (with :mod:`.layouts` and
:mod:`.norm_shift`).
"""

import copy
import hashlib
import json
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx

from ...mlx_lm_compat import qwen3_5, qwen3_next
from ..fingerprint import same_weights, signature_from_text, weight_signature

SIDECAR_NAME = "mtp.safetensors"
SIGNATURE_KEY = "mlx_spec.weights"
SIDECAR_VERSION = "1"
PREFIX = "mtp."

# The seven zero-centred MTP norms that take the +1 exactly once.
MTP_NORMS = (
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.post_attention_layernorm.weight",
    "mtp.layers.0.self_attn.q_norm.weight",
    "mtp.layers.0.self_attn.k_norm.weight",
)


# Architecture fields of the text config that fix the head's shapes and
# numerics; their hash identifies "the same model" across raw / converted dirs.
_FINGERPRINT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "full_attention_interval",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "partial_rotary_factor",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
)


class MTPWeightsError(ValueError):
    """MTP weights that do not fit the model (names the tensor or the file)."""


# ----------------------------------------------------------------- config


# Families by the class names of ``architectures`` (Qwen3.6 / Qwen3.8 ship as
# the Qwen3.5 classes).
_ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
}
MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def mtp_model_type(config: dict) -> Optional[str]:
    """The MTP family of a ``config.json`` dict, or None.

    From ``model_type``, ``text_config.model_type`` (``qwen3_5_moe_text``)
    and ``architectures``; the ones present must agree.
    """
    text = config.get("text_config")
    named = {
        "model_type": config.get("model_type"),
        "text_config.model_type": (
            text.get("model_type") if isinstance(text, dict) else None
        ),
    }
    named["text_config.model_type"] = (
        named["text_config.model_type"] or ""
    ).removesuffix("_text") or None
    archs = config.get("architectures")
    if isinstance(archs, list):
        named["architectures"] = next(
            (_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None
        )
    families = {k: v for k, v in named.items() if v in MTP_FAMILIES}
    if len(set(families.values())) > 1:
        raise MTPWeightsError(
            "config.json names several model types: "
            + ", ".join(f"{k}={v!r}" for k, v in families.items())
        )
    return next(iter(families.values()), None)


def args_from_config(config: dict):
    """The mlx-lm text-model args for a ``config.json`` dict (no weights)."""
    config = copy.deepcopy(config)
    model_type = mtp_model_type(config)
    if model_type == "qwen3_next":
        return qwen3_next.ModelArgs.from_dict(config)
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        return qwen3_5.TextModelArgs.from_dict(config.get("text_config", config))
    raise MTPWeightsError(
        f"model type {config.get('model_type')!r} has no MTP head support "
        "(supported: qwen3_next, qwen3_5, qwen3_5_moe)"
    )


def load_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json in {str(model_dir)!r}")
    return json.loads(path.read_text())


def config_fingerprint(model_type: str, args) -> str:
    """A short hash of the architecture fields of ``args``."""
    fields = {f: getattr(args, f, None) for f in _FINGERPRINT_FIELDS}
    fields["model_type"] = model_type
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def model_metadata(model_type: str, args) -> Dict[str, str]:
    """The identity fields a sidecar records and a loader checks."""
    return {
        "mlx_spec.model_type": str(model_type),
        "mlx_spec.hidden_size": str(args.hidden_size),
        "mlx_spec.vocab_size": str(args.vocab_size),
        "mlx_spec.fingerprint": config_fingerprint(model_type, args),
    }


# --------------------------------------------------------------- sidecar


def write_sidecar(
    path: Path, weights: Dict[str, mx.array], metadata: Dict[str, str]
) -> Path:
    """Write sanitised head weights with metadata (atomically: tmp + rename)."""
    path = Path(path)
    meta = {
        "format": "mlx",
        "mlx_spec.kind": "mtp",
        "mlx_spec.version": SIDECAR_VERSION,
        "mlx_spec.sanitized": "true",
        **metadata,
    }
    tmp = path.with_name(path.name + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), weights, metadata=meta)
    tmp.replace(path)
    return path


def check_sidecar_model(
    meta: Dict[str, str], model_type: str, args, path, model=None
) -> None:
    """Raise :class:`MTPWeightsError` naming ``path`` if it is another model's:
    another config, or (given the loaded ``model``) other shared weights."""
    want = model_metadata(model_type, args)
    bad = [
        f"{k.split('.', 1)[1]}={meta.get(k)!r} (model: {v!r})"
        for k, v in want.items()
        if meta.get(k) != v
    ]
    if not bad and model is not None:
        text = meta.get(SIGNATURE_KEY)
        if text is None:
            bad = ["no weight signature (written by an older mlx_spec convert)"]
        else:
            try:
                theirs = signature_from_text(text)
            except ValueError:
                theirs = None
            if theirs is None or not same_weights(theirs, weight_signature(model)):
                bad = ["its embedding / output-head rows are another model's"]
    if bad:
        raise MTPWeightsError(
            f"MTP sidecar {path} belongs to another model: {', '.join(bad)}; "
            "write one for this model with `mlx_spec convert --mtp-from <its raw "
            "checkpoint or repo> --mlx-path <this model dir>`"
        )
