"""Fetching only the MTP tensors of a checkpoint on the Hugging Face hub.

A raw release keeps its MTP head (under 1 GB) in one or two of its shards
(tens to hundreds of GB in all). :func:`fetch_mtp_checkpoint` reads the
repo's ``config.json`` and ``model.safetensors.index.json`` (through the
Hugging Face cache), then for each shard whose tensors the index maps to an
MTP prefix, HTTP range reads of

1. the shard's safetensors header (8 bytes of length, then the JSON), and
2. exactly the byte ranges of its MTP tensors (adjacent ones in one request),

and writes them as a small safetensors file of the same name. The result is
a directory that looks like the checkpoint with only its MTP tensors, which
the ordinary MTP loaders read (see ``docs/models.md``).

Checked against the shard header: every tensor's byte length must match its
dtype and shape and lie inside the shard, and every ``206`` answer must carry
the ``Content-Range`` asked for. A server that ignores ``Range`` (answers
``200``) gets the whole shard downloaded into the Hugging Face cache instead.

Resumable: a shard is built in ``<shard>.part`` (its final header first,
then the tensors' bytes in order), so a run that was interrupted continues
from the bytes already on disk; the file gets its final name only once it is
complete and its header parses. A different ETag (the shard changed on the
hub) starts the shard again.
"""

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .hub import HubError, hub_errors
from .models.mtp.layouts import MTP_PREFIXES

INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD = "model.safetensors"
_MAX_HEADER = 100 << 20  # the safetensors library's own bound
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
class FetchResult:
    """What :func:`fetch_mtp_checkpoint` did."""

    repo: str
    commit: str
    directory: Path  # config.json, the index, one small file per MTP shard
    shards: List[str] = field(default_factory=list)
    bytes_fetched: int = 0  # over the network in this run
    shard_bytes: int = 0  # the full size of the shards that hold MTP tensors
    whole_shards: List[str] = field(default_factory=list)  # ranges refused


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: List[int]
    start: int  # absolute offset in the shard
    end: int


def cache_dir(repo: str, commit: str) -> Path:
    """Where the fetched MTP tensors of ``repo`` at ``commit`` are kept."""
    from huggingface_hub import constants

    folder = "models--" + repo.replace("/", "--")
    return Path(constants.HF_HOME) / "mlx_spec" / "mtp" / folder / commit


def fetch_mtp_checkpoint(
    repo: str,
    revision: Optional[str] = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> FetchResult:
    """Fetch the MTP tensors of hub repo ``repo`` (see the module docstring)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    with hub_errors(repo, revision, "--mtp-from"):
        config = Path(hf_hub_download(repo, "config.json", revision=revision))
        commit = config.parent.name  # the cache's snapshots/<commit>/config.json
        try:
            index = Path(hf_hub_download(repo, INDEX_NAME, revision=commit))
            shards = _index_shards(index)
        except EntryNotFoundError:
            shards = [SINGLE_SHARD]  # one file: its header says what is MTP
        out = cache_dir(repo, commit)
        out.mkdir(parents=True, exist_ok=True)
        result = FetchResult(repo, commit, out)
        weight_map: Dict[str, str] = {}
        for shard in shards:
            names, fetched, size, whole = _fetch_shard(
                repo, commit, shard, out, progress, log
            )
            if names:
                result.shards.append(shard)
                result.shard_bytes += size
            result.bytes_fetched += fetched
            if whole:
                result.whole_shards.append(shard)
            weight_map.update({n: shard for n in names})
    if not weight_map:
        raise HubError(
            f"--mtp-from {repo!r}: the checkpoint has no MTP tensors (no "
            f"{', '.join(MTP_PREFIXES)} names in {INDEX_NAME} or {SINGLE_SHARD})"
        )
    shutil.copyfile(config, out / "config.json")
    index_text = json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    (out / INDEX_NAME).write_text(index_text + "\n")
    return result


def _index_shards(index: Path) -> List[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = {f for n, f in weight_map.items() if is_mtp_tensor(n)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise HubError(f"{index} is not a valid safetensors index ({e})") from None
    for shard in shards:
        if not isinstance(shard, str) or "/" in shard or shard.startswith("."):
            raise HubError(f"{index}: shard name {shard!r} is not a plain file name")
    return sorted(shards)


# ----------------------------------------------------------------- one shard


class _Remote:
    """Range reads of one file of a repo, counting the bytes received."""

    def __init__(self, repo: str, commit: str, filename: str):
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session

        self.name = f"{repo}/{filename}"
        self.url = hf_hub_url(repo, filename, revision=commit)
        self.headers = build_hf_headers()
        self.headers["Accept-Encoding"] = "identity"  # byte offsets of the file
        self.session = get_session()
        self.size: Optional[int] = None
        self.etag = ""
        self.received = 0

    def read(self, start: int, end: int, sink=None) -> Optional[bytes]:
        """Bytes ``[start, end)``: returned, or written to ``sink`` (a file,
        with ``sink.progress(n)``). None when the server ignores ``Range``."""
        from huggingface_hub.utils import hf_raise_for_status

        headers = {**self.headers, "Range": f"bytes={start}-{end - 1}"}
        chunks, got = [], 0
        try:
            with self.session.stream("GET", self.url, headers=headers) as response:
                hf_raise_for_status(response)
                if response.status_code == 200:
                    return None  # closed unread: the whole file is not wanted
                self._check_range(response, start, end)
                self.etag = self.etag or _etag(response)
                # unbuffered: every byte received before a drop is kept
                for chunk in response.iter_bytes():
                    got += len(chunk)
                    self.received += len(chunk)
                    if got > end - start:
                        raise HubError(f"{self.name}: the server sent more than asked")
                    if sink is None:
                        chunks.append(chunk)
                    else:
                        sink.write(chunk)
                        sink.progress(len(chunk))
        except HubError:
            raise
        except OSError:
            raise  # the local file (disk full, ...): not the connection
        except Exception as e:  # the HTTP client's errors: connection lost, ...
            raise HubError(
                f"{self.name}: connection lost after {got} of bytes "
                f"{start}-{end - 1} ({type(e).__name__}); run the command again "
                "to resume"
            ) from None
        if got != end - start:
            raise HubError(
                f"{self.name}: got {got} of bytes {start}-{end - 1}; run the "
                "command again to resume"
            )
        return b"".join(chunks) if sink is None else b""

    def _check_range(self, response, start: int, end: int):
        text = response.headers.get("Content-Range", "")
        try:
            unit, rest = text.split(" ", 1)
            span, total = rest.split("/", 1)
            first, last = (int(x) for x in span.split("-", 1))
            total = int(total)
        except ValueError:
            raise HubError(
                f"{self.name}: 206 answer without a valid Content-Range ({text!r})"
            ) from None
        if unit != "bytes" or (first, last + 1) != (start, end):
            raise HubError(
                f"{self.name}: asked for bytes {start}-{end - 1}, got {text!r}"
            )
        if self.size is not None and total != self.size:
            raise HubError(f"{self.name}: the file changed size during the fetch")
        self.size = total


def _etag(response) -> str:
    tag = response.headers.get("X-Linked-Etag") or response.headers.get("ETag") or ""
    return tag.strip().removeprefix("W/").strip('"')


def _parse_header(name: str, raw: bytes, size: int) -> Tuple[dict, List[_Tensor]]:
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
        tensors.append(_Tensor(tensor, dtype, shape, base + a, base + b))
    return meta, tensors


def _small_header(meta: dict, wanted: List[_Tensor], source: str, etag: str) -> bytes:
    """The header of the file holding only ``wanted`` (in this order)."""
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


def _runs(wanted: List[_Tensor]) -> List[Tuple[int, int]]:
    """Byte ranges covering ``wanted`` (sorted by offset), adjacent ones joined."""
    runs: List[Tuple[int, int]] = []
    for t in wanted:
        if runs and runs[-1][1] == t.start:
            runs[-1] = (runs[-1][0], t.end)
        else:
            runs.append((t.start, t.end))
    return runs


class _Sink:
    def __init__(self, file, bar):
        self.file, self.bar = file, bar

    def write(self, data: bytes):
        self.file.write(data)

    def progress(self, n: int):
        if self.bar is not None:
            self.bar.update(n)


def _fetch_shard(repo, commit, shard, out: Path, progress: bool, log):
    """``(MTP tensor names, bytes fetched, shard size, ranges refused)``;
    one process at a time per shard (two runs would write one ``.part``)."""
    from huggingface_hub.utils import WeakFileLock

    with WeakFileLock(out / (shard + ".lock")):
        done = _fetched(out / shard)
        if done is not None:
            return done
        return _fetch_shard_ranges(repo, commit, shard, out, progress, log)


def _fetched(final: Path):
    """The result for a shard fetched before (its file only ever gets its
    name when complete), or None; an unreadable one is fetched again."""
    from safetensors import SafetensorError, safe_open

    if not final.exists():
        return None
    try:
        with safe_open(str(final), framework="numpy") as f:
            names = list(f.keys())
            size = int((f.metadata() or {}).get("mlx_spec.shard_size", 0))
    except (OSError, SafetensorError, ValueError):
        final.unlink()
        return None
    return names, 0, size, False


def _fetch_shard_ranges(repo, commit, shard, out: Path, progress: bool, log):
    final, part = out / shard, out / (shard + ".part")
    remote = _Remote(repo, commit, shard)
    prefix = remote.read(0, 8)
    if prefix is None:
        return _from_whole_shard(repo, commit, shard, out, log)
    length = int.from_bytes(prefix, "little")
    if not 0 < length <= _MAX_HEADER or 8 + length > remote.size:
        raise HubError(f"{remote.name}: header length {length} is not valid")
    raw = remote.read(8, 8 + length)
    meta, tensors = _parse_header(remote.name, raw, remote.size)
    wanted = sorted(
        (t for t in tensors if is_mtp_tensor(t.name)), key=lambda t: t.start
    )
    if not wanted:
        return [], remote.received, remote.size, False
    meta = {**meta, "mlx_spec.shard_size": remote.size}
    head = _small_header(meta, wanted, f"{repo}@{commit}/{shard}", remote.etag)
    total = sum(t.end - t.start for t in wanted)

    done = _resumable_bytes(part, head)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=total,
            initial=done,
            unit="B",
            unit_scale=True,
            desc=f"MTP tensors of {shard}",
        )
    try:
        with open(part, "ab") as file:
            if done == 0:
                file.truncate(0)
                file.write(head)
            sink, position = _Sink(file, bar), 0
            for start, end in _runs(wanted):
                size = end - start
                if position + size > done:  # this run is not all on disk yet
                    skip = max(0, done - position)
                    remote.read(start + skip, end, sink)
                position += size
    finally:
        if bar is not None:
            bar.close()
    _check_complete(part, len(head) + total, remote.name)
    part.replace(final)
    return [t.name for t in wanted], remote.received, remote.size, False


def _resumable_bytes(part: Path, head: bytes) -> int:
    """Tensor bytes already in ``part`` for this header (0: start again)."""
    try:
        with open(part, "rb") as f:
            on_disk = f.read(len(head))
            size = part.stat().st_size
    except FileNotFoundError:
        return 0
    if on_disk != head:  # another shard version, or a torn header
        return 0
    return size - len(head)


def _check_complete(part: Path, expected: int, name: str):
    from safetensors import SafetensorError, safe_open

    size = part.stat().st_size
    if size != expected:
        raise HubError(f"{name}: {part} has {size} bytes, expected {expected}")
    try:
        with safe_open(str(part), framework="numpy"):
            pass
    except (OSError, SafetensorError) as e:
        raise HubError(f"{name}: the fetched tensors do not parse ({e})") from None


def _from_whole_shard(repo, commit, shard, out: Path, log):
    """The server refused ranges: download the whole shard (resumable, into
    the Hugging Face cache), then copy its MTP tensors out of it."""
    from huggingface_hub import hf_hub_download

    log(
        f"{repo}: the server does not answer range requests; downloading all of {shard}"
    )
    local = Path(hf_hub_download(repo, shard, revision=commit))
    size = local.stat().st_size
    with open(local, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= _MAX_HEADER or 8 + length > size:
            raise HubError(f"{local}: header length {length} is not valid")
        meta, tensors = _parse_header(str(local), f.read(length), size)
        wanted = sorted(
            (t for t in tensors if is_mtp_tensor(t.name)), key=lambda t: t.start
        )
        if not wanted:
            return [], size, size, True
        meta = {**meta, "mlx_spec.shard_size": size}
        head = _small_header(meta, wanted, f"{repo}@{commit}/{shard}", "")
        part = out / (shard + ".part")
        with open(part, "wb") as dst:
            dst.write(head)
            for start, end in _runs(wanted):
                f.seek(start)
                dst.write(f.read(end - start))
    _check_complete(part, len(head) + sum(t.end - t.start for t in wanted), shard)
    part.replace(out / shard)
    return [t.name for t in wanted], size, size, True
