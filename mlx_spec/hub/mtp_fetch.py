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
hub) starts the shard again. One process at a time works on a shard (a file
lock beside it).

Which bytes are the MTP tensors, and the checks of a shard's header, are
:mod:`mlx_spec.hub.mtp_ranges`; this module moves the bytes.
"""

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .resolve import HubError, hub_errors
from ..models.mtp.layouts import MTP_PREFIXES
from .mtp_ranges import (
    INDEX_NAME,
    SINGLE_SHARD,
    byte_runs,
    header_length,
    index_shards,
    mtp_tensors,
    parse_header,
    small_header,
)


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
            shards = index_shards(index)
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
    length = header_length(remote.name, prefix, remote.size)
    raw = remote.read(8, 8 + length)
    meta, tensors = parse_header(remote.name, raw, remote.size)
    wanted = mtp_tensors(tensors)
    if not wanted:
        return [], remote.received, remote.size, False
    meta = {**meta, "mlx_spec.shard_size": remote.size}
    head = small_header(meta, wanted, f"{repo}@{commit}/{shard}", remote.etag)
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
            for start, end in byte_runs(wanted):
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
        length = header_length(str(local), f.read(8), size)
        meta, tensors = parse_header(str(local), f.read(length), size)
        wanted = mtp_tensors(tensors)
        if not wanted:
            return [], size, size, True
        meta = {**meta, "mlx_spec.shard_size": size}
        head = small_header(meta, wanted, f"{repo}@{commit}/{shard}", "")
        part = out / (shard + ".part")
        with open(part, "wb") as dst:
            dst.write(head)
            for start, end in byte_runs(wanted):
                f.seek(start)
                dst.write(f.read(end - start))
    _check_complete(part, len(head) + sum(t.end - t.start for t in wanted), shard)
    part.replace(out / shard)
    return [t.name for t in wanted], size, size, True
