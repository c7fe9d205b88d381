"""Where a named model's files are: a local path, or a Hugging Face repo id.

A name that exists on disk is used as it is. Otherwise a name of the form
``namespace/name`` is a repo id, fetched as ``mlx_lm.load`` fetches it (its
download helper: the Hugging Face cache, ``revision``, ``HF_HUB_OFFLINE``,
``HF_ENDPOINT``, ``HF_TOKEN``), together with the MTP files that mlx-lm's
download patterns leave out:

- ``mtp.safetensors``, its shards ``mtp-XXXXX-of-YYYYY.safetensors`` and
  ``mtp.safetensors.index.json``, and the folder ``mtp/``;
- the file named by ``config.json`` ``mlx_lm_extra_tensors.mtp_file``.

(``model-mtp.safetensors`` already matches mlx-lm's ``model*.safetensors``.)

A missing local path is a ``FileNotFoundError``; every failure to fetch is
a :class:`HubError`; either message is one line naming the
repo (or path) and what went wrong; nothing half-downloaded is ever used (the
Hugging Face cache keeps partial files under temporary names and resumes them).
"""

import json
from fnmatch import fnmatch
import warnings
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterator, Optional, Union

from .. import mlx_lm_compat

MTP_FILE_PATTERNS = (
    "mtp.safetensors",
    "mtp-*-of-*.safetensors",
    "mtp.safetensors.index.json",
    "mtp/*",
)
# What ``--mtp-path REPO`` downloads: the head's files and the config naming them.
MTP_ONLY_PATTERNS = ("config.json", "model-mtp.safetensors") + MTP_FILE_PATTERNS
# What a drafter repo id downloads: its config and weights (whatever the
# shards are called), not a model's tokenizer or code.
DRAFTER_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json")


class HubError(OSError):
    """A model neither on disk nor fetchable (one line naming it)."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hugging Face repo id (``namespace/name``).

    A bare name (``gpt2``) is taken for a missing local directory: MLX models
    are published under a namespace, and a typo should not reach the network.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1 or name.startswith((".", "~")):
        return False
    if name.endswith((".safetensors", ".json")):  # a file path, not a repo
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model(
    name: Union[str, Path], revision: Optional[str] = None, what: str = "model"
) -> Path:
    """The local directory of model ``name`` (a path, or a repo id downloaded
    into the Hugging Face cache with the MTP files); ``what`` names the
    argument in errors."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    repo = str(name)
    if not is_repo_id(repo):
        raise FileNotFoundError(f"{what} path {repo!r} does not exist")
    patterns = list(mlx_lm_compat.DOWNLOAD_PATTERNS) + list(MTP_FILE_PATTERNS)
    with hub_errors(repo, revision, what):
        path = mlx_lm_compat.download_model(
            repo, revision=revision, allow_patterns=patterns
        )
        fetch_config_mtp_file(repo, revision, Path(path))
    return Path(path)


def resolve_mtp_path(name: Union[str, Path], revision: Optional[str] = None) -> Path:
    """The local path of ``--mtp-path`` ``name``: a file or directory, or a
    repo id of which only the MTP files (and ``config.json``) are downloaded."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    repo = str(name)
    if not is_repo_id(repo):
        raise FileNotFoundError(f"MTP path {repo!r} does not exist")
    with hub_errors(repo, revision, "MTP path"):
        path = Path(
            mlx_lm_compat.download_model(
                repo, revision=revision, allow_patterns=list(MTP_ONLY_PATTERNS)
            )
        )
        fetch_config_mtp_file(repo, revision, path)
    if not has_mtp_files(path):
        raise HubError(
            f"MTP path {repo!r}: the repo has no MTP sidecar (mtp.safetensors, "
            "model-mtp.safetensors, mtp/...); if it is a raw checkpoint run "
            f"`mlx_spec convert --mtp-from {repo} --mlx-path <model dir>`"
        )
    return path


def resolve_drafter(name: Union[str, Path], revision: Optional[str] = None) -> Path:
    """The local directory of drafter ``name``: a path, or a repo id of which
    the config and safetensors files are downloaded."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    repo = str(name)
    if not is_repo_id(repo):
        raise FileNotFoundError(f"drafter path {repo!r} does not exist")
    with hub_errors(repo, revision, "drafter"):
        return Path(
            mlx_lm_compat.download_model(
                repo, revision=revision, allow_patterns=list(DRAFTER_PATTERNS)
            )
        )


def has_mtp_files(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a file of an MTP sidecar layout."""
    named = config_mtp_file(model_dir)
    for file in Path(model_dir).rglob("*"):
        name = file.relative_to(model_dir).as_posix()
        if name == named or any(
            fnmatch(name, p) for p in MTP_ONLY_PATTERNS if p != "config.json"
        ):
            return True
    return False


def config_mtp_file(model_dir: Path) -> Optional[str]:
    """``config.json`` ``mlx_lm_extra_tensors.mtp_file`` when it is a safe
    relative path (a config is untrusted input: no absolute or ``..`` paths)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader reports a missing or broken config
    extra = config.get("mlx_lm_extra_tensors") if isinstance(config, dict) else None
    name = extra.get("mtp_file") if isinstance(extra, dict) else None
    if not isinstance(name, str) or not name:
        return None
    parts = PurePosixPath(name)
    if parts.is_absolute() or ".." in parts.parts or "\\" in name:
        warnings.warn(
            f"{model_dir}/config.json: mlx_lm_extra_tensors.mtp_file={name!r} is "
            "not a relative path inside the model; ignored",
            stacklevel=2,
        )
        return None
    return name


def fetch_config_mtp_file(repo: str, revision: Optional[str], snapshot: Path):
    """Download the file ``config.json`` names as the MTP weights (and the
    shards it lists when it is an index), when the snapshot lacks it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    name = config_mtp_file(snapshot)
    if name is None or (snapshot / name).exists():
        return
    try:
        local = Path(hf_hub_download(repo, name, revision=revision))
    except EntryNotFoundError:
        warnings.warn(
            f"{repo}: config.json names mtp_file={name!r}, which the repo lacks",
            stacklevel=2,
        )
        return
    if name.endswith(".index.json"):
        try:
            shards = set(json.loads(local.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            return  # the loader names the broken index
        folder = PurePosixPath(name).parent
        for shard in sorted(s for s in shards if isinstance(s, str)):
            hf_hub_download(repo, str(folder / shard), revision=revision)


@contextmanager
def hub_errors(repo: str, revision: Optional[str], what: str) -> Iterator[None]:
    """Turn whatever fetching ``repo`` raises into a one-line :class:`HubError`."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = f"{what} {repo!r}"
    try:
        yield
    except HubError:
        raise
    except GatedRepoError:
        raise HubError(
            f"{name}: the repo is gated; accept its terms on the hub and log in "
            "(`hf auth login` or HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"{name}: the repo has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{name} is not a local directory, and {constants.ENDPOINT} has no "
            "repo of that name (or it is private: log in with `hf auth login` "
            "or set HF_TOKEN)"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        if constants.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE is set"
        else:
            why = f"{constants.ENDPOINT} could not be reached"
        at = f" at revision {revision!r}" if revision else ""
        raise HubError(
            f"{name}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and {why}"
        ) from None
    except EntryNotFoundError as e:
        raise HubError(f"{name}: {_one_line(e)}") from None
    except HfHubHTTPError as e:
        raise HubError(f"{name}: the hub answered {_one_line(e)}") from None
    except (OSError, ValueError, RuntimeError) as e:
        raise HubError(f"{name}: download failed: {_one_line(e)}") from None
    except Exception as e:  # the HTTP client's own errors (connection lost, ...)
        raise HubError(
            f"{name}: download interrupted ({type(e).__name__}: {_one_line(e)}); "
            "run the command again to resume it"
        ) from None


def _one_line(error: BaseException) -> str:
    """The error's text on one line (huggingface_hub's span several)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines) if lines else type(error).__name__
