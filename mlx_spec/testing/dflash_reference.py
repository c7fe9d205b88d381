"""z-lab's own DFlash code beside mlx-spec's: ``dflash.model_mlx`` of the
``dflash`` package 0.1.0 (not a dependency: its wheel pins versions of tqdm,
datasets and requests that would replace the user's; install it with
:data:`INSTALL`).

- :func:`reference_draft_model`: z-lab's ``DFlashDraftModel`` for one of our
  checkpoints, built from its config as z-lab's loader builds it (the loader
  itself only takes repo ids);
- :func:`reference_loop_gap`: why z-lab's decode loop cannot roll a target
  back (empty when it can);
- :func:`run_reference_loop`: z-lab's greedy loop, its tokens and the drafts
  each verify pass accepted.
"""

import importlib
import json
import pathlib
import time
from dataclasses import dataclass
from typing import List, Sequence, Union

import mlx.core as mx

from ..mlx_lm_compat import make_prompt_cache, qwen3_5

INSTALL = "pip install --no-deps dflash==0.1.0"
MODULE = "dflash.model_mlx"


def reference_module():
    """z-lab's module; ``ImportError`` saying how to install it when absent."""
    try:
        return importlib.import_module(MODULE)
    except ImportError as e:
        raise ImportError(f"z-lab's dflash package is absent ({INSTALL}): {e}") from e


def reference_draft_model(path: Union[str, pathlib.Path], target):
    """z-lab's draft model for the checkpoint directory ``path``, bound to
    ``target``; with the checkpoint's config (a dict)."""
    reference = reference_module()
    path = pathlib.Path(path)
    cfg = json.loads((path / "config.json").read_text())
    dflash = cfg["dflash_config"]
    layers = cfg["num_hidden_layers"]
    config = reference.DFlashConfig(
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=layers,
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"],
        max_position_embeddings=cfg["max_position_embeddings"],
        block_size=dflash["block_size"],
        target_layer_ids=tuple(dflash["target_layer_ids"]),
        num_target_layers=cfg["num_target_layers"],
        mask_token_id=dflash["mask_token_id"],
        rope_scaling=cfg.get("rope_parameters") or cfg.get("rope_scaling"),
        layer_types=tuple(cfg.get("layer_types") or ["full_attention"] * layers),
        sliding_window=cfg.get("sliding_window"),
        is_causal=cfg.get("is_causal"),
    )
    model = reference.DFlashDraftModel(config)
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    model.load_weights(list(weights.items()))
    model.eval()
    return model.bind(target), cfg


def reference_loop_gap(model) -> str:
    """Why z-lab's loop cannot roll ``model`` (loaded by mlx-lm alone) back
    after a rejected draft; empty when it can.

    Its loop trims trimmable caches and recomputes the state of every other
    layer from inputs it records by replacing ``qwen3_5.GatedDeltaNet.__call__``
    while it runs; it asserts that every cache that cannot be trimmed is such a
    layer's. So it covers attention-only targets and the qwen3_5 families
    (qwen3_5_moe uses the same layer), not qwen3_next (its own GDN class), nor
    a model whose GDN layers mlx-spec's loader gave its verify forward."""
    if all(c.is_trimmable() for c in make_prompt_cache(model)):
        return ""
    others = sorted(
        {
            type(layer.linear_attn).__module__ + "." + type(layer.linear_attn).__name__
            for layer in model.layers
            if hasattr(layer, "linear_attn")
            and type(layer.linear_attn) is not qwen3_5.GatedDeltaNet
        }
    )
    if others:
        return (
            f"its rollback replaces {qwen3_5.__name__}.GatedDeltaNet.__call__ only, "
            f"and this target's recurrent layers are {', '.join(others)}"
        )
    return ""


@dataclass
class ReferenceRun:
    """What z-lab's loop gave: the tokens, the drafts accepted at each verify
    pass whose tokens were all kept (a pass cut by ``max_tokens`` or an
    end-of-sequence token is left out: whether its last token was a draft is
    not reported), the drafts those passes verified, and the times."""

    tokens: List[int]
    accepted: List[int]
    drafted: List[int]
    seconds: float  # the whole call, prefill included
    generation_tps: float  # z-lab's own figure: tokens over the time after prefill


def run_reference_loop(
    model, draft, tokenizer, prompt: Sequence[int], max_tokens: int
) -> ReferenceRun:
    """z-lab's greedy ``stream_generate`` with its own block size; ``model``
    loaded by mlx-lm alone (its layers are wrapped for good by the loop)."""
    reference = reference_module()
    block = int(draft.config.block_size)
    tokens, accepted, drafted = [], [], []
    tps = 0.0
    tic = time.perf_counter()
    for r in reference.stream_generate(
        model, draft, tokenizer, mx.array(list(prompt)), max_tokens=max_tokens
    ):
        before = len(tokens)
        tokens += r.tokens
        tps = r.generation_tps
        if r.accepted is None:  # the prefill's token, or the closing response
            continue
        # its block: min(block_size, max_tokens - n + 1) positions, n = tokens so far
        k = min(block - 1, max_tokens - before)
        if len(tokens) < max_tokens and r.finish_reason is None:
            accepted.append(len(r.tokens) - 1)
            drafted.append(k)
    return ReferenceRun(tokens, accepted, drafted, time.perf_counter() - tic, tps)
