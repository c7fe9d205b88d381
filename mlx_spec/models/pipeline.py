"""A target split across processes with MLX's distributed engine.

``mlx.launch`` starts one process per rank; each loads the checkpoint lazily
and keeps only its own range of layers (mlx-lm's ``pipeline``: rank 0 holds
the last layers, the final norm and the output head), so a model larger than
one machine's memory fits on several. A forward passes the hidden state from
rank to rank and ends with every rank holding the final hidden state (and so
the logits).

Speculation runs in lock-step on every rank: the same history gives every
rank the same drafts (n-gram lookup, or the MTP head, one layer that every
rank holds), the same verify pass gives every rank the same logits, so every
rank accepts the same prefix and rolls its own layers back to it; nothing but
the pipeline's own hidden states crosses the network. Sampling draws from a
seed shared by all ranks (:func:`shared_seed`), so its random choices agree
too.
"""

from typing import Optional

import mlx.core as mx


def split_model(model, group) -> None:
    """Keep only this rank's layers of ``model`` (in place); ``ValueError``
    for a model mlx-lm cannot split into a pipeline."""
    inner = getattr(getattr(model, "language_model", model), "model", None)
    if not hasattr(inner, "pipeline"):
        kind = getattr(model, "model_type", type(model).__name__)
        raise ValueError(f"model type {kind!r} cannot be split into a pipeline")
    inner.pipeline(group)


def shared_seed(group, seed: Optional[int]) -> int:
    """A seed every rank agrees on: ``seed``, or rank 0's random choice."""
    mine = seed if seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item())
    if group is None or group.size() == 1:
        return mine
    mine = mine if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array(mine), group=group).item())
