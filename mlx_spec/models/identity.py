"""Which weights is this model, exactly? The identity that everything keyed
on a model's output is keyed on: states kept on disk, chat sessions, measured
verify costs.

Every byte of every weight counts. A model loaded by :func:`mlx_spec.load`
records the files it was made from (``config.json``, every ``*.safetensors``
of its directory, the adapters' files, the MTP head's files), and its
identity is a hash of their contents' SHA-256 digests. A digest is computed
once per file and kept in the cache directory under the file's path, size,
modification and change times and inode, so a second load reads no weight
file; a file in the Hugging Face cache is a blob named by its SHA-256
already, which is taken as its digest. A fine-tune that changes one layer, a
re-quantisation or other adapters are another identity.

A model that did not come through :func:`mlx_spec.load` (built in memory,
loaded by ``mlx_lm.load``), or whose parameters no longer have the names,
shapes and types they were loaded with (quantised in memory since), is
identified by the bytes of its parameters in memory instead, hashed once per
model object. Weights overwritten in memory in place with the same shapes
(``model.load_weights`` of another checkpoint) are not seen: load such a model
from its files.

A DFlash drafter model is identified the same way (the files
:func:`mlx_spec.load_drafter` read, or its parameters' bytes), with its
config and the shapes its parameters have now (quantised in memory or not):
a kept state holds the drafter's context, which another drafter of the
same shapes would read as its own.
"""

import dataclasses
import hashlib
import json
import os
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ..cache_dir import cache_dir

HUB_BLOB = re.compile(r"[0-9a-f]{64}")  # a hub cache blob named by its SHA-256
READ_BYTES = 8 << 20
MAX_CACHED_DIGESTS = 4096  # files remembered; the oldest are forgotten first
HASH_THREADS = 4  # files hashed at once (hashlib releases the interpreter)

_lock = threading.Lock()  # the digest cache file, within this process


def digest_cache_file() -> Path:
    return cache_dir() / "file_digests.json"


def _file_key(path: Path, st: os.stat_result) -> str:
    # the change time moves on every write, whatever a copy tool sets the
    # modification time to
    return f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"


def _read_cache() -> Dict[str, str]:
    try:
        cached = json.loads(digest_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cached, dict):
        return {}
    return {k: v for k, v in cached.items() if isinstance(v, str)}


def _write_cache(updates: Dict[str, str]):
    """Add ``updates`` to the cache file (atomic replace; a cache that cannot
    be written only costs hashing again next time)."""
    path = digest_cache_file()
    with _lock:
        cached = _read_cache()
        for key in updates:
            cached.pop(key, None)  # re-added last: the newest
        cached.update(updates)
        kept = dict(list(cached.items())[-MAX_CACHED_DIGESTS:])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".digests.")
            with os.fdopen(fd, "w") as f:
                json.dump(kept, f)
            os.replace(tmp, path)
        except OSError:
            if "tmp" in locals():
                Path(tmp).unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(paths: Sequence[Path]) -> List[str]:
    """The SHA-256 of each file's bytes (hex), from the hub's blob name or
    the digest cache where they give it, else read and remembered."""
    real = [Path(p).resolve() for p in paths]
    stats = [p.stat() for p in real]
    cached = _read_cache()
    out: List[Optional[str]] = []
    for path, st in zip(real, stats):
        if path.parent.name == "blobs" and HUB_BLOB.fullmatch(path.name):
            out.append(path.name)
        else:
            out.append(cached.get(_file_key(path, st)))
    todo = [i for i, d in enumerate(out) if d is None]
    if todo:
        with ThreadPoolExecutor(min(HASH_THREADS, len(todo))) as pool:
            for i, d in zip(todo, pool.map(_sha256, [real[i] for i in todo])):
                out[i] = d
        _write_cache({_file_key(real[i], stats[i]): out[i] for i in todo})
    return out


def files_identity(paths: Iterable[Path]) -> str:
    """One digest of the contents of ``paths`` (their order does not count;
    their names do not either, so a copy of a model is the same model)."""
    digest = hashlib.sha256()
    for d in sorted(file_digests(list(paths))):
        digest.update(d.encode())
    return digest.hexdigest()


def weight_files(model_dir: Path, adapter_path=None) -> List[Path]:
    """What a model loaded from ``model_dir`` (with adapters from
    ``adapter_path``) is made of: its config, every safetensors file (an MTP
    sidecar among them), the adapters' config and weights."""
    files = [model_dir / "config.json"] + sorted(model_dir.glob("*.safetensors"))
    if adapter_path is not None:
        adapters = Path(adapter_path)
        files += sorted(adapters.glob("*.json")) + sorted(
            adapters.glob("*.safetensors")
        )
    return [f for f in files if f.is_file()]


def _structure(module) -> str:
    """The names, shapes and types of ``module``'s parameters (no data)."""
    digest = hashlib.sha256()
    for name, w in sorted(tree_flatten(module.parameters()), key=lambda kv: kv[0]):
        digest.update(f"{name}{tuple(w.shape)}{w.dtype};".encode())
    return digest.hexdigest()


def _bytes_identity(module) -> str:
    """A digest of every parameter of ``module`` in memory."""
    digest = hashlib.sha256()
    for name, w in sorted(tree_flatten(module.parameters()), key=lambda kv: kv[0]):
        w = mx.contiguous(w)
        mx.eval(w)
        digest.update(f"{name}{tuple(w.shape)}{w.dtype};".encode())
        digest.update(memoryview(w))
    return digest.hexdigest()


def _state(model) -> dict:
    return getattr(model, "__dict__", {})


def record_sources(model, files: Sequence[Path], head_files: Sequence[Path] = ()):
    """Note the files ``model`` (and its MTP head) were loaded from, and the
    shape of its parameters now (a later change to them is then noticed)."""
    object.__setattr__(model, "source_files", tuple(Path(f) for f in files))
    object.__setattr__(model, "source_structure", _structure(model))
    head = _state(model).get("mtp_head")
    if head is not None:
        object.__setattr__(head, "source_files", tuple(Path(f) for f in head_files))
        object.__setattr__(head, "source_structure", _structure(head))


def _weights_identity(module) -> str:
    """``module``'s weights: its source files' contents while its parameters
    are as loaded, else its parameters' bytes; remembered on the module."""
    state = _state(module)
    structure = _structure(module)
    memo = state.get("_identity_memo")
    if memo is not None and memo[0] == structure:
        return memo[1]
    files = state.get("source_files")
    if files and state.get("source_structure") == structure:
        identity = "files:" + files_identity(files)
    else:
        identity = "bytes:" + _bytes_identity(module)
    object.__setattr__(module, "_identity_memo", (structure, identity))
    return identity


def model_fingerprint(model) -> str:
    """A short exact hash of ``model``'s config and of every byte of its
    weights (see the module's docstring)."""
    args = getattr(model, "args", None)
    config = vars(args) if args is not None else {}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(_weights_identity(model).encode())
    return digest.hexdigest()[:32]


def head_fingerprint(model) -> str:
    """A short exact hash of the attached MTP head (its weights' files and
    how they were read, or its parameters' bytes), or "" without one: states
    drafted with one head are not continued with another."""
    head = _state(model).get("mtp_head")
    if head is None:
        return ""
    digest = hashlib.sha256(_weights_identity(head).encode())
    info = _state(model).get("mtp_info")
    if info is not None:  # the norm shift applied changes what the head computes
        digest.update(f"{info.layout}|{info.shift.add_one}".encode())
    return digest.hexdigest()[:32]


def draft_model_fingerprint(draft_model) -> str:
    """A short exact hash of a DFlash drafter model (its config, its
    parameters' names, shapes and types as used, and its weights: the files
    it was loaded from or its parameters' bytes), or "" for None: a state
    holding one drafter's context is not continued with another's."""
    if draft_model is None:
        return ""
    config = getattr(draft_model, "config", None)
    if dataclasses.is_dataclass(config):
        fields = dataclasses.asdict(config)
    else:
        fields = vars(config) if config is not None else {}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    # quantised in memory: the same files, other weights (bits, group size)
    digest.update(_structure(draft_model).encode())
    digest.update(_weights_identity(draft_model).encode())
    return digest.hexdigest()[:32]
