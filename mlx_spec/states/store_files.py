"""The kept-state directory's files: what a state file is for (its
:class:`Identity`), what it is named, whether a directory may hold states,
and the directory read without following links.

The store (:mod:`mlx_spec.states.store`) owns only what it wrote: files named
as states (40 hex digits, ``.safetensors``) and its temporary files beside
them. A directory holding anything else is refused here, before any state is
kept in it.
"""

import hashlib
import os
import re
import stat
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..drafters.dflash import attached_draft_model
from ..models.fingerprint import tokenizer_fingerprint
from ..models.identity import (
    draft_model_fingerprint,
    head_fingerprint,
    model_fingerprint,
)
from .file import temp_file_beside

FORMAT = "mlx_spec.state.v2"
OWN_FORMATS = "mlx_spec.state."  # every version's files are the store's own
STATE_NAME = re.compile(r"[0-9a-f]{40}\.safetensors")
# temp_file_beside's names for them: ".NAME." + mkstemp's letters + suffix
TEMP_NAME = re.compile(r"\.[0-9a-f]{40}\.safetensors\.[a-z0-9_]+\.safetensors")
DEFAULT_DIR = "~/.cache/mlx_spec/states"  # documented; never used unasked
STALE_TEMP_S = 3600  # a temporary file this old is a crashed writer's


@dataclass(frozen=True)
class Identity:
    """What a state file must match to be continued: the format, the model,
    its MTP head, its DFlash drafter model and its tokenizer.

    The drafter model counts for every state, whichever drafter made it: a
    dflash state holds that drafter's context (another drafter of the same
    shapes would read it as its own), and every state's hidden row carries
    the features of the layers the drafter model taps."""

    model: str
    head: str
    tokenizer: str
    model_name: str = ""  # for messages only
    draft_model: str = ""  # "" without a DFlash drafter model

    @classmethod
    def of(cls, model, tokenizer, model_name: str = "") -> "Identity":
        return cls(
            model_fingerprint(model),
            head_fingerprint(model),
            tokenizer_fingerprint(tokenizer),
            str(model_name),
            draft_model_fingerprint(attached_draft_model(model)),
        )

    def metadata(self) -> Dict[str, str]:
        return {
            "format": FORMAT,
            "model": self.model,
            "head": self.head,
            "tokenizer": self.tokenizer,
            "model_name": self.model_name,
            "draft_model": self.draft_model,
        }

    def mismatch(self, meta: Dict[str, str]) -> Optional[str]:
        """Why a file with metadata ``meta`` is not for this identity."""
        if meta.get("format") != FORMAT:
            return f"format {meta.get('format')!r}, not {FORMAT!r}"
        if meta.get("model") != self.model:
            name = meta.get("model_name") or meta.get("model")
            return f"saved for another model or other weights ({name})"
        if meta.get("head") != self.head:
            return "saved with another MTP head"
        theirs = meta.get("draft_model", "")  # files written before it: none
        if theirs != self.draft_model:
            if not theirs:
                return "saved without a DFlash drafter model"
            if not self.draft_model:
                return "saved with a DFlash drafter model, and none is loaded"
            return "saved with another DFlash drafter model"
        if meta.get("tokenizer") != self.tokenizer:
            return "saved with another tokenizer"
        return None


def tokens_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha256(array("I", tokens).tobytes()).hexdigest()


def file_name(identity: Identity, drafter: str, tokens: Sequence[int]) -> str:
    """The file of a state: the same state always has the same name."""
    key = f"{FORMAT}|{identity.model}|{identity.head}|{identity.tokenizer}|{drafter}|"
    if identity.draft_model:  # without one, the names files always had
        key += f"{identity.draft_model}|"
    digest = hashlib.sha256(key.encode())
    digest.update(array("I", tokens).tobytes())
    return digest.hexdigest()[:40] + ".safetensors"


def _foreign(directory: Path) -> List[str]:
    """The names in ``directory`` that are not the store's: anything but a
    regular file named as a state or a state being written (hidden names,
    such as a desktop's ``.DS_Store``, are left out)."""
    names = []
    for item in scan(directory):
        ours = STATE_NAME.fullmatch(item.name) or TEMP_NAME.fullmatch(item.name)
        if ours and _regular(item) or item.name.startswith(".") and not ours:
            continue
        names.append(item.name)
    return sorted(names)


def check_state_dir(directory):
    """Raise ``ValueError`` naming ``directory`` if states cannot be kept
    there: an empty path, a directory holding anything but states (a model,
    adapters, ...), one that cannot be created or written."""
    if not str(directory).strip():
        raise ValueError(
            "the state directory is an empty path (an unset variable?); "
            f"give a directory of its own, e.g. {DEFAULT_DIR}"
        )
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        foreign = _foreign(path)
        if not foreign:
            temp_file_beside(path / "check").unlink()
    except OSError as e:
        raise ValueError(
            f"cannot keep states in {str(directory)!r}: {e.strerror or e}"
        ) from None
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"cannot keep states in {str(directory)!r}: it holds files that are "
            f"not states ({shown}); give a directory of its own, e.g. {DEFAULT_DIR}"
        )


def scan(directory: Path) -> List[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError:  # the directory is gone or unreadable: nothing on disk
        return []


def own_stat(entry: os.DirEntry):
    """``entry``'s own status (a link's, not its target's); None once gone."""
    try:
        return entry.stat(follow_symlinks=False)
    except OSError:  # removed since listing
        return None


def lstat_or_none(path: Path):
    try:
        return path.lstat()
    except OSError:
        return None


def _regular(entry: os.DirEntry) -> bool:
    st = own_stat(entry)
    return st is not None and stat.S_ISREG(st.st_mode)


def remove_file(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False


def touch(path: Path):
    """Mark ``path`` as used now (the LRU order is modification time)."""
    try:
        os.utime(path)
    except OSError:
        pass
