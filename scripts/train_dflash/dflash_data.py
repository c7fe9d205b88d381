"""The ``data`` stage of the demo drafter's training: the demo model
continues windows of its own training files (its held-out files for the
validation set), batched, while the runtime's tap records the target
features the drafter will read (see ``train_dflash.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List

import mlx.core as mx
import numpy as np

from dflash_setup import Config, load_target, log
from mlx_spec.demo import default_model_path
from mlx_spec.models.dflash.capture import attach_tap, detach_tap


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
