"""The demo drafter's training setup shared by its stages: the run's
configuration (the drafter's shape, the data, the optimiser), its log
line and the frozen target (``train_dflash.py`` runs the stages)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import mlx_spec  # noqa: E402
from mlx_spec.demo import default_model_path  # noqa: E402


@dataclass
class Config:
    seed: int = 0
    # drafter
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    block_size: int = 16
    target_layer_ids: List[int] = field(default_factory=lambda: [1, 4, 7])
    # <|endoftext|>: the vocabulary has no spare id; see the card for why it is safe
    mask_token_id: int = 2047
    rope_theta: float = 10_000_000.0
    # data
    gen_batches: int = 24
    gen_batch_size: int = 64
    prompt_lengths: List[int] = field(default_factory=lambda: [32, 64, 128])
    gen_tokens: int = 160
    sample_every: int = 3  # every third batch sampled
    temperature: float = 0.8
    val_batch_size: int = 32
    # training
    steps: int = 1800
    rows: int = 8
    anchors: int = 16
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    gamma: float = 7.0
    eval_every: int = 200
    grad_clip: float = 1.0

    def drafter_json(self, target_layers: int, vocab: int, hidden: int) -> dict:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": hidden,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": 32768,
            "vocab_size": vocab,
            "num_target_layers": target_layers,
            "torch_dtype": "bfloat16",
            "dflash_config": {
                "block_size": self.block_size,
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
        }


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_target():
    model, tok = mlx_spec.load(default_model_path())
    model.freeze()
    return model, tok
