"""A tiny attention-only (``llama``) model directory in mlx-lm's format, with
the tiny checkpoints' tokenizer: a model mlx-spec drafts for by n-gram only,
with no GDN layer, no MTP head and no layer its kernels serve."""

import json
import pathlib
from typing import Union

import mlx.core as mx
from ..mlx_lm_compat import llama, save_model

from .checkpoints import TOKENIZER_VOCAB_SIZE
from .tokenizer import tokenizer_config, tokenizer_json

LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": TOKENIZER_VOCAB_SIZE,
}


def write_llama_checkpoint(path: Union[str, pathlib.Path], seed: int = 0):
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files
    of a random two-layer llama into ``path``; returns it as a Path."""
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(**LLAMA_CONFIG))
    mx.eval(model.parameters())
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tokenizer_json())
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(4096), indent=2) + "\n"
    )
    return out
