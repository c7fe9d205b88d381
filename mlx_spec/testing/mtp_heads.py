"""Tiny checkpoints whose MTP head predicts its target well (tests, benchmarks).

A random tiny model's MTP head almost never agrees with its target, so no
draft is ever accepted and rollback paths go untested.
:func:`write_predictive_checkpoint` edits a :func:`write_tiny_checkpoint`
checkpoint (raw layout, zero-centred norms) so that:

- the target is close to a bigram model: every layer's output projection
  (attention ``o_proj``, GDN ``out_proj``, MLP / expert ``down_proj``) is
  scaled by ``target_scale``, so the hidden state at p+1 is dominated by
  ``norm(embed(token_{p+1}))`` but still depends on the context;
- the MTP head computes about the same thing from ``(token_{p+1}, h_p)``:
  ``fc = [I | 0]`` keeps the normalised embedding, the MTP layer's outputs
  are scaled by ``mtp_scale`` and ``mtp.norm`` is the target's final norm.

So drafts are accepted often but not always, exercising partial acceptance.

:func:`write_cycle_checkpoint` makes the bigram a single cycle through the
tokenizer's tokens (``lm_head[next(t)] = embed[t]``, untied): greedy text from
token t is t, next(t), next(next(t)), ... So a prompt that holds a stretch of
the cycle makes the target copy it (n-gram territory), while text past the
prompt is novel (MTP territory); ``mtp_scale`` sets how good the head is.
"""

import pathlib
from typing import Optional, Union

import numpy as np
from safetensors.numpy import load_file, save_file

from ..drafters.mtp_rows import HeadRows
from .checkpoints import EOS_TOKEN_ID, write_tiny_checkpoint

_OUTPUT_PROJS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")
# Per family, a target_scale that gives partial acceptance (measured: about
# 20-50% at draft position 1 with k = 4). The tied dense family needs more
# context dependence, or its bigram argmax is the input token itself.
DEFAULT_TARGET_SCALE = {"qwen3_next": 0.04, "qwen3_5": 0.3, "qwen3_5_moe": 0.04}


def write_predictive_checkpoint(
    path: Union[str, pathlib.Path],
    family: str,
    *,
    seed: int = 0,
    target_scale: Optional[float] = None,
    mtp_scale: float = 0.1,
    mtp_noise: float = 0.0,
    **overrides,
) -> pathlib.Path:
    """Write a float32 tiny checkpoint of ``family`` with a well-predicting MTP head.

    ``mtp_noise`` > 0 mixes that much of a random projection of h_p into the
    head's input, making it a worse predictor.
    """
    if target_scale is None:
        target_scale = DEFAULT_TARGET_SCALE[family]
    out = write_tiny_checkpoint(path, family, seed=seed, dtype="float32", **overrides)
    file = out / "model.safetensors"
    w = load_file(str(file))
    for name in list(w):
        if name.endswith(_OUTPUT_PROJS):
            scale = mtp_scale if name.startswith("mtp.") else target_scale
            w[name] = (w[name] * scale).astype(np.float32)
    H = w["mtp.fc.weight"].shape[0]
    fc = np.zeros((H, 2 * H), np.float32)
    fc[:, :H] = np.eye(H, dtype=np.float32)
    rng = np.random.default_rng([seed, 11])
    fc[:, H:] = rng.standard_normal((H, H)) * (mtp_noise / np.sqrt(H))
    w["mtp.fc.weight"] = fc
    w["mtp.pre_fc_norm_embedding.weight"] = np.zeros(H, np.float32)
    final_norm = next(n for n in w if n.endswith("model.norm.weight"))
    w["mtp.norm.weight"] = w[final_norm].copy()
    save_file(w, str(file), metadata={"format": "pt"})
    return out


def cycle_order(seed: int = 0) -> list:
    """The token cycle of :func:`write_cycle_checkpoint` (all ids but EOS)."""
    return [int(t) for t in np.random.default_rng([seed, 7]).permutation(EOS_TOKEN_ID)]


def write_cycle_checkpoint(
    path: Union[str, pathlib.Path],
    family: str,
    *,
    seed: int = 0,
    target_scale: float = 0.01,
    mtp_scale: float = 0.1,
    mtp_noise: float = 0.0,
) -> pathlib.Path:
    """A predictive checkpoint whose greedy text follows :func:`cycle_order`."""
    out = write_predictive_checkpoint(
        path,
        family,
        seed=seed,
        target_scale=target_scale,
        mtp_scale=mtp_scale,
        mtp_noise=mtp_noise,
        tie_word_embeddings=False,
    )
    file = out / "model.safetensors"
    w = load_file(str(file))
    embed = next(w[n] for n in w if n.endswith("embed_tokens.weight"))
    head = w["lm_head.weight"] * 0.1  # other rows (EOS, padding) never win
    order = cycle_order(seed)
    for a, b in zip(order, order[1:] + order[:1]):
        head[b] = embed[a]
    w["lm_head.weight"] = head.astype(np.float32)
    save_file(w, str(file), metadata={"format": "pt"})
    return out


def sidecar_metadata(model_dir) -> dict:
    """The safetensors metadata of ``model_dir``'s ``mtp.safetensors``."""
    from safetensors import safe_open

    with safe_open(
        str(pathlib.Path(model_dir) / "mtp.safetensors"), framework="numpy"
    ) as f:
        return f.metadata()


def count_head_rows(monkeypatch) -> list:
    """The list that records, from now on, how many rows each head forward
    over verified rows (``HeadRows.run``) runs."""
    calls, rows = [], HeadRows.run
    monkeypatch.setattr(
        HeadRows,
        "run",
        lambda r, t, *a, **k: calls.append(t.size) or rows(r, t, *a, **k),
    )
    return calls
