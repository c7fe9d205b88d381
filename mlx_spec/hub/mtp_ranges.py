"""Where a checkpoint's MTP tensors are, in bytes: the format side of
``convert --mtp-from`` (the downloads are :mod:`mlx_spec.hub.mtp_fetch`).

A safetensors file is 8 bytes of little-endian header length ``N``, ``N``
bytes of JSON (tensor name -> dtype, shape, ``data_offsets`` relative to byte
``8 + N``), then the data. From a repo's ``model.safetensors.index.json`` and
each shard's header this module chooses the shards and byte ranges of the
tensors under an MTP prefix, checks every range against its tensor's dtype,
shape and the file size, and builds the header of the small file that holds
only those tensors. It opens no connection and writes nothing (it reads only
the index file it is given): its functions take bytes and return values, or
raise :class:`HubError` naming the file and the bad entry.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

from .resolve import HubError
from ..models.mtp.layouts import MTP_PREFIXES

INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD = "model.safetensors"
MAX_HEADER = 100 << 20  # the safetensors library's own bound
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}


def is_mtp_tensor(name: str) -> bool:
    return name.startswith(MTP_PREFIXES)


@dataclass
class TensorBytes:
    """One tensor of a shard header and where its data lies in the shard."""

    name: str
    dtype: str
    shape: List[int]
    start: int  # absolute offset in the shard
    end: int


def index_shards(index: Path) -> List[str]:
    """The shard file names that a safetensors index maps MTP tensors to."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = {f for n, f in weight_map.items() if is_mtp_tensor(n)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise HubError(f"{index} is not a valid safetensors index ({e})") from None
    for shard in shards:
        if not isinstance(shard, str) or "/" in shard or shard.startswith("."):
            raise HubError(f"{index}: shard name {shard!r} is not a plain file name")
    return sorted(shards)


def header_length(name: str, prefix: bytes, size: int) -> int:
    """The header length that a shard's first 8 bytes give, checked to be
    bounded and inside the ``size``-byte file."""
    length = int.from_bytes(prefix, "little")
    if not 0 < length <= MAX_HEADER or 8 + length > size:
        raise HubError(f"{name}: header length {length} is not valid")
    return length


def parse_header(name: str, raw: bytes, size: int) -> Tuple[dict, List[TensorBytes]]:
    """The metadata and tensors of a safetensors header, each tensor's byte
    range checked against its dtype, its shape and the file size."""
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise HubError(f"{name}: the safetensors header is not valid ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    base = 8 + len(raw)
    tensors = []
    for tensor, info in header.items():
        try:
            dtype, shape = info["dtype"], [int(d) for d in info["shape"]]
            a, b = (int(x) for x in info["data_offsets"])
            width = _DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise HubError(
                f"{name}: tensor {tensor!r} has a bad header entry"
            ) from None
        if b - a != width * math.prod(shape) or a < 0 or base + b > size:
            raise HubError(
                f"{name}: tensor {tensor!r} has data_offsets {[a, b]} that do not "
                f"fit its dtype {dtype} and shape {shape} in a {size}-byte file"
            )
        tensors.append(TensorBytes(tensor, dtype, shape, base + a, base + b))
    return meta, tensors


def mtp_tensors(tensors: List[TensorBytes]) -> List[TensorBytes]:
    """The MTP tensors among ``tensors``, in the order of their bytes."""
    return sorted((t for t in tensors if is_mtp_tensor(t.name)), key=lambda t: t.start)


def small_header(
    meta: dict, wanted: List[TensorBytes], source: str, etag: str
) -> bytes:
    """The header of the file holding only ``wanted`` (in this order), their
    data packed one after the other; ``source`` and ``etag`` say where the
    bytes came from."""
    entries, offset = {}, 0
    for t in wanted:
        size = t.end - t.start
        entries[t.name] = {
            "dtype": t.dtype,
            "shape": t.shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    metadata = {str(k): str(v) for k, v in meta.items()}
    metadata.update({"mlx_spec.fetched_from": source, "mlx_spec.source_etag": etag})
    text = json.dumps({"__metadata__": metadata, **entries}).encode()
    text += b" " * (-len(text) % 8)  # aligned tensor data, as safetensors writes
    return len(text).to_bytes(8, "little") + text


def byte_runs(wanted: List[TensorBytes]) -> List[Tuple[int, int]]:
    """Byte ranges covering ``wanted`` (sorted by offset), adjacent ones joined."""
    runs: List[Tuple[int, int]] = []
    for t in wanted:
        if runs and runs[-1][1] == t.start:
            runs[-1] = (runs[-1][0], t.end)
        else:
            runs.append((t.start, t.end))
    return runs
