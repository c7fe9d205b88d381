"""Finding a model's MTP weights wherever the ecosystem puts them.

:func:`find_mtp_weights` looks, in this order, and takes the first found:

1. ``mtp.*`` tensors (any prefix of :data:`~.layouts.MTP_PREFIXES`) in the
   model's own shards, located through ``model.safetensors.index.json``'s
   ``weight_map`` (or the shards' headers when there is no index);
2. a sidecar: ``mtp.safetensors`` (or sharded, ``mtp-XXXXX-of-YYYYY`` files
   named by ``mtp.safetensors.index.json``), ``model-mtp.safetensors``,
   ``mtp/weights.safetensors``, then the file ``config.json`` names in
   ``mlx_lm_extra_tensors.mtp_file``.

A path given explicitly (``mtp_path``: a file, an index, or a directory
searched as above) comes before all of them. What was found is returned with
an :class:`MTPWeightsInfo` saying which files, which layout, and which
evidence decided the norms' ``+1`` (:mod:`.norm_shift`).
"""

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Dict, List, Optional, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_flatten

from .layouts import (
    FP8_BLOCK,
    LayoutInfo,
    affine_quantization,
    canonical_tensors,
    describe_quantization,
    mtp_prefix,
)
from .norm_shift import (
    EVIDENCE_MANIFEST,
    EVIDENCE_METADATA,
    EVIDENCE_RELEASE,
    ShiftDecision,
    apply_shift,
    decide_shift,
)
from .weights import (
    SIDECAR_NAME,
    MTPWeightsError,
    check_sidecar_model,
    load_config,
)

MODEL_INDEX = "model.safetensors.index.json"
SIDECAR_INDEX = "mtp.safetensors.index.json"
SIDECAR_SHARDS = "mtp-*-of-*.safetensors"
# Sidecar files, in the order they are looked for (after the model's shards).
SIDECAR_FILES = (SIDECAR_NAME, "model-mtp.safetensors", "mtp/weights.safetensors")
MANIFEST = "mtp/manifest.json"
# File names of sidecars at the top of a model directory (glob patterns).
MTP_SIDECAR_PATTERNS = (SIDECAR_NAME, "model-mtp.safetensors", SIDECAR_SHARDS)
# A manifest's rmsnorm_weight_format that says the norms are already shifted.
SHIFTED_FORMATS = ("mlx_gamma",)


@dataclass(frozen=True)
class MTPFiles:
    """Where a head was found: its files and how they were found."""

    files: Tuple[Path, ...]
    found_as: str  # "model shards" or the sidecar's name / how it was named
    in_model_shards: bool


@dataclass(frozen=True)
class MTPWeightsInfo:
    """What :func:`find_mtp_weights` read (for the one-line report)."""

    files: Tuple[str, ...]
    found_as: str
    layout: LayoutInfo
    quantization: Dict[str, Tuple[int, int]]  # layer -> (bits, group size)
    shift: ShiftDecision
    signed: bool  # carries mlx-spec's weight signature, checked against the model

    @property
    def bits(self) -> int:
        """The widest quantised layer's bits; 0 when nothing is quantised."""
        return max((b for b, _ in self.quantization.values()), default=0)

    @property
    def group_size(self) -> int:
        return max((g for _, g in self.quantization.values()), default=64)

    def describe(self) -> str:
        """One line: file(s), layout, storage, norm shift."""
        files = (
            self.files[0]
            if len(self.files) == 1
            else (f"{len(self.files)} files in {Path(self.files[0]).parent}")
        )
        storage = describe_quantization(self.quantization) or self.layout.dtype
        if self.layout.fp8:
            storage = "FP8 e4m3, dequantised to bfloat16"
        return (
            f"MTP head: {files} ({self.found_as}; keys {self.layout.prefix}*, "
            f"experts {self.layout.experts}, {storage}; {self.shift.describe()})"
        )


# ---------------------------------------------------------------- locating


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MTPWeightsError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise MTPWeightsError(f"{path} is not a JSON object")
    return value


def _weight_map(index: Path) -> Dict[str, str]:
    weight_map = _json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(f, str) for f in weight_map.values()
    ):
        raise MTPWeightsError(f"{index}: no weight_map of tensor -> file names")
    return weight_map


def _inside(model_dir: Path, name: str, named_by: str) -> Path:
    """``model_dir / name``, refusing names that leave the directory.

    Judged on the name, not on where links point: a Hugging Face cache's
    snapshot files are links into its blob store."""
    relative = PurePosixPath(name.replace("\\", "/"))
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise MTPWeightsError(f"{named_by} names {name!r}, outside {model_dir}")
    return model_dir / relative


def model_shards_with_mtp(model_dir: Path) -> List[Path]:
    """The model's own shards that hold MTP tensors (any prefix)."""
    model_dir = Path(model_dir)
    index = model_dir / MODEL_INDEX
    if index.exists():
        files = sorted(
            {f for n, f in _weight_map(index).items() if mtp_prefix(n) is not None}
        )
        return [_inside(model_dir, f, str(index)) for f in files]
    from safetensors import safe_open

    found = []
    for file in sorted(model_dir.glob("model*.safetensors")):
        if file.name in SIDECAR_FILES:
            continue
        try:
            with safe_open(str(file), framework="numpy") as f:
                names = list(f.keys())
        except Exception as e:  # a broken shard: mlx-lm's load names it
            raise MTPWeightsError(f"{file}: unreadable safetensors ({e})") from None
        if any(mtp_prefix(n) is not None for n in names):
            found.append(file)
    return found


def _sidecar_at(path: Path, found_as: str) -> Optional[MTPFiles]:
    if path.name.endswith(".index.json"):
        shards = sorted(set(_weight_map(path).values()))
        files = [_inside(path.parent, f, str(path)) for f in shards]
        return MTPFiles(tuple(files), found_as, False)
    return MTPFiles((path,), found_as, False)


def configured_mtp_file(model_dir: Path, config: dict) -> Optional[Path]:
    """The file ``config.json`` names in ``mlx_lm_extra_tensors.mtp_file``."""
    extra = config.get("mlx_lm_extra_tensors")
    if extra is None:
        return None
    name = extra.get("mtp_file") if isinstance(extra, dict) else None
    if not isinstance(name, str) or not name:
        raise MTPWeightsError(
            f"{model_dir}/config.json: mlx_lm_extra_tensors={extra!r} has no "
            "mtp_file path"
        )
    return _inside(Path(model_dir), name, f"{model_dir}/config.json mtp_file")


def locate_mtp_files(
    model_dir: Path, config: Optional[dict] = None
) -> Optional[MTPFiles]:
    """The first place of the search order that holds a head, or None."""
    model_dir = Path(model_dir)
    shards = model_shards_with_mtp(model_dir)
    if shards:
        return MTPFiles(tuple(shards), "model shards", True)
    if (model_dir / SIDECAR_INDEX).exists():
        return _sidecar_at(model_dir / SIDECAR_INDEX, SIDECAR_INDEX)
    for name in SIDECAR_FILES:
        if (model_dir / name).exists():
            return _sidecar_at(model_dir / name, name)
    if config is None and (model_dir / "config.json").exists():
        config = load_config(model_dir)
    configured = configured_mtp_file(model_dir, config or {})
    if configured is not None:
        if not configured.exists():
            raise MTPWeightsError(
                f"{model_dir}/config.json mlx_lm_extra_tensors.mtp_file names "
                f"{configured}, which does not exist"
            )
        return _sidecar_at(configured, "config.json mlx_lm_extra_tensors.mtp_file")
    return None


def hub_file_patterns(config: Optional[dict] = None) -> List[str]:
    """Glob patterns of the sidecar files (and manifest) to fetch beside a
    model; mlx-lm's own download patterns leave them out."""
    patterns = [SIDECAR_INDEX, SIDECAR_SHARDS, *SIDECAR_FILES, MANIFEST]
    extra = (config or {}).get("mlx_lm_extra_tensors")
    if isinstance(extra, dict) and isinstance(extra.get("mtp_file"), str):
        patterns.append(extra["mtp_file"])
    return patterns


# ----------------------------------------------------------------- reading


def _read(files: MTPFiles) -> Tuple[Dict[str, mx.array], List[Dict[str, str]]]:
    tensors, metas = {}, []
    for file in files.files:
        if not file.exists():
            raise MTPWeightsError(f"MTP weights file {file} does not exist")
        try:
            # mx.load is lazy: only the MTP tensors kept here are ever read.
            weights, meta = mx.load(str(file), return_metadata=True)
        except Exception as e:
            raise MTPWeightsError(
                f"{file} is not a readable safetensors file ({e})"
            ) from None
        tensors.update({k: v for k, v in weights.items() if mtp_prefix(k) is not None})
        metas.append(dict(meta or {}))
    return tensors, metas


def _manifest_evidence(files: MTPFiles, model_dir: Path) -> Optional[ShiftDecision]:
    for manifest in (files.files[0].parent / "manifest.json", model_dir / MANIFEST):
        if not manifest.exists():
            continue
        value = _json(manifest).get("rmsnorm_weight_format")
        if value is None:
            continue
        if value not in SHIFTED_FORMATS:
            raise MTPWeightsError(
                f"{manifest}: rmsnorm_weight_format={value!r} is not one this "
                f"version knows ({', '.join(SHIFTED_FORMATS)})"
            )
        return ShiftDecision(False, f"{EVIDENCE_MANIFEST} {manifest.name}: {value}")
    return None


def _shift_evidence(
    files: MTPFiles, metas, prefix: str, model_dir: Path, source: str
) -> Optional[ShiftDecision]:
    """The strongest evidence short of the values (None: only values left)."""
    marks = {m.get("mlx_spec.sanitized") == "true" for m in metas}
    if marks == {True}:
        return ShiftDecision(False, EVIDENCE_METADATA)
    if len(marks) > 1:
        raise MTPWeightsError(f"{source}: some files sanitised by mlx-spec, some not")
    if not files.in_model_shards:
        return _manifest_evidence(files, model_dir)
    if prefix == "mtp." and not any(m.get("format") == "mlx" for m in metas):
        return ShiftDecision(True, EVIDENCE_RELEASE)
    return None


def _fp8_block(config: dict) -> Tuple[int, int]:
    for c in (config, config.get("text_config") or {}):
        q = c.get("quantization_config")
        if isinstance(q, dict) and q.get("weight_block_size") is not None:
            block = q["weight_block_size"]
            if (
                isinstance(block, list)
                and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block)
            ):
                return tuple(block)
            raise MTPWeightsError(f"config.json: weight_block_size={block!r}")
    return FP8_BLOCK


def read_mtp_files(
    files: MTPFiles,
    args,
    model_type: str,
    config: dict,
    model_dir: Path,
    model=None,
) -> Tuple[Dict[str, mx.array], MTPWeightsInfo]:
    """The head's weights in ``files``, canonical and shifted, and the report."""
    from .head import MTPHead  # the head's own shapes for the quantisation

    source = (
        str(files.files[0])
        if len(files.files) == 1
        else (f"{files.files[0].parent} ({files.found_as})")
    )
    raw, metas = _read(files)
    for meta in metas:
        if meta.get("mlx_spec.kind") == "mtp":
            check_sidecar_model(meta, model_type, args, source, model)
    num_experts = getattr(args, "num_experts", 0) or 0
    try:
        tensors, layout = canonical_tensors(
            raw, num_experts, source, _fp8_block(config)
        )
        evidence = _shift_evidence(files, metas, layout.prefix, model_dir, source)
        decision = decide_shift(tensors, source, evidence)
        tensors = apply_shift(tensors, decision)
        float_shapes = {
            k: tuple(v.shape)
            for k, v in tree_flatten(MTPHead(args, model_type).parameters())
        }
        quant = affine_quantization(tensors, float_shapes, source)
    except MTPWeightsError:
        raise
    except (ValueError, RuntimeError, TypeError) as e:
        # what MLX says of tensors no check above foresaw, named by file
        raise MTPWeightsError(f"{source}: {e}") from None
    info = MTPWeightsInfo(
        files=tuple(str(f) for f in files.files),
        found_as=files.found_as,
        layout=layout,
        quantization=quant,
        shift=decision,
        signed=any("mlx_spec.weights" in m for m in metas),
    )
    return tensors, info


def find_mtp_weights(
    model_dir: Union[str, Path],
    args,
    model_type: str,
    mtp_path: Optional[Union[str, Path]] = None,
    model=None,
) -> Optional[Tuple[Dict[str, mx.array], MTPWeightsInfo]]:
    """``(weights, info)`` of the model's MTP head, or None when there is none.

    ``weights`` have the head's parameter names (``mtp.`` + module path),
    experts stacked, FP8 dequantised, affine quantisation as published, the
    norms' ``+1`` applied when the evidence says so. Raises
    :class:`MTPWeightsError` (naming the file) for weights that are found but
    do not fit, and FileNotFoundError for an ``mtp_path`` that does not exist.
    """
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    if mtp_path is not None:
        path = Path(mtp_path)
        if not path.exists():
            raise FileNotFoundError(f"MTP path {str(mtp_path)!r} does not exist")
        if path.is_dir():
            files = locate_mtp_files(path)
            if files is None:
                raise MTPWeightsError(f"no MTP weights in {str(mtp_path)!r}")
        else:
            files = _sidecar_at(path, "given path")
    else:
        files = locate_mtp_files(model_dir, config)
        if files is None:
            return None
    return read_mtp_files(files, args, model_type, config, model_dir, model)
