"""Training the demo model's MTP head on the frozen target.

The head is the project's :class:`mlx_spec.models.mtp.MTPHead` (the module
inference runs), bound to the frozen target: row p gets (token_{p+1}, h_p)
with h the target's post-final-norm hidden state, and predicts token_{p+2}.
It is saved as ``mtp_head.safetensors`` in the work directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from chunked_gdn import chunked_gdn
from demo_config import DemoConfig
from demo_train import (
    Batches,
    eval_windows,
    init_weights,
    load_target,
    log_record,
    lr_schedule,
    num_params,
    train_loop,
)


def build_head(model):
    from mlx_spec.models.mtp import MTPHead

    return MTPHead(model.args, model.model_type).bind(model)


def mtp_loss(head, model, x: mx.array, distill: float):
    """x: [B, L+1]. Row p: (x_{p+1}, h_p) -> x_{p+2}; soft labels: target's logits at p+1."""
    h = mx.stop_gradient(model.model(x[:, :-1]))  # [B, L, H] post-norm
    t_logits = mx.stop_gradient(head.logits(h[:, 1:]).astype(mx.float32))
    logits, _ = head(x[:, 1:-1], h[:, :-1])
    logits = logits.astype(mx.float32)
    hard = nn.losses.cross_entropy(logits, x[:, 2:], reduction="mean")
    soft_p = mx.softmax(t_logits, axis=-1)
    soft = -(soft_p * nn.log_softmax(logits, axis=-1)).sum(-1).mean()
    return distill * soft + (1.0 - distill) * hard, hard


def heldout_mtp(head, model, windows) -> dict:
    """Held-out MTP cross-entropy vs the true token_{p+2}, and top-1 agreement with the target."""
    ce, agree, count = 0.0, 0, 0
    with chunked_gdn():
        for w in windows:
            if w.shape[1] < 3:
                continue
            h = model.model(w[:, :-1])
            logits, _ = head(w[:, 1:-1], h[:, :-1])
            logits = logits.astype(mx.float32)
            t_pred = mx.argmax(head.logits(h[:, 1:]), axis=-1)
            ce += nn.losses.cross_entropy(logits, w[:, 2:], reduction="sum").item()
            agree += (mx.argmax(logits, axis=-1) == t_pred).sum().item()
            count += w.shape[1] - 2
    return {
        "mtp_heldout_loss": ce / max(count, 1),
        "mtp_top1_agree": agree / max(count, 1),
    }


def train_mtp(cfg: DemoConfig, work: Path, stop_after=None):
    """Train the MTP head on the frozen target; saves ``mtp_head.safetensors``.

    Resumable and stoppable as :func:`train_target`.
    """
    work = Path(work)
    train = np.load(work / "train_tokens.npy")
    held = np.load(work / "eval_tokens.npy")
    cycles = (cfg.mtp_steps, *cfg.mtp_extra_steps)
    steps = sum(cycles)
    model = load_target(cfg, work)
    model.freeze()
    mx.random.seed(cfg.seed + 2)
    head = build_head(model)
    init_weights(head, cfg.num_hidden_layers, cfg.seed + 2)
    head.train()
    opt = optim.AdamW(
        lr_schedule(cfg.mtp_lr, cfg.warmup_steps, cycles, cfg.decay),
        betas=[0.9, 0.95],
        weight_decay=cfg.weight_decay,
    )

    def loss_fn(head, x):
        return mtp_loss(head, model, x, cfg.mtp_distill)

    batches = Batches(train, cfg.seq_len + 1, cfg.mtp_batch_size, cfg.seed + 3)
    with chunked_gdn(cfg.gdn_chunk, model):
        train_s = train_loop(
            cfg,
            work,
            "mtp",
            head,
            loss_fn,
            opt,
            steps,
            batches,
            stop_after,
            [model.state],
        )
    if train_s is None:
        return head, None
    head.eval()
    windows = eval_windows(held, cfg.seq_len + 1, cfg.eval_windows)
    result = {
        "stage": "mtp",
        "steps": steps,
        "train_seconds": round(train_s, 1),
        "params": num_params(head),
        **heldout_mtp(head, model, windows),
    }
    head.save_weights(str(work / "mtp_head.safetensors"))
    log_record(work / "train_mtp.log.jsonl", result)
    (work / "mtp_result.json").write_text(json.dumps(result, indent=2) + "\n")
    return head, result
