"""The norm shift of an MTP head, decided once per head from the strongest
evidence (a manifest, mlx-spec's metadata, a release's shards, the norm
values): a head shifted twice, half shifted, or with ambiguous norms or an
unknown manifest format is refused by name."""

import re

import mlx.core as mx
import numpy as np
import pytest

import mlx_spec
from mlx_spec.models.mtp import (
    MTP_NORMS,
    MTPDisabledWarning,
    MTPWeightsError,
    find_mtp_weights,
)
from mlx_spec.models.mtp.head import text_args
from mlx_spec.testing.mtp_layouts import (
    target_copy,
    assert_same_bits,
    head_params,
    raw_head,
    shift_norms,
    write_head,
    write_target,
)


@pytest.fixture(scope="module")
def targets(tmp_path_factory, save_mlx_dir):
    """family -> (raw dir, mlx-community style dir without a head, its model),
    for the one family these tests use."""
    root = tmp_path_factory.mktemp("norm_shift")
    raw, mlx = write_target(root, "qwen3_5_moe", save_mlx_dir)
    return {"qwen3_5_moe": (raw, mlx, mlx_spec.load(mlx)[0])}


@pytest.mark.parametrize(
    "metadata, manifest",
    [
        (None, None),  # the values decide
        ({"mlx_spec.sanitized": "true"}, None),  # metadata says shifted
        (None, {"rmsnorm_weight_format": "mlx_gamma"}),  # a manifest says so
    ],
)
def test_double_shifted_head_is_refused(targets, tmp_path, metadata, manifest):
    raw, d, model = target_copy(targets, tmp_path)
    twice = shift_norms(raw_head(raw), 2.0)
    where = "mtp_dir" if manifest else "sidecar"
    path = write_head(d, twice, where=where, metadata=metadata, manifest=manifest)
    with pytest.raises(MTPWeightsError, match="applied twice"):
        find_mtp_weights(d, text_args(model), "qwen3_5_moe")
    # found with the model: the model loads without its head, naming the file
    with pytest.warns(MTPDisabledWarning, match=re.escape(str(path))):
        assert mlx_spec.load(d)[0].mtp_head is None


def test_release_checkpoint_already_shifted_is_refused(targets, tmp_path):
    """``mtp.*`` in a release's shards are zero-centred; shifted ones would
    get a second +1, which the check of the result catches."""
    raw, d, model = target_copy(targets, tmp_path)
    write_head(d, shift_norms(raw_head(raw)), where="shards")
    with pytest.raises(MTPWeightsError, match="applied twice"):
        find_mtp_weights(d, text_args(model), "qwen3_5_moe")


# mlx-lm's suffix list would shift only these four of the seven.
_SUFFIX_NORMS = [n for n in MTP_NORMS if n.startswith("mtp.layers.")]


@pytest.mark.parametrize("metadata", [None, {"mlx_spec.sanitized": "true"}])
def test_half_shifted_head_is_refused(targets, tmp_path, metadata):
    raw, d, model = target_copy(targets, tmp_path)
    half = shift_norms(raw_head(raw), 1.0, _SUFFIX_NORMS)
    write_head(d, half, metadata=metadata)
    match = "values disagree" if metadata is None else "still be zero-centred"
    with pytest.raises(MTPWeightsError, match=match) as e:
        find_mtp_weights(d, text_args(model), "qwen3_5_moe")
    assert "pre_fc_norm_embedding" in str(e.value)  # names the norms


def test_ambiguous_norm_values_are_refused(targets, tmp_path):
    """Norms that are neither clearly zero-centred nor clearly gammas."""
    raw, d, model = target_copy(targets, tmp_path)
    tensors = shift_norms(raw_head(raw))
    name = "mtp.norm.weight"
    v = np.abs(np.array(tensors[name])) + 0.3
    v[:3] = -0.1  # 3 of 64 negative: 5%, between the two kinds
    tensors[name] = mx.array(v)
    write_head(d, tensors)
    with pytest.raises(
        MTPWeightsError, match="cannot tell whether .*norm look unclear"
    ):
        find_mtp_weights(d, text_args(model), "qwen3_5_moe")


def test_unknown_manifest_format_is_refused(targets, tmp_path):
    raw, d, model = target_copy(targets, tmp_path)
    manifest = {"rmsnorm_weight_format": "something_else"}
    write_head(d, raw_head(raw), where="mtp_dir", manifest=manifest)
    with pytest.raises(MTPWeightsError, match="rmsnorm_weight_format='something_else'"):
        find_mtp_weights(d, text_args(model), "qwen3_5_moe")


def test_mlx_spec_sidecar_is_decided_by_its_metadata(converted_dirs):
    raw, mlx = converted_dirs["qwen3_5"]
    model = mlx_spec.load(mlx)[0]
    assert model.mtp_info.shift.evidence == "mlx-spec metadata"
    assert model.mtp_info.signed and not model.mtp_info.shift.add_one
    raw_model = mlx_spec.load(raw)[0]
    assert raw_model.mtp_info.shift.evidence.startswith("release checkpoint")
    assert_same_bits(
        head_params(model.mtp_head), head_params(raw_model.mtp_head), "convert"
    )
