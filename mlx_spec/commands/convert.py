"""``mlx_spec convert``: write the MTP sidecar ``mtp.safetensors`` for an MLX model.

mlx-lm's conversion (and so every mlx-community checkpoint) drops the
``mtp.*`` tensors. This command reads them from the raw Hugging Face checkpoint
(only the shards that hold them), sanitises them once (``+1`` on the seven
zero-centred norms, experts stacked for ``SwitchGLU``) and writes them next to
the MLX model, with metadata saying they are sanitised and which model they
belong to. ``mlx_spec.load(MLX_DIR)`` then attaches the head.

``--hf-path`` may also be an MLX directory that already has a sidecar: its
weights are copied (re-cast / re-quantised) without a second shift. It may
be a Hugging Face repo id (the whole checkpoint is downloaded).

``--mtp-from REPO_OR_DIR`` instead reads only the MTP tensors: from a repo,
HTTP range reads of the shards that hold them (:mod:`mlx_spec.hub.mtp_fetch`);
``--mlx-path`` must then be an existing MLX model directory.
"""

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from .. import mlx_lm_compat
from ..hub.resolve import is_repo_id, resolve_model
from ..models.fingerprint import signature_to_text, weight_signature
from ..models.mtp.attach import build_head, load_mtp_weights
from ..hub.mtp_fetch import fetch_mtp_checkpoint
from ..models.mtp.weights import (
    PREFIX,
    SIDECAR_NAME,
    SIGNATURE_KEY,
    MTPWeightsError,
    args_from_config,
    config_fingerprint,
    load_config,
    model_metadata,
    write_sidecar,
)
from ..errors import InputError, one_line
from ..model_files import check_model_files
from .common import BAD_INPUT

MTP_DTYPES = ("bfloat16", "float16", "float32")
MTP_BITS = (4, 8)
TARGET_DTYPES = ("float16", "bfloat16", "float32")  # mlx_lm.convert's choices

_FOUR_BIT_HELP = (
    "allow --mtp-bits 4. Refused by default: the head is one small layer whose "
    "draft acceptance is very sensitive to weight error, and 4-bit weights "
    "destroy most of it while saving almost no memory next to the target"
)


def _identity(model_type: str, args) -> str:
    return f"{model_type}, hidden_size={args.hidden_size}, vocab_size={args.vocab_size}"


def convert(
    hf_path,
    mlx_path,
    mtp_dtype: str = "bfloat16",
    mtp_bits: Optional[int] = None,
    mtp_group_size: int = 64,
    force_4bit: bool = False,
    quantize: bool = False,
    q_bits: Optional[int] = None,
    q_group_size: Optional[int] = None,
    dtype: Optional[str] = None,
    progress: bool = True,
    revision: Optional[str] = None,
    mtp_only: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Write ``mlx_path/mtp.safetensors`` from ``hf_path``; returns its path.

    ``hf_path``: a directory or a Hugging Face repo id (at ``revision``).
    ``mtp_only`` (``--mtp-from``): of a repo only the MTP tensors are
    fetched, and ``mlx_path`` must already hold the model. Otherwise, when
    ``mlx_path`` has no model yet, the target is converted first with
    ``mlx_lm.convert`` (``quantize``, ``q_bits``, ``q_group_size``, ``dtype``
    are passed to it).
    """
    if mtp_dtype not in MTP_DTYPES:
        raise ValueError(f"mtp_dtype must be one of {MTP_DTYPES}, got {mtp_dtype!r}")
    if mtp_bits is not None and mtp_bits not in MTP_BITS:
        raise ValueError(f"mtp_bits must be one of {MTP_BITS}, got {mtp_bits!r}")
    if mtp_bits == 4 and not force_4bit:
        raise ValueError(
            "refusing to quantise the MTP head to 4 bits (it destroys draft "
            "acceptance); use --mtp-bits 8, or --force-4bit to do it anyway"
        )
    if dtype is not None and dtype not in TARGET_DTYPES:
        raise ValueError(f"dtype must be one of {TARGET_DTYPES}, got {dtype!r}")
    flag = "--mtp-from" if mtp_only else "--hf-path"
    out = Path(mlx_path)
    if mtp_only and not (out / "config.json").exists():
        raise FileNotFoundError(
            f"--mlx-path {str(out)!r} has no config.json: --mtp-from writes only "
            "the MTP sidecar into an existing MLX model directory"
        )
    hf, source_name = _source_dir(hf_path, revision, mtp_only, progress, log, flag)
    config = load_config(hf)
    model_type = config.get("model_type")
    args = args_from_config(config)

    found = load_mtp_weights(hf, args, model_type, progress=progress)
    if found is None:
        raise MTPWeightsError(
            f"{hf} has no MTP weights (no mtp.* tensors, no {SIDECAR_NAME}); "
            "--hf-path must be the raw Hugging Face checkpoint"
        )
    weights, src_bits, src_group, source = found

    if not (out / "config.json").exists():
        if out.exists() and any(out.iterdir()):
            raise FileNotFoundError(f"--mlx-path {str(out)!r} has no config.json")
        if out.exists():
            out.rmdir()  # mlx_lm.convert insists on creating the directory
        mlx_lm_compat.convert(
            str(hf),
            str(out),
            quantize=quantize,
            q_bits=q_bits,
            q_group_size=q_group_size,
            dtype=dtype,
        )
    out_config = load_config(out)
    out_type = out_config.get("model_type")
    out_args = args_from_config(out_config)
    if config_fingerprint(out_type, out_args) != config_fingerprint(model_type, args):
        raise MTPWeightsError(
            f"--mlx-path {out} ({_identity(out_type, out_args)}) is not the model "
            f"of --hf-path {hf} ({_identity(model_type, args)})"
        )

    head = build_head(args, model_type, weights, source, src_bits, src_group)
    if src_bits:
        mlx_lm_compat.dequantize_model(head)
    target = getattr(mx, mtp_dtype)
    head.update(
        tree_map(
            lambda v: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v,
            head.parameters(),
        )
    )
    if mtp_bits:
        nn.quantize(
            head,
            group_size=mtp_group_size,
            bits=mtp_bits,
            class_predicate=lambda p, m: hasattr(m, "to_quantized")
            and m.weight.shape[-1] % mtp_group_size == 0,
        )
    tensors = {PREFIX + k: v for k, v in tree_flatten(head.parameters())}
    converted, _ = mlx_lm_compat.load(str(out), lazy=True)  # as loaders see it
    metadata = {
        **model_metadata(model_type, args),
        SIGNATURE_KEY: signature_to_text(weight_signature(converted)),
        "mlx_spec.dtype": mtp_dtype,
        "mlx_spec.bits": str(mtp_bits or 0),
        "mlx_spec.group_size": str(mtp_group_size),
        "mlx_spec.source": source_name,
    }
    return write_sidecar(out / SIDECAR_NAME, tensors, metadata)


def _source_dir(name, revision, mtp_only: bool, progress: bool, log, flag: str):
    """``(directory, name to record)`` of the checkpoint ``name``: a local
    directory, the repo's fetched MTP tensors (``mtp_only``) or its download."""
    path = Path(name)
    if path.is_dir():
        return path, path.name
    if path.exists() or not is_repo_id(str(name)):
        state = "is not a directory" if path.exists() else "does not exist"
        raise FileNotFoundError(f"{flag} {str(name)!r} {state}")
    if not mtp_only:
        return resolve_model(str(name), revision, what=flag), str(name)
    fetched = fetch_mtp_checkpoint(str(name), revision, progress=progress, log=log)
    where = f"{name}@{fetched.commit[:12]}"
    shards = f"{', '.join(fetched.shards)} ({_size(fetched.shard_bytes)} in all)"
    if fetched.bytes_fetched == 0:
        log(f"{where}: MTP tensors of {shards} already fetched ({fetched.directory})")
    else:
        how = "whole shard" if fetched.whole_shards else "range reads"
        log(
            f"{where}: fetched {_size(fetched.bytes_fetched)} ({how}) for the MTP "
            f"tensors of {shards}"
        )
    return fetched.directory, str(name)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_spec convert",
        description=(
            "Write mtp.safetensors (the sanitised MTP head) into an MLX model "
            "directory, from the raw Hugging Face checkpoint."
        ),
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--hf-path",
        help="raw Hugging Face checkpoint (holding the mtp.* tensors): a "
        "directory or a repo id (downloaded whole)",
    )
    source.add_argument(
        "--mtp-from",
        metavar="REPO_OR_DIR",
        help="raw checkpoint to take only the MTP tensors from: a repo id "
        "(HTTP range reads of just those bytes) or a directory; --mlx-path "
        "must already hold the MLX model",
    )
    p.add_argument(
        "--revision",
        default=None,
        help="branch, tag or commit of a repo id (default: main)",
    )
    p.add_argument(
        "--mlx-path",
        required=True,
        help="MLX model directory (e.g. from mlx_lm.convert or mlx-community); "
        "converted from --hf-path with mlx_lm.convert when it does not exist",
    )
    p.add_argument(
        "--mtp-dtype",
        choices=MTP_DTYPES,
        default="bfloat16",
        help="dtype of the head's weights (default: bfloat16)",
    )
    p.add_argument(
        "--mtp-bits",
        type=int,
        choices=MTP_BITS,
        default=None,
        help="quantise the head's linear layers to this many bits (8 is safe)",
    )
    p.add_argument(
        "--mtp-group-size", type=int, default=64, help="quantisation group size"
    )
    p.add_argument("--force-4bit", action="store_true", help=_FOUR_BIT_HELP)
    g = p.add_argument_group("target conversion (only when --mlx-path does not exist)")
    g.add_argument("-q", "--quantize", action="store_true", help="quantise the target")
    g.add_argument("--q-bits", type=int, default=None, help="target bits")
    g.add_argument("--q-group-size", type=int, default=None, help="target group size")
    g.add_argument("--dtype", choices=TARGET_DTYPES, default=None, help="target dtype")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.mtp_bits == 4 and not a.force_4bit:
        parser.error(
            "--mtp-bits 4 destroys the head's draft acceptance; use --mtp-bits 8 "
            "or add --force-4bit"
        )
    source = a.hf_path or a.mtp_from
    try:
        if a.hf_path and Path(a.hf_path).is_dir():
            check_model_files(Path(a.hf_path))
        path = convert(
            source,
            a.mlx_path,
            mtp_dtype=a.mtp_dtype,
            mtp_bits=a.mtp_bits,
            mtp_group_size=a.mtp_group_size,
            force_4bit=a.force_4bit,
            quantize=a.quantize,
            q_bits=a.q_bits,
            q_group_size=a.q_group_size,
            dtype=a.dtype,
            progress=not a.no_progress,
            revision=a.revision,
            mtp_only=a.mtp_from is not None,
        )
    except (InputError, MTPWeightsError, OSError, ValueError) as e:
        print(f"mlx_spec convert: {one_line(e)}", file=sys.stderr)
        return BAD_INPUT
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
