"""Writing one MTP head in every layout the ecosystem publishes (tests).

:func:`write_head` takes the raw ``mtp.*`` tensors of a tiny checkpoint
(:func:`raw_head`) and stores them the way another tool would: in the
model's shards or a sidecar of any name, under any key prefix, experts per
expert / fused / stacked, in bf16, f16, f32, MLX affine 4/8-bit or FP8 with
block scales, norms zero-centred or already shifted, with or without a
manifest. Loading any of them must give the head loaded from the raw
checkpoint (:func:`reference_weights` gives what the lossy storages should
load as).
"""

import json
import pathlib
import re
import shutil
from typing import Dict, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..models.mtp.weights import MTP_NORMS
from .checkpoints import write_tiny_checkpoint

WHERE = (
    "shards",  # the model's own shards, through the index's weight_map
    "sidecar",  # mtp.safetensors
    "sharded_sidecar",  # mtp-0000X-of-00002.safetensors + mtp.safetensors.index.json
    "model_mtp",  # model-mtp.safetensors
    "mtp_dir",  # mtp/weights.safetensors
    "config_path",  # config.json mlx_lm_extra_tensors.mtp_file
)
STORAGES = ("float32", "bfloat16", "float16", "affine8", "affine4", "fp8")
FP8_BLOCK = 32  # smaller than the releases' 128, so the tiny matrices have several
_PER_EXPERT = re.compile(r"^mtp\.layers\.0\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_MLP = "mtp.layers.0.mlp."
_ROUTER_GATES = ("mlp.gate.weight", "shared_expert_gate.weight")
_FILE_OF = {
    "sidecar": "mtp.safetensors",
    "model_mtp": "model-mtp.safetensors",
    "mtp_dir": "mtp/weights.safetensors",
    "config_path": "extra/head.safetensors",
}


def raw_head(checkpoint: pathlib.Path) -> Dict[str, mx.array]:
    """The ``mtp.*`` tensors of a raw tiny checkpoint, experts per expert
    (qwen3_5_moe checkpoints store them fused: split here)."""
    weights = mx.load(str(pathlib.Path(checkpoint) / "model.safetensors"))
    out = {k: v for k, v in weights.items() if k.startswith("mtp.")}
    if _MLP + "experts.gate_up_proj" in out:
        gate_up = out.pop(_MLP + "experts.gate_up_proj")
        down = out.pop(_MLP + "experts.down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            p = f"{_MLP}experts.{e}."
            out[p + "gate_proj.weight"] = gate_up[e, :inter]
            out[p + "up_proj.weight"] = gate_up[e, inter:]
            out[p + "down_proj.weight"] = down[e]
    return out


def shift_norms(tensors: Dict[str, mx.array], by: float = 1.0, names=MTP_NORMS):
    """``tensors`` with ``by`` added to the norms ``names`` (float32, cast
    back, as loaders shift)."""
    out = dict(tensors)
    for n in names:
        out[n] = (out[n].astype(mx.float32) + by).astype(out[n].dtype)
    return out


def _experts(tensors, experts: str, num_experts: int):
    """Per-expert raw tensors -> ``experts`` ("per_expert", "fused", "stacked")."""
    if experts == "per_expert" or not any(_PER_EXPERT.match(n) for n in tensors):
        return dict(tensors)
    if not num_experts:
        num_experts = 1 + max(
            int(m.group(1)) for m in map(_PER_EXPERT.match, tensors) if m
        )
    out = {n: v for n, v in tensors.items() if not _PER_EXPERT.match(n)}

    def stack(proj):
        return mx.stack(
            [tensors[f"{_MLP}experts.{e}.{proj}.weight"] for e in range(num_experts)]
        )

    if experts == "fused":
        out[_MLP + "experts.gate_up_proj"] = mx.concatenate(
            [stack("gate_proj"), stack("up_proj")], axis=1
        )
        out[_MLP + "experts.down_proj"] = stack("down_proj")
    elif experts == "stacked":
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{_MLP}switch_mlp.{proj}.weight"] = stack(proj)
    else:
        raise ValueError(f"unknown experts layout {experts!r}")
    return out


def _quantizable(name: str, v: mx.array) -> bool:
    return v.ndim >= 2 and (name.endswith(".weight") or name.endswith("_proj"))


def _store(tensors, storage: str):
    """Cast or quantise every matrix as ``storage`` says (norms stay float)."""
    if storage in ("float32", "bfloat16", "float16"):
        return {k: v.astype(getattr(mx, storage)) for k, v in tensors.items()}
    out = {}
    for name, v in tensors.items():
        if not _quantizable(name, v):
            out[name] = v
        elif storage.startswith("affine"):
            bits = int(storage[len("affine") :])
            if name.endswith(_ROUTER_GATES):  # 8-bit, as mlx-lm quantises them
                bits = 8
            group = 32 if v.shape[-1] % 64 else 64
            w, scales, biases = mx.quantize(v, group_size=group, bits=bits)
            base = name[: -len(".weight")] if name.endswith(".weight") else name
            weight_name = name if name.endswith(".weight") else base
            out.update(
                {weight_name: w, base + ".scales": scales, base + ".biases": biases}
            )
        elif storage == "fp8":
            if v.ndim != 2:
                out[name] = v  # only 2-D matrices: keep the rest float
                continue
            w, scale = fp8_quantize(v)
            out[name], out[name + "_scale_inv"] = w, scale
        else:
            raise ValueError(f"unknown storage {storage!r}")
    return out


def fp8_quantize(v: mx.array, block: int = FP8_BLOCK):
    """``(e4m3 bytes, scale_inv)`` of a 2-D float matrix, one scale per
    ``block`` x ``block`` tile (as Qwen's FP8 releases store it)."""
    a = np.array(v.astype(mx.float32))
    m, n = a.shape
    rows, cols = -(-m // block), -(-n // block)
    scale = np.zeros((rows, cols), np.float32)
    for i in range(rows):
        for j in range(cols):
            tile = a[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = max(float(np.abs(tile).max()), 1e-12) / 448.0
    full = np.repeat(np.repeat(scale, block, 0), block, 1)[:m, :n]
    return mx.to_fp8(mx.array(a / full)), mx.array(scale)


def fp8_reference(w: mx.array, scale: mx.array, block: int = FP8_BLOCK) -> mx.array:
    """What an FP8 weight should load as (bfloat16), computed by table lookup
    of the 256 e4m3 codes and the repeated block scales."""
    table = np.array(mx.from_fp8(mx.arange(256).astype(mx.uint8), mx.float32))
    values = table[np.array(w)]
    m, n = values.shape
    full = np.repeat(np.repeat(np.array(scale), block, 0), block, 1)[:m, :n]
    return mx.array((values * full).astype(np.float32)).astype(mx.bfloat16)


def write_head(
    model_dir: pathlib.Path,
    tensors: Dict[str, mx.array],
    *,
    where: str = "sidecar",
    prefix: str = "mtp.",
    experts: str = "per_expert",
    storage: str = "float32",
    num_experts: int = 0,
    metadata: Optional[Dict[str, str]] = None,
    manifest: Optional[dict] = None,
) -> pathlib.Path:
    """Store raw-named ``tensors`` (``mtp.*``, per expert) in ``model_dir``.

    ``where`` is one of :data:`WHERE`; "shards" adds them to the model's
    ``model.safetensors`` and its index. Norms are written as given (shift
    them first with :func:`shift_norms` for an already-shifted head).
    Returns the file written (the index for a sharded sidecar).
    """
    model_dir = pathlib.Path(model_dir)
    stored = _store(_experts(tensors, experts, num_experts), storage)
    stored = {prefix + k[len("mtp.") :]: v for k, v in stored.items()}
    meta = {"format": "pt", **(metadata or {})}
    if storage == "fp8":  # the block size, where Qwen's FP8 releases say it
        config = json.loads((model_dir / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
        (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    if where == "shards":
        return _add_to_shards(model_dir, stored, meta)
    if where == "sharded_sidecar":
        names = sorted(stored)
        half = len(names) // 2
        files = {
            "mtp-00001-of-00002.safetensors": names[:half],
            "mtp-00002-of-00002.safetensors": names[half:],
        }
        for f, ns in files.items():
            mx.save_safetensors(
                str(model_dir / f), {n: stored[n] for n in ns}, metadata=meta
            )
        index = model_dir / "mtp.safetensors.index.json"
        weight_map = {n: f for f, ns in files.items() for n in ns}
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        path = index
    elif where in _FILE_OF:
        path = model_dir / _FILE_OF[where]
        path.parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(path), stored, metadata=meta)
        if where == "config_path":
            config = json.loads((model_dir / "config.json").read_text())
            config["mlx_lm_extra_tensors"] = {"mtp_file": _FILE_OF[where]}
            (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    else:
        raise ValueError(f"unknown where {where!r}; expected one of {WHERE}")
    if manifest is not None:
        (model_dir / "mtp").mkdir(exist_ok=True)
        (model_dir / "mtp" / "manifest.json").write_text(json.dumps(manifest))
    return path


def _add_to_shards(model_dir, stored, meta):
    """Put the head in a second shard of the model, named by the index."""
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
    else:
        names = mx.load(str(model_dir / "model.safetensors")).keys()
        index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    shard = "model-mtp-00002-of-00002.safetensors"
    mx.save_safetensors(str(model_dir / shard), stored, metadata=meta)
    index["weight_map"].update({n: shard for n in stored})
    index_file.write_text(json.dumps(index))
    return model_dir / shard


def expected_weights(
    tensors: Dict[str, mx.array],
    storage: str,
    num_experts: int,
    shifted: bool = False,
) -> Dict[str, mx.array]:
    """The float parameters (head names) that raw ``tensors`` stored as
    ``storage`` must load as: lossless storages exactly (cast, norms +1 in
    float32), affine quantised ones as their dequantised values, FP8 as
    :func:`fp8_reference`. Computed here per matrix, without the loader.
    ``shifted``: the +1 was applied before storing (rounded once, in the
    stored dtype), as a tool that publishes shifted heads does."""
    if shifted:
        tensors = shift_norms(tensors)
    out = {}
    for name, v in tensors.items():
        if storage in ("float32", "bfloat16", "float16"):
            v = v.astype(getattr(mx, storage))
        elif storage.startswith("affine") and _quantizable(name, v):
            bits = 8 if name.endswith(_ROUTER_GATES) else int(storage[len("affine") :])
            group = 32 if v.shape[-1] % 64 else 64
            v = mx.dequantize(*mx.quantize(v, group, bits), group, bits)
        elif storage == "fp8" and _quantizable(name, v) and v.ndim == 2:
            v = fp8_reference(*fp8_quantize(v))
        out[name] = v
    if not shifted:
        out = shift_norms(out)
    return _experts(out, "stacked", num_experts)


def write_target(root: pathlib.Path, family: str, save_mlx_dir):
    """``(raw dir, mlx-community style dir without a head)`` of a tiny
    ``family`` checkpoint (``save_mlx_dir(raw, out)``: mlx-lm's conversion)."""
    raw = write_tiny_checkpoint(root / f"{family}_raw", family, seed=3)
    return raw, save_mlx_dir(raw, root / f"{family}_mlx")


def head_params(head) -> Dict[str, mx.array]:
    """Every parameter of ``head``, by its flattened name."""
    return dict(tree_flatten(head.parameters()))


def assert_same_bits(a, b, what):
    """Parameters ``a`` and ``b`` (:func:`head_params`) equal bit for bit."""
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype, (what, k, a[k].dtype, b[k].dtype)
        assert mx.array_equal(a[k], b[k]).item(), (what, k)


def target_copy(targets, tmp_path: pathlib.Path, family: str = "qwen3_5_moe"):
    """``(raw dir, a copy of the head-less model dir in tmp_path, the model)``
    of ``targets[family]`` (``(raw, mlx dir, model)``): a head may be written
    into the copy."""
    raw, mlx, model = targets[family]
    return raw, shutil.copytree(mlx, tmp_path / "model"), model
