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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List

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
from mlx_spec.models.dflash.capture import attach_tap, detach_tap  # noqa: E402
from mlx_spec.models.dflash.config import fit_to_target, parse_config  # noqa: E402
from mlx_spec.models.dflash.model import DFlashDraftModel, target_dims  # noqa: E402

STAGES = ("data", "train", "export", "check")
COMMAND = (
    "python scripts/train_dflash/train_dflash.py --work /tmp/dflash_work "
    "--out mlx_spec/data/demo_dflash"
)


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


# ------------------------------------------------------------------ data


def corpus_texts():
    """(training texts, held-out texts) of the demo model's corpus."""
    from demo_data import build_corpus

    training = json.loads((default_model_path() / "training.json").read_text())
    c = training["corpus"]
    corpus = build_corpus(c["seed"], training["config"]["holdout"])
    if corpus.file_list_sha256 != c["file_list_sha256"]:
        log("warning: this stdlib is not the demo model's corpus; data will differ")
    train = [corpus.texts[n] for n in c["train_files"] if n in corpus.texts]
    held = [corpus.texts[n] for n in c["eval_files"] if n in corpus.texts]
    return train, held


def prompts(files: List[np.ndarray], n: int, length: int, rng) -> np.ndarray:
    """[n, length]: windows ending at a random point of random files."""
    long = [f for f in files if f.size > length + 1]
    out = []
    for i in rng.integers(0, len(long), size=n):
        f = long[i]
        end = int(rng.integers(length, f.size))
        out.append(f[end - length : end])
    return np.stack(out).astype(np.int32)


def generate(model, tap, prompt: np.ndarray, n: int, temperature: float, key):
    """The target's continuation of ``prompt`` [B, P] by ``n`` tokens, and the
    tapped features of positions 0..P+n-2 (everything fed)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array(prompt)
    tokens, feats = [x], []
    for i in range(n):
        tap.begin()
        logits = model(x, cache=cache)[:, -1].astype(mx.float32)
        feats.append(tap.take())
        if temperature > 0:
            key, sub = mx.random.split(key)
            x = mx.random.categorical(logits / temperature, key=sub)[:, None]
        else:
            x = mx.argmax(logits, axis=-1)[:, None]
        tokens.append(x.astype(mx.int32))
        mx.eval(x, feats[-1])
    return (
        np.array(mx.concatenate(tokens, axis=1)),
        np.array(mx.concatenate(feats, axis=1).astype(mx.float32)),
    )


def make_data(cfg: Config, work: Path) -> dict:
    from tokenizers import Tokenizer

    model, _ = load_target()
    tok = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    train_texts, held_texts = corpus_texts()

    def encode(texts):
        return [np.array(e.ids) for e in tok.encode_batch(texts)]

    train_files, held_files = encode(train_texts), encode(held_texts)
    tap = attach_tap(model, cfg.target_layer_ids, on_demand=True)
    rng = np.random.default_rng(cfg.seed)
    key = mx.random.key(cfg.seed)
    (work / "data").mkdir(parents=True, exist_ok=True)
    jobs = [("val", held_files, cfg.val_batch_size, 0.0, 64)]
    for b in range(cfg.gen_batches):
        temp = cfg.temperature if b % cfg.sample_every == cfg.sample_every - 1 else 0
        P = cfg.prompt_lengths[b % len(cfg.prompt_lengths)]
        jobs.append((f"train{b:03d}", train_files, cfg.gen_batch_size, temp, P))
    t0 = time.time()
    for name, files, size, temp, P in jobs:
        key, sub = mx.random.split(key)
        p = prompts(files, size, P, rng)  # drawn whether or not kept: resumable
        out = work / "data" / f"{name}.npz"
        if out.exists():
            continue
        tokens, feats = generate(model, tap, p, cfg.gen_tokens, temp, sub)
        np.savez(out, tokens=tokens, features=feats, prompt_len=P, temperature=temp)
        log(f"data {name}: {tokens.shape} T={temp} ({time.time() - t0:.0f}s)")
    detach_tap(model)
    return {
        "seconds": round(time.time() - t0, 1),
        "train_sequences": cfg.gen_batches * cfg.gen_batch_size,
        "val_sequences": cfg.val_batch_size,
        "generated_tokens_train": cfg.gen_batches * cfg.gen_batch_size * cfg.gen_tokens,
    }


def load_data(work: Path, prefix: str):
    out = []
    for f in sorted((work / "data").glob(f"{prefix}*.npz")):
        d = np.load(f)
        out.append(
            (
                mx.array(d["tokens"].astype(np.int32)),
                mx.array(d["features"]),
                int(d["prompt_len"]),
            )
        )
    return out


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
