"""Export the trained demo model as a raw Hugging Face ``qwen3_next`` checkpoint.

The inverse of what the loaders do (mlx-lm's ``Model.sanitize`` for the
backbone, ``mlx_spec.models.mtp.discovery.find_mtp_weights`` for the head):

* stacked ``switch_mlp.{gate,up,down}_proj.weight`` [E, ...] -> per-expert
  ``mlp.experts.{e}.{gate,up,down}_proj.weight``;
* ``conv1d.weight`` [C, K, 1] (MLX) -> [C, 1, K] (PyTorch);
* the zero-centred RMSNorm gammas (decoder norms, ``model.norm``, q/k norms
  and the seven MTP norms) are stored as ``gamma - 1``; the gated GDN norm
  ``linear_attn.norm`` is stored as is;
* the head's parameters under ``mtp.*``.

Writes ``model.safetensors`` (``--dtype``, metadata ``format: pt``),
``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and
``training.json`` (corpus manifest, config, results), then loads the result
through ``mlx_spec.load`` and compares it with the trained float32 model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict

import mlx.core as mx
import numpy as np
from demo_config import DemoConfig
from demo_data import tokenizer_config
from mlx.utils import tree_flatten

_ZERO_CENTRED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_MTP_NORMS = (
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
)
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _zero_centred(name: str) -> bool:
    return (
        name == "model.norm.weight"
        or name in _MTP_NORMS
        or any(name.endswith(s) for s in _ZERO_CENTRED)
    )


def to_raw(params: Dict[str, mx.array], prefix: str = "") -> Dict[str, mx.array]:
    """Sanitised (MLX) parameter names/values -> raw Hugging Face tensors."""
    out = {}
    for name, v in params.items():
        name = prefix + name
        v = v.astype(mx.float32)
        if ".switch_mlp." in name:
            base, proj = name.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{base}.experts.{e}.{proj}"] = v[e]
            continue
        if name.endswith("conv1d.weight"):
            v = v.moveaxis(2, 1)  # [C, K, 1] -> [C, 1, K]
        if _zero_centred(name):
            v = v - 1.0
        out[name] = v
    return out


def export_tensors(model, head) -> Dict[str, mx.array]:
    tensors = to_raw(dict(tree_flatten(model.parameters())))
    tensors.update(to_raw(dict(tree_flatten(head.parameters())), prefix="mtp."))
    return dict(sorted(tensors.items()))


def _compare(cfg: DemoConfig, work: Path, out: Path, model, head) -> dict:
    """The exported checkpoint, loaded like a downloaded one, vs the trained model.

    Exact (within float32 rounding) for a float32 export; a half-precision one
    differs by its rounding of the weights, and the agreements say how much.
    """
    import mlx_spec

    held = np.load(work / "eval_tokens.npy")
    x = mx.array(held[: min(128, held.size - 1)].astype(np.int32))[None]
    loaded, _ = mlx_spec.load(str(out))
    lhead = loaded.mtp_head
    if lhead is None:
        raise RuntimeError(f"no MTP head loaded from {out}: {loaded.mtp_missing}")
    ref_logits = model(x).astype(mx.float32)
    got_logits = loaded(x).astype(mx.float32)
    h_ref = model.model(x)
    h_got = loaded.model(x)
    ref_mtp, _ = head(x[:, 1:], h_ref[:, :-1])
    got_mtp, _ = lhead(x[:, 1:], h_got[:, :-1])
    ref_mtp, got_mtp = ref_mtp.astype(mx.float32), got_mtp.astype(mx.float32)

    def agree(a, b):
        return (mx.argmax(a, -1) == mx.argmax(b, -1)).mean().item()

    return {
        "target_logits_max_abs_diff": mx.abs(ref_logits - got_logits).max().item(),
        "target_argmax_agreement": agree(ref_logits, got_logits),
        "mtp_logits_max_abs_diff": mx.abs(ref_mtp - got_mtp).max().item(),
        "mtp_argmax_agreement": agree(ref_mtp, got_mtp),
        "loaded_dtype": str(loaded.model.embed_tokens.weight.dtype),
    }


def export(cfg: DemoConfig, work: Path, out: Path) -> dict:
    from demo_train import load_target
    from demo_train_mtp import build_head

    work, out = Path(work), Path(out)
    corpus = json.loads((work / "corpus.json").read_text())
    model = load_target(cfg, work)
    head = build_head(model)
    head.load_weights(str(work / "mtp_head.safetensors"))
    head.eval()
    mx.eval(head.parameters())

    out.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(model, head)
    dtype = _DTYPES[cfg.dtype]
    mx.save_safetensors(
        str(out / "model.safetensors"),
        {k: v.astype(dtype) for k, v in tensors.items()},
        metadata={"format": "pt"},
    )
    config = cfg.hf_config(corpus["eos_token_id"])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(work / "tokenizer.json", out / "tokenizer.json")
    tok_config = tokenizer_config(corpus["eos_token_id"], cfg.max_position_embeddings)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")

    results = {}
    for stage in ("target", "mtp"):
        f = work / f"{stage}_result.json"
        if f.exists():
            results[stage] = json.loads(f.read_text())
    check = _compare(cfg, work, out, model, head)
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    training = {
        "corpus": corpus,
        "config": json.loads(cfg.to_json()),
        "results": results,
        "export_check": check,
        "tensor_count": len(tensors),
        "parameters": {
            "total": int(sum(v.size for v in tensors.values())),
            "mtp": int(sum(v.size for k, v in tensors.items() if k.startswith("mtp."))),
        },
    }
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    sizes["training.json"] = (out / "training.json").stat().st_size
    return {"check": check, "sizes": sizes, "total_bytes": sum(sizes.values())}
