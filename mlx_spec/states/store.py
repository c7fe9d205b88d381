"""Decoder states kept on disk: the tier under the server's states in memory,
so that a conversation continues without prefilling it again after its state
left memory, after a restart, or in another server process.

A directory of its own holding state files (:mod:`mlx_spec.states.file`),
one per state, named by a hash of the model's identity, the drafter and the
tokens it holds (40 hex digits, ``.safetensors``). Each file's metadata says
what it is: the format version, the model (the identity of every byte of its
weights, its MTP head's, its DFlash drafter model's and its tokenizer's), the
drafter and the tokens (with their hash). Only the header of a file is read to know what it holds;
a state is loaded only for a prompt that continues its tokens, only if
everything matches, and only if its arrays fit the model. A file of another
model or format, a truncated, damaged or misfitting one: skipped with one
warning (per file and process), never loaded again.

The store owns only what it wrote. A directory holding anything else (a
model, adapters: any file not named as a state) is refused when the store
opens; files added later, a file named like a state whose header is not a
state's, links, pipes and devices are never opened for their contents,
counted or removed. Files are opened without following links and without
blocking.

Writes never hold up decoding: :meth:`StateStore.put` copies the state
(evaluated arrays, no further computation) and hands it to a writer thread,
which writes a temporary file beside the final name and renames it into
place. A reader (another process included) so only ever sees whole files; a
crash leaves at most a hidden temporary file, removed once it is stale. A
disk that is full or unwritable costs a warning, not a request. The directory
is kept under its byte budget by removing the least recently used files (a
file's modification time: written or last loaded); a file another process
removes between listing and reading is just a miss.
"""

import logging
import os
import queue
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .file import plain_state, read_metadata, read_state, write_state
from .snapshot import DecoderState, check_loadable
from .store_files import (
    DEFAULT_DIR,
    OWN_FORMATS,
    STALE_TEMP_S,
    STATE_NAME,
    TEMP_NAME,
    Identity,
    check_state_dir,
    file_name,
    lstat_or_none,
    own_stat,
    remove_file,
    scan,
    tokens_hash,
    touch,
)

# the names importers took from here before the directory's files had a module
__all__ = [
    "DEFAULT_DIR",
    "STALE_TEMP_S",
    "STATE_NAME",
    "Identity",
    "StateStore",
    "check_state_dir",
    "file_name",
    "tokens_hash",
]

log = logging.getLogger("mlx_spec.states")


@dataclass(frozen=True)
class _Entry:
    """A file of this identity, as its header describes it."""

    path: Path
    drafter: str
    tokens: Tuple[int, ...]
    pending: int


@dataclass
class _File:
    """A file named as a state: whether its header says it is one (only then
    is it counted and ever removed), and the entry it is for this identity
    (None: another identity's, or skipped)."""

    owned: bool
    entry: Optional[_Entry]


class StateStore:
    """The state files of one directory, for one model (``identity``);
    ``check`` raises ``ValueError`` for a state that does not fit the model
    (see :func:`for_model`)."""

    def __init__(
        self,
        directory,
        max_bytes: int,
        identity: Identity,
        check: Callable[[DecoderState], None],
    ):
        check_state_dir(directory)
        self.directory = Path(directory).expanduser()
        self.max_bytes, self.identity, self.check = max_bytes, identity, check
        self._lock = threading.Lock()  # the index, the warnings, the queued
        self._index: Dict[Tuple, _File] = {}  # (name, inode, size) -> what it is
        self._warned = set()
        self._queued: Dict[str, DecoderState] = {}  # name -> state not yet written
        self._idle = threading.Condition(self._lock)
        self._writes: "queue.Queue[Optional[Tuple[str, DecoderState]]]" = queue.Queue()
        self.counts = {"written": 0, "loaded": 0, "write_failures": 0, "removed": 0}
        self._writer = threading.Thread(
            target=self._write_loop, name="mlx_spec-states", daemon=True
        )
        self._writer.start()

    @classmethod
    def for_model(
        cls, directory, max_bytes: int, model, tokenizer, model_name: str = ""
    ) -> "StateStore":
        """The store of ``model``'s states in ``directory``."""
        identity = Identity.of(model, tokenizer, model_name)
        return cls(directory, max_bytes, identity, lambda s: check_loadable(model, s))

    # -- writing ---------------------------------------------------------------
    def put(self, state: DecoderState):
        """Write ``state`` (which must not change afterwards) to disk, in the
        background; one already there is only marked as used now."""
        name = file_name(self.identity, state.drafter, state.history)
        path = self.directory / name
        with self._lock:
            if name in self._queued:
                return
        st = lstat_or_none(path)
        if st is not None and not stat.S_ISREG(st.st_mode):
            self._warn_once(("foreign", name), f"{path} is not a state: left alone")
            return
        if st is not None and not self._skipped(path, st):
            touch(path)  # the same state: only its use is news
            return
        if state.nbytes > self.max_bytes:
            return  # it could never be kept
        try:
            plain = plain_state(state)  # evaluated here: the writer computes nothing
        except Exception as e:  # a cache this file format does not hold
            self._warn_once(("put", type(e)), f"a state was not kept on disk: {e}")
            return
        with self._lock:
            self._queued[name] = plain
        self._writes.put((name, plain))

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every state put so far is written (or failed); False if
        ``timeout`` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._queued, timeout)

    def close(self, timeout: Optional[float] = None):
        """Write what is queued, then stop the writer."""
        self._writes.put(None)
        self._writer.join(timeout)

    def _write_loop(self):
        self.trim()  # a smaller budget than last time applies at once
        while True:
            item = self._writes.get()
            if item is None:
                return
            name, state = item
            try:
                self._write(name, state)
            finally:
                with self._idle:
                    self._queued.pop(name, None)
                    self._idle.notify_all()

    def _write(self, name: str, state: DecoderState):
        meta = {
            **self.identity.metadata(),
            "tokens": ",".join(map(str, state.history)),
            "tokens_sha256": tokens_hash(state.history),
        }
        try:
            write_state(self.directory / name, state, meta)
        except Exception as e:  # a full disk, a directory gone: serving goes on
            self.counts["write_failures"] += 1
            text = " ".join(str(e).split()) or type(e).__name__
            kind = ("write", type(e).__name__, getattr(e, "errno", None))
            self._warn_once(kind, f"cannot write a state to {self.directory}: {text}")
            return
        self.counts["written"] += 1
        with self._lock:  # a later failure is news again
            self._warned = {k for k in self._warned if k[0] != "write"}
        self.trim()

    def trim(self):
        """Remove the least recently used of the store's own files until they
        take at most ``max_bytes``, and its temporary files left by a crash.
        Nothing else in the directory is ever removed."""
        files, now = [], time.time()
        for item in scan(self.directory):
            st = own_stat(item)
            if st is None or not stat.S_ISREG(st.st_mode):
                continue
            if TEMP_NAME.fullmatch(item.name):
                if now - st.st_mtime > STALE_TEMP_S:
                    remove_file(Path(item.path))
            elif STATE_NAME.fullmatch(item.name) and self._file(item, st).owned:
                files.append((st.st_mtime_ns, st.st_size, Path(item.path)))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            if remove_file(path):
                self.counts["removed"] += 1
            total -= size  # gone, whoever removed it

    # -- reading ---------------------------------------------------------------
    def lookup(
        self, drafter: str, prompt: Sequence[int], longer_than: int = 0
    ) -> Optional[DecoderState]:
        """The state on disk (or queued to be written) with the longest
        history that ``prompt`` continues, longer than ``longer_than``
        tokens: a strict prefix of it, or all of it when the state's last
        token is pending. None when there is none, or none loads."""
        prompt = tuple(prompt)

        def fits(tokens, pending):
            n = len(tokens)
            return (
                longer_than < n
                and (n < len(prompt) or (n == len(prompt) and pending))
                and prompt[:n] == tokens
            )

        with self._lock:
            queued = [
                s
                for s in self._queued.values()
                if s.drafter == drafter and fits(tuple(s.history), s.pending)
            ]
        best = max(queued, key=lambda s: len(s.history), default=None)
        if best is not None:
            longer_than = len(best.history)
        candidates = [
            e
            for e in self._entries()
            if e.drafter == drafter and fits(e.tokens, e.pending)
        ]
        for entry in sorted(candidates, key=lambda e: -len(e.tokens)):
            state = self._load(entry)
            if state is not None:
                return state
        return best

    def _load(self, entry: _Entry) -> Optional[DecoderState]:
        try:
            state, meta = read_state(entry.path)
        except FileNotFoundError:  # another process removed it: a miss
            return None
        except (OSError, ValueError) as e:
            self._skip(entry.path, " ".join(str(e).split()))
            return None
        why = self.identity.mismatch(meta)
        if why is None and (
            tuple(state.history) != entry.tokens
            or meta.get("tokens_sha256") != tokens_hash(state.history)
            or state.drafter != entry.drafter
        ):
            why = "its tokens do not match its header"
        if why is None:
            try:
                self.check(state)
            except ValueError as e:
                why = f"it does not fit the model: {e}"
        if why is not None:
            self._skip(entry.path, why)
            return None
        touch(entry.path)
        self.counts["loaded"] += 1
        return state

    def _file(self, item: os.DirEntry, st: os.stat_result) -> _File:
        """What the file ``item`` is (its header read once per file)."""
        key = (item.name, st.st_ino, st.st_size)
        with self._lock:
            known = self._index.get(key)
        if known is None:
            known = self._describe(Path(item.path))
            with self._lock:
                self._index[key] = known
        return known

    def _entries(self) -> List[_Entry]:
        """The files of this identity now in the directory."""
        entries, seen = [], set()
        for item in scan(self.directory):
            if not STATE_NAME.fullmatch(item.name):
                continue
            st = own_stat(item)
            if st is None or not stat.S_ISREG(st.st_mode):
                continue
            seen.add((item.name, st.st_ino, st.st_size))
            entry = self._file(item, st).entry
            if entry is not None:
                entries.append(entry)
        with self._lock:  # forget files that are gone
            for key in [k for k in self._index if k not in seen]:
                del self._index[key]
        return entries

    def _describe(self, path: Path) -> _File:
        try:
            meta = read_metadata(path)
        except FileNotFoundError:
            return _File(False, None)
        except (OSError, ValueError) as e:
            self._warn_once(("skip", path.name), f"{path} skipped: {_text(e)}")
            return _File(False, None)
        if not str(meta.get("format", "")).startswith(OWN_FORMATS):
            why = "it is not a state file (left alone)"
            self._warn_once(("skip", path.name), f"{path} skipped: {why}")
            return _File(False, None)
        why = self.identity.mismatch(meta)
        if why is None:
            tokens = tuple(
                int(t) for t in str(meta.get("tokens")).split(",") if t.isdecimal()
            )
            if tokens_hash(tokens) != meta.get("tokens_sha256"):
                why = "its tokens do not match their hash"
            elif meta.get("pending") not in ("0", "1") or "drafter" not in meta:
                why = "its header is damaged"
            else:
                entry = _Entry(path, meta["drafter"], tokens, int(meta["pending"]))
                return _File(True, entry)
        self._warn_once(("skip", path.name), f"state file {path} skipped: {why}")
        return _File(True, None)

    # -- reporting -------------------------------------------------------------
    def _skip(self, path: Path, why: str):
        """Never load ``path`` again in this process; say so once."""
        st = lstat_or_none(path)
        if st is not None:
            with self._lock:
                known = self._index.get((path.name, st.st_ino, st.st_size))
                if known is not None:
                    known.entry = None
        self._warn_once(("skip", path.name), f"state file {path} skipped: {why}")

    def _skipped(self, path: Path, st: os.stat_result) -> bool:
        """Whether ``path`` is a file this process skipped: it may be replaced
        by the state whose name it has (a hash no other file has by chance)."""
        with self._lock:
            known = self._index.get((path.name, st.st_ino, st.st_size))
        return known is not None and known.entry is None

    def _warn_once(self, key, message: str):
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(message)

    def status(self) -> dict:
        """For ``/health``: the directory, its state files and their bytes,
        what waits to be written, and what was written, loaded and removed
        so far."""
        sizes = []
        for item in scan(self.directory):
            st = own_stat(item) if STATE_NAME.fullmatch(item.name) else None
            if st is not None and stat.S_ISREG(st.st_mode):
                if self._file(item, st).owned:
                    sizes.append(st.st_size)
        with self._lock:
            queued = len(self._queued)
        return {
            "dir": str(self.directory),
            "files": len(sizes),
            "bytes": sum(sizes),
            "max_bytes": self.max_bytes,
            "queued": queued,
            **self.counts,
        }


def _text(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
