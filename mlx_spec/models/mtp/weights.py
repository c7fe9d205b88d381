"""Reading, checking and sanitising MTP weights; the ``mtp.safetensors`` sidecar.

Two sources of weights:

- a raw Hugging Face checkpoint: ``mtp.*`` tensors inside its
  ``model*.safetensors`` shards (only the shards that hold them are opened),
  zero-centred norms, per-expert or fused experts. :func:`sanitize_mtp` adds
  the ``+1`` to the seven norms and stacks the experts into the
  ``switch_mlp`` layout of mlx-lm.
- a sidecar written by ``mlx_spec convert``: already sanitised, which its
  safetensors metadata says (``mlx_spec.sanitized = "true"``), together with
  the model it belongs to (model type, hidden size, vocabulary size, a
  fingerprint of the architecture config, and the signature of the weights
  the head shares with its target: see :mod:`mlx_spec.models.fingerprint`).

Whether the norms still need the ``+1`` is decided only from that metadata,
never from the values, so nothing is ever shifted twice.
"""

import copy
import hashlib
import json
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import mlx.core as mx
from safetensors import safe_open

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

_MLP = "mtp.layers.0.mlp."
_PROJS = ("gate_proj", "up_proj", "down_proj")

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


def args_from_config(config: dict):
    """The mlx-lm text-model args for a ``config.json`` dict (no weights)."""
    config = copy.deepcopy(config)
    model_type = config.get("model_type")
    if model_type == "qwen3_next":
        return qwen3_next.ModelArgs.from_dict(config)
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        return qwen3_5.TextModelArgs.from_dict(config.get("text_config", config))
    raise MTPWeightsError(
        f"model type {model_type!r} has no MTP head support "
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


# ------------------------------------------------------------ raw shapes


def detect_layout(names: Iterable[str]) -> str:
    """``"dense"``, ``"per_expert"`` or ``"fused"`` from the tensor names."""
    names = set(names)
    if _MLP + "experts.gate_up_proj" in names:
        return "fused"
    if any(n.startswith(_MLP + "experts.") for n in names):
        return "per_expert"
    return "dense"


def expected_raw_shapes(args, layout: str) -> Dict[str, Tuple[int, ...]]:
    """Name -> shape of every raw ``mtp.*`` tensor the config implies."""
    H, hd = args.hidden_size, args.head_dim
    nq, nkv = args.num_attention_heads, args.num_key_value_heads
    at = "mtp.layers.0.self_attn."
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        **{n: (H,) for n in MTP_NORMS[:5]},
        at + "q_proj.weight": (2 * nq * hd, H),  # [q_h | gate_h] per head
        at + "k_proj.weight": (nkv * hd, H),
        at + "v_proj.weight": (nkv * hd, H),
        at + "o_proj.weight": (H, nq * hd),
        at + "q_norm.weight": (hd,),
        at + "k_norm.weight": (hd,),
    }

    def swiglu(p: str, inter: int):
        shapes[p + "gate_proj.weight"] = (inter, H)
        shapes[p + "up_proj.weight"] = (inter, H)
        shapes[p + "down_proj.weight"] = (H, inter)

    if layout == "dense":
        swiglu(_MLP, args.intermediate_size)
        return shapes
    E, inter = args.num_experts, args.moe_intermediate_size
    shapes[_MLP + "gate.weight"] = (E, H)
    if layout == "fused":
        shapes[_MLP + "experts.gate_up_proj"] = (E, 2 * inter, H)
        shapes[_MLP + "experts.down_proj"] = (E, H, inter)
    else:
        for e in range(E):
            swiglu(f"{_MLP}experts.{e}.", inter)
    swiglu(_MLP + "shared_expert.", args.shared_expert_intermediate_size)
    shapes[_MLP + "shared_expert_gate.weight"] = (1, H)
    return shapes


def check_raw_shapes(tensors: Dict[str, mx.array], args, source: str):
    """Raise :class:`MTPWeightsError` naming the first tensor that does not fit."""
    layout = detect_layout(tensors)
    moe = getattr(args, "num_experts", 0) > 0
    if moe != (layout != "dense"):
        raise MTPWeightsError(
            f"{source}: the MTP MLP is {layout} but the config has "
            f"num_experts={getattr(args, 'num_experts', 0)}"
        )
    extra_layers = sorted(
        {n.split(".")[2] for n in tensors if n.startswith("mtp.layers.")} - {"0"}
    )
    if extra_layers:
        raise MTPWeightsError(
            f"{source}: MTP layers {extra_layers} found; only one MTP layer "
            "(mtp.layers.0) is supported"
        )
    want = expected_raw_shapes(args, layout)
    for name, shape in want.items():
        if name not in tensors:
            raise MTPWeightsError(f"{source}: MTP tensor {name} is missing")
        got = tuple(tensors[name].shape)
        if got != shape:
            raise MTPWeightsError(
                f"{source}: MTP tensor {name} has shape {got}, but the config "
                f"(hidden_size={args.hidden_size}, head_dim={args.head_dim}, ...) "
                f"implies {shape}"
            )
    unexpected = sorted(set(tensors) - set(want))
    if unexpected:
        raise MTPWeightsError(
            f"{source}: unexpected MTP tensor(s) {unexpected[:4]} for this config"
        )


# ------------------------------------------------------------ sanitising


def sanitize_mtp(
    tensors: Dict[str, mx.array], args, source: str = "checkpoint"
) -> Dict[str, mx.array]:
    """Raw ``mtp.*`` tensors -> the head's parameter names (still ``mtp.``-prefixed).

    Checks every shape against the config first. Adds 1 to the seven norms
    (in float32, cast back) and stacks experts into ``switch_mlp``: per-expert
    ``experts.{e}.{proj}.weight`` or fused ``experts.gate_up_proj`` [E, 2I, H]
    (gate rows first) / ``experts.down_proj`` [E, H, I].
    """
    check_raw_shapes(tensors, args, source)
    out = {}
    for name, v in tensors.items():
        if name in MTP_NORMS:
            v = (v.astype(mx.float32) + 1.0).astype(v.dtype)
        out[name] = v
    layout = detect_layout(tensors)
    switch = _MLP + "switch_mlp."
    if layout == "fused":
        gate_up = out.pop(_MLP + "experts.gate_up_proj")
        inter = gate_up.shape[1] // 2
        out[switch + "gate_proj.weight"] = gate_up[:, :inter, :]
        out[switch + "up_proj.weight"] = gate_up[:, inter:, :]
        out[switch + "down_proj.weight"] = out.pop(_MLP + "experts.down_proj")
    elif layout == "per_expert":
        for proj in _PROJS:
            experts = [
                out.pop(f"{_MLP}experts.{e}.{proj}.weight")
                for e in range(args.num_experts)
            ]
            out[f"{switch}{proj}.weight"] = mx.stack(experts)
    return out


# ------------------------------------------------------- checkpoint files


def _header(file: Path) -> Tuple[List[str], Dict[str, str]]:
    """Tensor names and metadata of a safetensors file (reads the header only)."""
    with safe_open(str(file), framework="numpy") as f:
        return list(f.keys()), dict(f.metadata() or {})


def mtp_shards(model_dir: Path) -> List[Path]:
    """The ``model*.safetensors`` shards of ``model_dir`` that hold ``mtp.*``."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({f for n, f in weight_map.items() if n.startswith(PREFIX)})
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("model*.safetensors"))
    return [f for f in files if any(n.startswith(PREFIX) for n in _header(f)[0])]


def read_checkpoint_mtp(
    model_dir: Path, progress: bool = False
) -> Optional[Tuple[Dict[str, mx.array], bool, str]]:
    """``(tensors, sanitized, source)`` of the ``mtp.*`` tensors in the shards.

    None when no shard holds any. ``sanitized`` comes from the shards'
    metadata (a file this package wrote says so); raw Hugging Face shards are
    unsanitised. Shards written by mlx-lm (``format: mlx``) that still carry
    ``mtp.*`` without that mark are refused: nothing says whether their norms
    were shifted.
    """
    shards = mtp_shards(model_dir)
    if not shards:
        return None
    source = str(shards[0]) if len(shards) == 1 else f"{model_dir} (mtp shards)"
    iterator = shards
    if progress:
        from tqdm import tqdm

        iterator = tqdm(shards, desc="MTP shards", unit="shard")
    tensors: Dict[str, mx.array] = {}
    marks = set()
    for shard in iterator:
        _, meta = _header(shard)
        if meta.get("mlx_spec.sanitized") == "true":
            marks.add(True)
        elif meta.get("format") == "mlx":
            raise MTPWeightsError(
                f"{shard}: mtp.* tensors in a file written by mlx-lm without "
                "mlx_spec metadata; cannot tell whether its norms were shifted. "
                "Run `mlx_spec convert --hf-path <raw checkpoint> --mlx-path "
                f"{Path(model_dir)}` instead"
            )
        else:
            marks.add(False)
        # mx.load is lazy: only the mtp.* tensors kept here are ever read.
        tensors.update(
            {k: v for k, v in mx.load(str(shard)).items() if k.startswith(PREFIX)}
        )
    if len(marks) > 1:
        raise MTPWeightsError(f"{model_dir}: mixed sanitised and raw mtp.* shards")
    return tensors, marks.pop(), source


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


def read_sidecar(path: Path) -> Tuple[Dict[str, mx.array], Dict[str, str]]:
    """``(weights, metadata)`` of a sidecar; refuses files it did not write."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"MTP sidecar {str(path)!r} does not exist")
    weights, meta = mx.load(str(path), return_metadata=True)
    if meta.get("mlx_spec.kind") != "mtp" or meta.get("mlx_spec.sanitized") != "true":
        raise MTPWeightsError(
            f"{path} is not an MTP sidecar written by `mlx_spec convert` "
            "(no mlx_spec metadata)"
        )
    return weights, meta


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
            "write one for this model with `mlx_spec convert --hf-path <its raw "
            "checkpoint> --mlx-path <this model dir>`"
        )
