"""Opening a model named by a local directory or a repo id (what the
commands and the doctor load): checked first, so that a careless directory
is one line naming the file or key, then loaded with its MTP head."""

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from .demo import default_model_path
from .hub.resolve import HubError, is_repo_id, resolve_model, resolve_mtp_path
from .loading import load
from .models.mtp import SIDECAR_NAME
from .models.mtp.discovery import MTP_SIDECAR_PATTERNS
from .errors import InputError, one_line, reported_as


def check_safetensors(file: Path):
    """Raise :class:`InputError` naming ``file`` unless it is a whole
    safetensors file (reads only its header)."""
    try:
        with safe_open(str(file), framework="numpy"):
            pass
    except (OSError, SafetensorError) as e:
        raise InputError(
            f"{file} is not a complete safetensors file ({one_line(e)})"
        ) from None


# What a model directory needs for mlx-lm's tokenizer loading (one of these).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "*.tiktoken",
    "tiktoken.model",
)
# Config fields that size the model: a non-integer fails deep inside mlx-lm.
SIZE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "max_position_embeddings",
    "full_attention_interval",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def check_config_sizes(config: dict, file: Path):
    """Raise :class:`InputError` naming ``file`` and the key for a size
    field (top level or ``text_config``) that is not a non-negative integer."""
    sections = [("", config)]
    if isinstance(config.get("text_config"), dict):
        sections.append(("text_config.", config["text_config"]))
    for where, section in sections:
        for key in SIZE_FIELDS:
            value = section.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(
                    f"{file}: {where}{key}={value!r} is not a non-negative integer"
                )


def check_model_files(path: Path, mtp_path=None):
    """Check what loading reads first: ``config.json`` and every weight file's
    header, so a broken one is named rather than failing deep inside loading."""
    config = path / "config.json"
    try:
        values = json.loads(config.read_text())
        if not isinstance(values, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        raise InputError(f"{path} has no config.json") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{config} is not a valid config: {one_line(e)}") from None
    check_config_sizes(values, config)
    if not any(any(path.glob(p)) for p in TOKENIZER_FILES):
        raise InputError(
            f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
        )
    # MTP sidecars are checked when the head is attached: a broken one only
    # disables MTP drafting.
    files = sorted(
        f
        for f in path.glob("*.safetensors")
        if not any(f.match(p) for p in MTP_SIDECAR_PATTERNS)
    )
    if mtp_path is not None:
        mtp = Path(mtp_path)
        files.append(mtp / SIDECAR_NAME if mtp.is_dir() else mtp)
    for file in files:
        if file.is_file():
            check_safetensors(file)


def load_model(path=None, mtp_path=None, revision=None, **kwargs):
    """``(path, model, tokenizer)``: ``path`` (a directory or a Hugging Face
    repo id at ``revision``; default: the bundled demo model) loaded by
    :func:`mlx_spec.load`; any failure is an :class:`~mlx_spec.errors.InputError`."""
    name = str(path) if path else None  # as given: Path() drops a leading ./
    with reported_as(InputError, FileNotFoundError):
        path = Path(path) if path else default_model_path()
    if name and not path.exists() and is_repo_id(name):
        with reported_as(InputError, HubError):
            path = resolve_model(name, revision)
    if not path.is_dir():
        state = "is not a directory" if path.exists() else "does not exist"
        raise InputError(f"model directory {str(path)!r} {state}")
    if mtp_path is not None:
        with reported_as(InputError, HubError, FileNotFoundError):
            mtp_path = resolve_mtp_path(mtp_path)
    check_model_files(path, mtp_path)
    try:
        model, tokenizer = load(path, mtp_path=mtp_path, **kwargs)
    except Exception as e:  # whatever the files hold, one line naming them
        raise InputError(f"cannot load the model in {path}: {one_line(e)}") from None
    return path, model, tokenizer


def model_name(name, path: Path) -> str:
    """What to call the model loaded from ``path`` for ``--model name``: the
    repo id when it was downloaded, else the directory's name."""
    if name and not Path(name).exists() and is_repo_id(str(name)):
        return str(name)
    return path.name
