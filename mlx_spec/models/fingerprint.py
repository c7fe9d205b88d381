"""Which model is this, roughly? A weight signature for MTP sidecars, and
the tokenizer's fingerprint (the exact identity of a model's weights is
:mod:`.identity`'s).

- a **weight signature**: a few fixed rows of the embedding and of the output
  head (the weights an MTP head shares with its target), dequantised to
  float32 and cut to their first columns. An MTP sidecar records it; a
  loader compares it with the model's by cosine similarity, so a sidecar
  written for one conversion of a checkpoint fits another conversion of the
  same weights (quantisation moves the rows little) but never another model
  with the same config (unrelated rows are close to orthogonal).
- a **tokenizer fingerprint**: a hash of its vocabulary.
"""

import hashlib
import json
from typing import List

import mlx.core as mx
import numpy as np

SIGNATURE_ROWS = 8
SIGNATURE_COLUMNS = 32
# Rows of unrelated models have cosine ~ N(0, 1 / sqrt(rows * columns)) ~ 0.06.
SAME_WEIGHTS_COSINE = 0.9


def weight_signature(model) -> np.ndarray:
    """[2, SIGNATURE_ROWS * SIGNATURE_COLUMNS] float32: embedding rows, head rows."""
    lm = getattr(model, "language_model", model)  # the text model
    embed = lm.model.embed_tokens
    vocab = embed.weight.shape[0]
    ids = mx.array([(i * vocab) // SIGNATURE_ROWS for i in range(SIGNATURE_ROWS)])
    columns = min(SIGNATURE_COLUMNS, lm.args.hidden_size)
    rows = embed(ids)[:, :columns]  # dequantised by the layer itself
    # The head's row v, column j is logits(e_j)[v]: the same call for a
    # Linear, a QuantizedLinear or a tied embedding.
    basis = mx.eye(lm.args.hidden_size)[:columns]
    if getattr(lm.args, "tie_word_embeddings", False):
        head = embed.as_linear(basis)
    else:
        head = lm.lm_head(basis)
    head_rows = head[:, ids].T  # [rows, columns]
    parts = [
        rows.astype(mx.float32).reshape(-1),
        head_rows.astype(mx.float32).reshape(-1),
    ]
    return np.stack([np.array(p) for p in parts])


def signature_to_text(signature: np.ndarray) -> str:
    """Compact JSON (4 significant digits: plenty for a cosine test)."""
    return json.dumps([[float(f"{x:.4g}") for x in row] for row in signature.tolist()])


def signature_from_text(text: str) -> np.ndarray:
    """Inverse of :func:`signature_to_text`; ``ValueError`` if malformed."""
    rows: List[List[float]] = json.loads(text)
    signature = np.array(rows, dtype=np.float32)
    if signature.ndim != 2 or signature.shape[0] != 2:
        raise ValueError("a weight signature holds two rows")
    return signature


def same_weights(a: np.ndarray, b: np.ndarray) -> bool:
    """True when both signatures come from the same weights (up to quantisation)."""
    if a.shape != b.shape:
        return False
    for x, y in zip(a, b):
        norm = float(np.linalg.norm(x) * np.linalg.norm(y))
        if norm == 0 or float(np.dot(x, y)) / norm < SAME_WEIGHTS_COSINE:
            return False
    return True


def tokenizer_fingerprint(tokenizer) -> str:
    """A short exact hash of ``tokenizer``'s vocabulary (token to id)."""
    vocab = tokenizer.get_vocab()
    items = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]
