"""``mlx_spec convert``: write the MTP sidecar ``mtp.safetensors`` for an MLX model.

mlx-lm's conversion (and so every mlx-community checkpoint) drops the
``mtp.*`` tensors. This command reads them from the raw Hugging Face checkpoint
(only the shards that hold them), sanitises them once (``+1`` on the seven
zero-centred norms, experts stacked for ``SwitchGLU``) and writes them next to
the MLX model, with metadata saying they are sanitised and which model they
belong to. ``mlx_spec.load(MLX_DIR)`` then attaches the head.

``--hf-path`` may also be an MLX directory that already has a sidecar: its
weights are copied (re-cast / re-quantised) without a second shift.
"""

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from .. import mlx_lm_compat
from ..models.fingerprint import signature_to_text, weight_signature
from ..models.mtp.attach import build_head, load_mtp_weights
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
from .common import BAD_INPUT, CommandError, check_model_files, one_line

MTP_DTYPES = ("bfloat16", "float16", "float32")
MTP_BITS = (4, 8)

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
) -> Path:
    """Write ``mlx_path/mtp.safetensors`` from ``hf_path``; returns its path.

    When ``mlx_path`` has no model yet, the target is converted first with
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
    hf, out = Path(hf_path), Path(mlx_path)
    if not hf.is_dir():
        raise FileNotFoundError(f"--hf-path {str(hf)!r} is not a directory")
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
        "mlx_spec.source": hf.name,
    }
    return write_sidecar(out / SIDECAR_NAME, tensors, metadata)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_spec convert",
        description=(
            "Write mtp.safetensors (the sanitised MTP head) into an MLX model "
            "directory, from the raw Hugging Face checkpoint."
        ),
    )
    p.add_argument(
        "--hf-path",
        required=True,
        help="raw Hugging Face checkpoint directory (holding the mtp.* tensors)",
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
    g.add_argument("--dtype", default=None, help="target dtype")
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
    try:
        if Path(a.hf_path).is_dir():
            check_model_files(Path(a.hf_path))
        path = convert(
            a.hf_path,
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
        )
    except (CommandError, MTPWeightsError, OSError, ValueError) as e:
        print(f"mlx_spec convert: {one_line(e)}", file=sys.stderr)
        return BAD_INPUT
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
