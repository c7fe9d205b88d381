"""A DFlash drafter from its directory: ``config.json`` and safetensors
files (bf16, f16 or f32), every tensor checked against the module's shapes
before any is used, optionally quantised in memory.

The files read are recorded on the model (``models.identity``): kept
states and chat sessions key on their contents.

Files are untrusted input: a missing, unreadable or ill-shaped tensor is an
:class:`~mlx_spec.errors.InputError` naming it, on one line.
"""

import json
import warnings
from pathlib import Path
from typing import Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...errors import InputError, one_line
from ..identity import record_sources, weight_files
from .config import fit_to_target, parse_config
from .model import DFlashDraftModel, target_dims

FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
QUANTIZE_BITS = (4, 8)
GROUP_SIZE = 64  # mlx's default affine group


def read_config(directory: Path) -> dict:
    file = directory / "config.json"
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise InputError(f"drafter {directory}: no config.json") from None
    except (OSError, ValueError) as e:
        raise InputError(f"drafter {file}: unreadable ({one_line(e)})") from None


def read_tensors(directory: Path) -> Dict[str, mx.array]:
    """Every tensor of the directory's ``*.safetensors`` files (a name in two
    files is refused: which one counts would be a guess)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InputError(f"drafter {directory}: no .safetensors file")
    tensors: Dict[str, mx.array] = {}
    for file in files:
        try:
            loaded = mx.load(str(file))
        except Exception as e:  # mlx raises several kinds for a broken file
            raise InputError(f"drafter {file}: unreadable ({one_line(e)})") from None
        for name, value in loaded.items():
            if name in tensors:
                raise InputError(f"drafter {directory}: tensor {name} is in two files")
            tensors[name] = value
    return tensors


def check_tensors(
    tensors: Dict[str, mx.array], model: DFlashDraftModel, where: str
) -> Dict[str, mx.array]:
    """The tensors ``model`` needs, each with its expected shape and a float
    dtype; extras are ignored with a warning."""
    expected = {name: p.shape for name, p in tree_flatten(model.parameters())}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{where}: tensor {missing[0]} is missing{more}")
    for name, shape in expected.items():
        value = tensors[name]
        if tuple(value.shape) != tuple(shape):
            raise InputError(
                f"{where}: tensor {name} has shape {list(value.shape)}, "
                f"expected {list(shape)}"
            )
        if value.dtype not in FLOAT_DTYPES:
            raise InputError(
                f"{where}: tensor {name} has dtype {value.dtype}; expected "
                "bfloat16, float16 or float32"
            )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        warnings.warn(
            f"{where}: {len(extra)} tensor(s) not used by a DFlashDraftModel "
            f"ignored (first: {extra[0]})",
            stacklevel=3,
        )
    return {name: tensors[name] for name in expected}


def quantize(model: DFlashDraftModel, bits: int, group_size: int = GROUP_SIZE):
    """Affine ``bits``-bit quantisation of the drafter's linear layers, in
    place; a layer whose input width is no multiple of ``group_size`` stays
    as it is (MLX quantises whole groups of a row)."""
    if bits not in QUANTIZE_BITS:
        raise InputError(f"drafter quantize={bits!r}: expected one of {QUANTIZE_BITS}")
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda _, m: isinstance(m, nn.Linear)
        and m.weight.shape[-1] % group_size == 0,
    )
    return model


def load_dflash(
    directory: Union[str, Path], target, quantize_bits: Optional[int] = None
) -> DFlashDraftModel:
    """The drafter in local ``directory``, checked against and bound to
    ``target`` (a loaded model), its weights evaluated; ``quantize_bits``
    (4 or 8): quantised in memory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"drafter {directory}: not a directory")
    if quantize_bits is not None and quantize_bits not in QUANTIZE_BITS:
        raise InputError(
            f"drafter quantize={quantize_bits!r}: expected one of {QUANTIZE_BITS}"
        )
    where = f"drafter {directory / 'config.json'}"
    config = fit_to_target(
        parse_config(read_config(directory), where), target_dims(target), where
    )
    model = DFlashDraftModel(config)
    tensors = check_tensors(read_tensors(directory), model, f"drafter {directory}")
    model.load_weights(list(tensors.items()))
    if quantize_bits is not None:
        quantize(model, quantize_bits)
    model.eval()
    mx.eval(model.parameters())
    # Its identity (what kept states key on) is then its files' contents,
    # with the parameters' shapes as quantised here.
    record_sources(model, weight_files(directory))
    return model.bind(target)
