"""Training the demo target (mlx-lm's qwen3_next ``Model``); the loop and
checkpoints its MTP head's training (``demo_train_mtp.py``) shares.

The target is mlx-lm's own model class; during training its Gated-DeltaNet
layers run the chunked rule of ``chunked_gdn.py`` (same function, tested
against mlx-lm's recurrent ops) instead of the per-token loop.

Checkpoints are MLX safetensors in the sanitised (mlx-lm) layout, float32:
``target.safetensors`` and ``mtp_head.safetensors`` in the work directory.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from chunked_gdn import chunked_gdn
from demo_config import DemoConfig
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

# Output projections: scaled down at init (residual branches).
_OUT_PROJ = ("o_proj", "out_proj", "down_proj")


def build_target(cfg: DemoConfig, eos_token_id: int):
    from mlx_lm.models.qwen3_next import Model, ModelArgs

    return Model(ModelArgs.from_dict(cfg.hf_config(eos_token_id)))


def init_weights(module: nn.Module, num_layers: int, seed: int) -> None:
    """GPT-style init: N(0, 0.02) matrices, residual outputs / sqrt(2 L); the rest kept."""
    keys = iter(mx.random.split(mx.random.key(seed), 4096))
    out_std = 0.02 / math.sqrt(2 * num_layers)

    def init(path: str, p: mx.array):
        leaf = path.split(".")
        if leaf[-1] != "weight" or p.ndim < 2 or "conv1d" in path:
            return p
        std = out_std if any(n in leaf for n in _OUT_PROJ) else 0.02
        return (std * mx.random.normal(p.shape, key=next(keys))).astype(p.dtype)

    module.update(tree_map_with_path(init, module.parameters()))


def num_params(module: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()))


def lr_schedule(
    peak: float, warmup: int, cycles: Sequence[int], decay: float
) -> Callable:
    """Warmup-stable-decay cycles, one after another, of ``cycles`` steps each.

    A cycle warms up to ``peak``, holds it, then decays linearly to peak/10 over
    its last ``decay`` share. The first warms up from peak/100, a later one from
    where the previous decay ended. A run can be resumed with a longer last
    cycle before its decay starts, or with a new cycle after it ends, so
    training length is open-ended; the steps already taken keep their rates.
    """
    warmup = max(warmup, 1)
    schedules, boundaries, at = [], [], 0
    for i, total in enumerate(c for c in cycles if c > 0):
        decay_steps = max(int(total * decay), 1)
        stable = max(total - decay_steps - warmup, 1)
        start = peak * (0.01 if i == 0 else 0.1)
        for schedule, length in (
            (optim.linear_schedule(start, peak, warmup), warmup),
            (optim.linear_schedule(peak, peak, stable), stable),
            (optim.linear_schedule(peak, peak * 0.1, decay_steps), decay_steps),
        ):
            if schedules:
                boundaries.append(at)
            schedules.append(schedule)
            at += length
    return optim.join_schedules(schedules, boundaries)


class Batches:
    """Random windows of ``length`` tokens from a stream; batch i depends only on (seed, i)."""

    def __init__(self, stream: np.ndarray, length: int, batch: int, seed: int):
        if stream.size <= length:
            stream = np.resize(stream, length + 1)  # tiny corpora: wrap around
        self.stream, self.length, self.batch, self.seed = stream, length, batch, seed

    def at(self, step: int) -> mx.array:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.stream.size - self.length, self.batch)
        rows = np.stack([self.stream[s : s + self.length] for s in starts])
        return mx.array(rows.astype(np.int32))


def eval_windows(stream: np.ndarray, length: int, limit: Optional[int]) -> list:
    """Non-overlapping held-out windows of ``length`` tokens (the last may be shorter)."""
    out = []
    for s in range(0, max(stream.size - 1, 1), length - 1):
        w = stream[s : s + length]
        if w.size >= 2:
            out.append(mx.array(w.astype(np.int32))[None])
        if limit is not None and len(out) >= limit:
            break
    return out


def target_loss(model, x: mx.array) -> mx.array:
    logits = model(x[:, :-1]).astype(mx.float32)
    return nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")


def heldout_target_loss(model, windows) -> float:
    """Mean next-token cross-entropy (nats) over every predicted held-out token."""
    total, count = 0.0, 0
    with chunked_gdn():
        for w in windows:
            logits = model(w[:, :-1]).astype(mx.float32)
            ce = nn.losses.cross_entropy(logits, w[:, 1:], reduction="sum")
            total += ce.item()
            count += w.shape[1] - 1
    return total / max(count, 1)


def log_record(log_file: Optional[Path], record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if log_file is not None:
        with open(log_file, "a") as f:
            f.write(line + "\n")


# Fields a resumed run may change: budgets (a warmup-stable-decay run can be
# lengthened before its decay starts, or given a second cycle after it ends),
# logging, and what only export reads.
_RESUMABLE_CHANGES = (
    "target_steps",
    "target_extra_steps",
    "mtp_steps",
    "mtp_extra_steps",
    "ckpt_every",
    "log_every",
    "eval_windows",
    "max_position_embeddings",
    "dtype",
    "compile",
)


def _training_fields(config_json: str) -> dict:
    config = json.loads(config_json)
    return {k: v for k, v in config.items() if k not in _RESUMABLE_CHANGES}


class Checkpoint:
    """``{stage}_ckpt.*`` in the work directory: weights, optimiser state, step.

    Written every ``ckpt_every`` steps (atomically: temp files, then renames),
    so a killed run resumes where it stopped and, batches depending only on
    the step, continues exactly as if never stopped.
    """

    def __init__(self, work: Path, stage: str):
        self.weights = work / f"{stage}_ckpt.safetensors"
        self.opt = work / f"{stage}_ckpt_opt.safetensors"
        self.meta = work / f"{stage}_ckpt.json"

    def save(self, module: nn.Module, opt, meta: dict) -> None:
        tmp = [p.with_suffix(".tmp.safetensors") for p in (self.weights, self.opt)]
        module.save_weights(str(tmp[0]))
        mx.save_safetensors(str(tmp[1]), dict(tree_flatten(opt.state)))
        for t, p in zip(tmp, (self.weights, self.opt)):
            t.replace(p)
        self.meta.write_text(json.dumps(meta) + "\n")

    def restore(self, module: nn.Module, opt, config: str) -> Optional[dict]:
        """The saved meta (step, ...) after loading weights and optimiser state; None if absent."""
        if not self.meta.exists():
            return None
        meta = json.loads(self.meta.read_text())
        if _training_fields(meta["config"]) != _training_fields(config):
            raise ValueError(
                f"{self.meta} was written by another configuration; "
                "remove it or use a new work directory"
            )
        module.load_weights(str(self.weights))
        opt.state = tree_unflatten(list(mx.load(str(self.opt)).items()))
        return meta


def train_loop(
    cfg: DemoConfig,
    work: Path,
    stage: str,
    module,
    loss_fn,
    opt,
    steps,
    batches,
    stop_after=None,
    frozen=(),
):
    """Optimiser steps of ``loss_fn(module, x) -> (loss, metric)`` up to ``steps``.

    Starts from the stage's checkpoint when there is one. Returns the training
    seconds, or None when ``stop_after`` new steps ended it early.
    """
    loss_and_grad = nn.value_and_grad(module, loss_fn)
    state = [module.state, opt.state]

    def step(x):
        (loss, metric), grads = loss_and_grad(module, x)
        grads, norm = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.update(module, grads)
        return loss, metric, norm

    if cfg.compile:
        step = mx.compile(step, inputs=state + list(frozen), outputs=state)
    log_file = work / f"train_{stage}.log.jsonl"
    ckpt = Checkpoint(work, stage)
    meta = ckpt.restore(module, opt, cfg.to_json())
    if meta is None:
        log_file.unlink(missing_ok=True)
        meta = {"config": cfg.to_json(), "step": 0, "smooth": None, "elapsed_s": 0.0}
    log_record(
        log_file,
        {
            "stage": stage,
            "params": num_params(module),
            "steps": steps,
            "from_step": meta["step"],
        },
    )
    t0, first = time.time(), meta["step"]
    elapsed_before = meta["elapsed_s"]
    last = steps if stop_after is None else min(steps, first + stop_after)
    for i in range(first + 1, last + 1):
        loss, metric, norm = step(batches.at(i))
        mx.eval(loss, metric, norm, state)
        smooth = meta["smooth"]
        meta["smooth"] = (
            loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        )
        el = time.time() - t0
        meta.update(step=i, elapsed_s=elapsed_before + el)
        if i % cfg.log_every == 0 or i == steps:
            log_record(
                log_file,
                {
                    "step": i,
                    "loss": round(loss.item(), 4),
                    "metric": round(metric.item(), 4),
                    "smooth": round(meta["smooth"], 4),
                    "grad_norm": round(norm.item(), 3),
                    "lr": float(opt.learning_rate.item()),
                    "elapsed_s": round(meta["elapsed_s"], 1),
                    "tok_per_s": round(
                        (i - first) * batches.batch * (batches.length - 1) / el
                    ),
                },
            )
        if i % cfg.ckpt_every == 0 or i == last:
            ckpt.save(module, opt, meta)
    return meta["elapsed_s"] if last == steps else None


def train_target(cfg: DemoConfig, work: Path, stop_after=None):
    """Train the target from the token streams in ``work``; saves ``target.safetensors``.

    Resumes from the stage's checkpoint when there is one; ``stop_after`` ends
    this run after that many steps (checkpointed) and returns ``(model, None)``.
    """
    work = Path(work)
    corpus = json.loads((work / "corpus.json").read_text())
    train = np.load(work / "train_tokens.npy")
    held = np.load(work / "eval_tokens.npy")
    cycles = (cfg.target_steps, *cfg.target_extra_steps)
    steps = sum(cycles)
    mx.random.seed(cfg.seed)
    model = build_target(cfg, corpus["eos_token_id"])
    init_weights(model, cfg.num_hidden_layers, cfg.seed)
    model.train()
    opt = optim.AdamW(
        lr_schedule(cfg.target_lr, cfg.warmup_steps, cycles, cfg.decay),
        betas=[0.9, 0.95],
        weight_decay=cfg.weight_decay,
    )

    def loss_fn(model, x):
        loss = target_loss(model, x)
        return loss, loss

    batches = Batches(train, cfg.seq_len + 1, cfg.batch_size, cfg.seed + 1)
    with chunked_gdn(cfg.gdn_chunk, model):
        train_s = train_loop(
            cfg, work, "target", model, loss_fn, opt, steps, batches, stop_after
        )
    if train_s is None:
        return model, None
    model.eval()
    windows = eval_windows(held, cfg.seq_len + 1, cfg.eval_windows)
    held_loss = heldout_target_loss(model, windows)
    model.save_weights(str(work / "target.safetensors"))
    result = {
        "stage": "target",
        "steps": steps,
        "train_seconds": round(train_s, 1),
        "tokens_seen": steps * cfg.batch_size * cfg.seq_len,
        "heldout_loss": held_loss,
        "heldout_windows": len(windows),
        "unigram_loss": corpus["unigram_eval_loss"],
        "params": num_params(model),
    }
    log_record(work / "train_target.log.jsonl", result)
    (work / "target_result.json").write_text(json.dumps(result, indent=2) + "\n")
    return model, result


def load_target(cfg: DemoConfig, work: Path):
    corpus = json.loads((Path(work) / "corpus.json").read_text())
    model = build_target(cfg, corpus["eos_token_id"])
    model.load_weights(str(Path(work) / "target.safetensors"))
    model.eval()
    mx.eval(model.parameters())
    return model
