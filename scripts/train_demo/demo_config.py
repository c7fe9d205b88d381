"""Shapes and training budgets of the demo model (``demo``) and of the test run (``tiny``)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional, Tuple

# The checkpoint layout (config.json of a raw qwen3_next release) is the project's.
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from mlx_spec.testing.checkpoints import tiny_config  # noqa: E402


@dataclass(frozen=True)
class DemoConfig:
    seed: int = 0
    # corpus / tokenizer
    vocab_size: int = 2048
    holdout: float = 0.03
    max_files: Optional[int] = None
    # architecture (qwen3_next)
    hidden_size: int = 256
    num_hidden_layers: int = 8
    full_attention_interval: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    num_experts: int = 48
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 128
    intermediate_size: int = 512  # in the config only: every layer is MoE
    max_position_embeddings: int = 32768  # config only: trained on 512-token windows
    tie_word_embeddings: bool = False
    # target training
    seq_len: int = 512
    batch_size: int = 4
    target_steps: int = 720
    # further warmup-stable-decay cycles after the first one's decay, in steps
    # each (an int is one cycle, 0 none); a resumed run may append cycles
    target_extra_steps: Tuple[int, ...] = ()
    target_lr: float = 2e-3
    warmup_steps: int = 50
    decay: float = 0.2  # share of the steps in the final linear decay
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    gdn_chunk: int = 64
    compile: bool = False  # mx.compile the training steps (~same speed on CPU)
    ckpt_every: int = 25  # steps between resumable checkpoints
    # MTP training (target frozen)
    mtp_steps: int = 1000
    mtp_extra_steps: Tuple[int, ...] = ()  # as target_extra_steps
    mtp_lr: float = 2e-3
    mtp_batch_size: int = 4
    mtp_distill: float = 0.7  # weight of the soft (target-distribution) loss
    # evaluation during training
    eval_windows: int = 64
    log_every: int = 25
    # export: bfloat16 keeps ~28M parameters under 64 MB; mlx_spec.load upcasts
    # to float32 on the CPU, where MLX's gather_mm (the MoE) runs float32 only.
    dtype: str = "bfloat16"

    def hf_config(self, eos_token_id: int) -> dict:
        """The ``config.json`` of a raw Hugging Face qwen3_next checkpoint."""
        dims = {
            k: getattr(self, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "full_attention_interval",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "partial_rotary_factor",
                "rope_theta",
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
                "vocab_size",
                "max_position_embeddings",
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
                "intermediate_size",
                "tie_word_embeddings",
            )
        }
        cfg = tiny_config("qwen3_next", dtype=self.dtype, **dims)
        cfg["bos_token_id"] = eos_token_id
        cfg["eos_token_id"] = eos_token_id
        cfg["mtp_num_hidden_layers"] = 1  # as released configs declare the head
        # The head saw windows of seq_len positions in training; at longer
        # contexts it drafts better (and cheaper) attending to no more.
        cfg["mtp_attention_window"] = self.seq_len
        return dict(sorted(cfg.items()))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


PRESETS = {
    "demo": DemoConfig(),
    # Seconds, for tests: tiny dims, a few files and steps.
    "tiny": DemoConfig(
        vocab_size=512,
        max_files=6,
        holdout=0.2,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        partial_rotary_factor=0.25,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        intermediate_size=64,
        seq_len=64,
        batch_size=2,
        target_steps=3,
        warmup_steps=1,
        gdn_chunk=16,
        mtp_steps=2,
        mtp_batch_size=2,
        eval_windows=4,
        log_every=1,
        dtype="float32",  # exact export check; the bfloat16 upcast is tested apart
    ),
}


def get_config(preset: str = "demo", **overrides) -> DemoConfig:
    cfg = PRESETS[preset]
    known = {f.name: f.type for f in fields(DemoConfig)}
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ValueError(f"unknown config fields {unknown}")
    budgets = {k: _budget(k, v) for k, v in overrides.items() if k.endswith("_steps")}
    return replace(cfg, **{**overrides, **budgets})


def _budget(name: str, value):
    """A ``*_steps`` field checked: an integer >= 1, or for ``*_extra_steps``
    the cycles as a tuple (see :func:`_cycles`)."""
    if name.endswith("extra_steps"):
        return _cycles(name, value)
    if not (type(value) is int and value >= 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _cycles(name: str, value) -> Tuple[int, ...]:
    """``extra_steps`` as a tuple of cycle lengths: an int is one cycle (0: none)."""
    cycles = ([value] if value else []) if type(value) is int else value
    if not isinstance(cycles, (list, tuple)) or not all(
        type(c) is int and c >= 1 for c in cycles
    ):
        raise ValueError(
            f"{name} must be an integer >= 0 or a list of integers >= 1, got {value!r}"
        )
    return tuple(cycles)
