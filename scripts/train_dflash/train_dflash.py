"""Train the bundled demo model's DFlash block drafter on this CPU.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python scripts/train_dflash/train_dflash.py --work /tmp/dflash_work \\
        --out mlx_spec/data/demo_dflash

Stages (``--stages``, default all, in order):

- ``data``: prompts are windows of the demo model's training files (its
  held-out files for the validation set), ending at a random point of the
  file; the demo model itself continues each, batched (greedy, every third
  batch sampled at temperature 0.8; validation: greedy only). The target's
  outputs at ``target_layer_ids`` are recorded by the runtime's own tap
  (``models/dflash/capture.attach_tap``) during that same generation, so
  the features are those the decoder hands the drafter.
- ``train``: a ``DFlashDraftModel`` (the runtime module) on the frozen
  target's embedding and head; many anchors per sequence in one forward
  (``dflash_forward.train_logits``); position-weighted cross-entropy;
  AdamW, cosine schedule; validation acceptance every ``eval_every`` steps,
  the best checkpoint kept; resumable.
- ``export``: the best checkpoint in bf16 with ``config.json`` and
  ``training.json`` into ``--out``.
- ``check``: the exported drafter loaded by ``mlx_spec.load_drafter`` gives
  the training forward's logits (max difference recorded), and greedy
  ``stream_generate(draft="dflash", num_draft_tokens=B-1)`` on held-out code
  prompts: acceptance per block position, into ``training.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "scripts" / "train_demo"), str(REPO)]

from dflash_forward import (  # noqa: E402
    accepted_prefix,
    block_loss,
    cosine_lr,
    position_weights,
    runtime_block_logits,
    train_logits,
)

import mlx_spec  # noqa: E402
from mlx_spec.demo import default_model_path  # noqa: E402
from mlx_spec.models.dflash.config import fit_to_target, parse_config  # noqa: E402
from mlx_spec.models.dflash.model import DFlashDraftModel, target_dims  # noqa: E402
from dflash_setup import Config, load_target, log  # noqa: E402
from dflash_data import load_data, make_data  # noqa: E402

STAGES = ("data", "train", "export", "check")
COMMAND = (
    "python scripts/train_dflash/train_dflash.py --work /tmp/dflash_work "
    "--out mlx_spec/data/demo_dflash"
)


# ------------------------------------------------------------------ training


def build_drafter(cfg: Config, target) -> DFlashDraftModel:
    dims = target_dims(target)
    raw = cfg.drafter_json(dims.num_layers, dims.vocab_size, dims.hidden_size)
    return DFlashDraftModel(fit_to_target(parse_config(raw), dims)).bind(target)


def sample_anchors(tokens: np.ndarray, P: int, B: int, n: int, eos: int, rng):
    """[R, n] anchors in [P, T - B] (generated region; never an EOS token: the
    runtime stops there) and [R, n] validity."""
    T = tokens.shape[1]
    anchors = np.zeros((tokens.shape[0], n), np.int32)
    valid = np.zeros((tokens.shape[0], n), np.float32)
    for r in range(tokens.shape[0]):
        cand = np.arange(P, T - B + 1)
        cand = cand[tokens[r, cand] != eos]
        pick = rng.choice(cand, size=min(n, cand.size), replace=False)
        anchors[r, : pick.size] = np.sort(pick)
        anchors[r, pick.size :] = P
        valid[r, : pick.size] = 1
    return mx.array(anchors), mx.array(valid)


def validate(model, cfg: Config, val) -> dict:
    """Greedy validation: P(first i drafts all equal the target's tokens) per
    block position over every anchor of the held-out continuations."""
    B = cfg.block_size
    total = mx.zeros((B - 1,))
    count = 0
    weights = position_weights(B, cfg.gamma)
    loss_sum = 0.0
    for tokens, feats, P in val:
        anchors = np.arange(P, tokens.shape[1] - B + 1)
        for r in range(tokens.shape[0]):
            keep = anchors[np.array(tokens[r])[anchors] != cfg.mask_token_id]
            a = mx.array(keep[None])
            loss, hits = block_loss(
                model,
                tokens[r : r + 1],
                feats[r : r + 1],
                a,
                weights,
                mx.ones(a.shape),
            )
            total = total + accepted_prefix(hits).sum(axis=(0, 1))
            loss_sum += loss.item() * keep.size
            count += keep.size
    per_pos = (total / count).tolist()
    return {
        "val_loss": round(loss_sum / count, 4),
        "acceptance_per_position": [round(x, 4) for x in per_pos],
        "mean_accepted": round(sum(per_pos), 4),
    }


def train(cfg: Config, work: Path) -> dict:
    target, _ = load_target()
    mx.random.seed(cfg.seed)
    from demo_train import init_weights, num_params

    model = build_drafter(cfg, target)
    init_weights(model, cfg.num_hidden_layers, cfg.seed)
    data, val = load_data(work, "train"), load_data(work, "val")
    ckpt = work / "ckpt"
    ckpt.mkdir(exist_ok=True)
    opt = optim.AdamW(
        cosine_lr(cfg.lr, cfg.warmup, cfg.steps),
        betas=[0.9, 0.95],
        weight_decay=cfg.weight_decay,
    )
    state_file = ckpt / "state.json"
    state = {"step": 0, "best": None, "history": [], "seconds": 0.0}
    if state_file.exists():
        state = json.loads(state_file.read_text())
        model.load_weights(str(ckpt / "last.safetensors"))
        opt.init(model.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(ckpt / "opt.safetensors")).items()))
        log(f"resumed at step {state['step']}")
    weights = position_weights(cfg.block_size, cfg.gamma)
    rng = np.random.default_rng(cfg.seed + 1 + state["step"])
    np_tokens = [np.array(t) for t, _, _ in data]

    def loss_fn(m, tokens, feats, anchors, valid):
        return block_loss(m, tokens, feats, anchors, weights, valid)[0]

    step_fn = nn.value_and_grad(model, loss_fn)
    t0, window = time.time() - state["seconds"], []
    while state["step"] < cfg.steps:
        i = int(rng.integers(len(data)))
        tokens, feats, P = data[i]
        rows = np.sort(rng.choice(tokens.shape[0], cfg.rows, replace=False))
        anchors, valid = sample_anchors(
            np_tokens[i][rows], P, cfg.block_size, cfg.anchors, cfg.mask_token_id, rng
        )
        r = mx.array(rows)
        loss, grads = step_fn(model, tokens[r], feats[r], anchors, valid)
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        state["step"] += 1
        window.append(loss.item())
        if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps:
            model.eval()
            v = validate(model, cfg, val)
            state["seconds"] = round(time.time() - t0, 1)
            rec = {
                "step": state["step"],
                "train_loss": round(float(np.mean(window)), 4),
                "lr": round(float(opt.learning_rate), 6),
                "seconds": state["seconds"],
                **v,
            }
            window = []
            state["history"].append(rec)
            log(json.dumps(rec))
            model.save_weights(str(ckpt / "last.safetensors"))
            mx.save_safetensors(
                str(ckpt / "opt.safetensors"), dict(tree_flatten(opt.state))
            )
            if (
                state["best"] is None
                or v["mean_accepted"] > state["best"]["mean_accepted"]
            ):
                state["best"] = rec
                model.save_weights(str(ckpt / "best.safetensors"))
            state_file.write_text(json.dumps(state, indent=1))
    return {
        "steps": state["step"],
        "seconds": state["seconds"],
        "params": num_params(model),
        "best": state["best"],
        "history": state["history"],
    }


# ------------------------------------------------------------------ export


def export(cfg: Config, work: Path, out: Path, results: dict) -> dict:
    target, _ = load_target()
    model = build_drafter(cfg, target)
    model.load_weights(str(work / "ckpt" / "best.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    dims = target_dims(target)
    raw = cfg.drafter_json(dims.num_layers, dims.vocab_size, dims.hidden_size)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    params = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), params, {"format": "mlx"})
    return {"bytes": (out / "model.safetensors").stat().st_size}


def check(cfg: Config, work: Path, out: Path, prompts_n: int, max_tokens: int):
    """The exported files through the runtime: the same logits as the
    training forward, then greedy acceptance on held-out code prompts."""
    from evaluate import code_prompts, heldout_texts

    target, tok = load_target()
    runtime = mlx_spec.load_drafter(out, target)
    tokens, feats, P = load_data(work, "val")[0]
    last = tokens.shape[1] - cfg.block_size
    anchors = mx.array([[P, (P + last) // 2, last]])
    trained = train_logits(runtime, tokens[:1], feats[:1], anchors)
    diff = 0.0
    for j, a in enumerate(anchors[0].tolist()):
        ref = runtime_block_logits(runtime, tokens[:1], feats[:1], a)
        diff = max(diff, mx.abs(trained[0, j] - ref[0]).max().item())
    log(f"training forward vs runtime: max |logit diff| {diff:.2e}")
    if diff > 1e-2:
        raise SystemExit(f"the training forward differs from the runtime ({diff})")
    training = json.loads((default_model_path() / "training.json").read_text())
    _, held = heldout_texts(training)
    prompts_ = code_prompts(held, tok, prompts_n, 320)
    run = acceptance(target, tok, prompts_, runtime, cfg.block_size - 1, max_tokens)
    log(json.dumps(run))
    return {"runtime_logit_max_diff": diff, "heldout_greedy": run}


def acceptance(target, tok, prompts_, drafter, k: int, max_tokens: int) -> dict:
    """Greedy ``draft="dflash"`` generation over ``prompts_``: the stats the
    decoder records (per block position: passes whose first i drafts were
    all accepted, over passes that drafted i)."""
    stats = mlx_spec.SpecStats()
    for prompt in prompts_:
        for _ in mlx_spec.stream_generate(
            target,
            tok,
            prompt,
            max_tokens=max_tokens,
            draft="dflash",
            draft_model=drafter,
            num_draft_tokens=k,
            stats=stats,
        ):
            pass
    return {
        "prompts": len(prompts_),
        "max_tokens": max_tokens,
        "num_draft_tokens": k,
        "verify_passes": stats.verify_passes,
        "generated": stats.generated,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_per_position": [round(x, 3) for x in stats.acceptance_per_position],
        "tokens_per_pass": round(stats.tokens_per_pass, 3),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON")
    p.add_argument("--check-prompts", type=int, default=16)
    p.add_argument("--check-tokens", type=int, default=64)
    args = p.parse_args(argv)
    overrides = {}
    for text in args.set:
        k, _, v = text.partition("=")
        overrides[k] = json.loads(v)
    cfg = Config(**overrides)
    args.work.mkdir(parents=True, exist_ok=True)
    results_file = args.work / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    for stage in [s for s in args.stages.split(",") if s]:
        log(f"stage {stage}")
        if stage == "data":
            results["data"] = make_data(cfg, args.work)
        elif stage == "train":
            results["train"] = train(cfg, args.work)
        elif stage == "export":
            results["export"] = export(cfg, args.work, args.out, results)
        elif stage == "check":
            results["check"] = check(
                cfg, args.work, args.out, args.check_prompts, args.check_tokens
            )
        else:
            raise SystemExit(f"unknown stage {stage!r}; stages: {STAGES}")
        results_file.write_text(json.dumps(results, indent=1) + "\n")
    if args.out.exists() and "export" in results:
        record = {"config": asdict(cfg), "command": COMMAND, **results}
        (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
