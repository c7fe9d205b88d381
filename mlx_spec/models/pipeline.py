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
    return from_rank0(group, mine)


def broadcast_bytes(group, data: Optional[bytes]) -> bytes:
    """Rank 0's ``data`` on every rank (the others pass None)."""
    mine = data if group.rank() == 0 else b""
    size = int(mx.distributed.all_sum(mx.array(len(mine)), group=group).item())
    buffer = mx.array(list(mine), mx.uint8) if mine else mx.zeros((size,), mx.uint8)
    return bytes(mx.distributed.all_sum(buffer, group=group).tolist())


def broadcast_text(group, text: Optional[str]) -> Optional[str]:
    """Rank 0's ``text`` on every rank (None stays None: the end of input)."""
    data = None
    if group.rank() == 0:
        data = b"\0" if text is None else b"\1" + text.encode()
    data = broadcast_bytes(group, data)
    return None if data[:1] == b"\0" else data[1:].decode()


def pipeline_group(model):
    """The distributed group ``model`` is split over (None: one process)."""
    inner = getattr(getattr(model, "language_model", model), "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        return mx.distributed.init()
    return None


def from_rank0(group, value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    mine = value if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array(mine), group=group).item())
