"""Checkpoints laid out as repos on the hub publish them, for the fake hub.

:func:`write_sharded_release` writes a tiny raw checkpoint split into
``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``,
the ``mtp.*`` tensors in the last shard next to trunk tensors, as the Qwen
releases ship them.
"""

import json
from pathlib import Path
from typing import Dict, List, Union

from safetensors.numpy import load_file, save_file

from .checkpoints import write_tiny_checkpoint

INDEX_NAME = "model.safetensors.index.json"


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def write_sharded_release(
    path: Union[str, Path], family: str, shards: int = 2, seed: int = 0, **overrides
) -> Path:
    """A float32 tiny checkpoint of ``family`` in ``shards`` shards (>= 2);
    the MTP tensors share the last shard with trunk tensors."""
    if shards < 2:
        raise ValueError(f"shards must be >= 2, got {shards}")
    out = write_tiny_checkpoint(path, family, seed=seed, **overrides)
    single = out / "model.safetensors"
    tensors = load_file(str(single))
    trunk = [n for n in tensors if not n.startswith("mtp.")]
    mtp = [n for n in tensors if n.startswith("mtp.")]
    groups: List[List[str]] = [[] for _ in range(shards)]
    per = -(-len(trunk) // shards)
    for i, name in enumerate(trunk):
        groups[min(i // per, shards - 1)].append(name)
    groups[-1].extend(mtp)
    weight_map: Dict[str, str] = {}
    for i, names in enumerate(groups, start=1):
        name = shard_name(i, shards)
        save_file({n: tensors[n] for n in names}, str(out / name), {"format": "pt"})
        weight_map.update({n: name for n in names})
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    single.unlink()
    return out
