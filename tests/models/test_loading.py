"""mlx_spec.load: half-precision MoE checkpoints on the CPU."""

import threading

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

import mlx_spec
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.reference import reference_tokens, spec_tokens

on_cpu = pytest.mark.skipif(
    mx.default_device() != mx.cpu, reason="the upcast applies on the CPU only"
)


def _dtypes(module):
    return {v.dtype for _, v in tree_flatten(module.parameters())}


@on_cpu
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_bfloat16_moe_is_upcast_and_decodes_losslessly(tmp_path, family):
    path = write_tiny_checkpoint(tmp_path, family, dtype="bfloat16")
    model, tok = mlx_spec.load(path)
    assert _dtypes(model) == {mx.float32}
    assert _dtypes(model.mtp_head) == {mx.float32}
    # the same function as mlx-lm's bfloat16 weights, widened
    plain, _ = mlx_lm.load(str(path))
    plain.set_dtype(mx.float32)
    x = mx.array([[5, 9, 2, 7, 11]])
    assert mx.array_equal(model(x), plain(x))
    want = reference_tokens(plain, tok, [3, 8, 1, 6], max_tokens=12)
    assert spec_tokens(model, tok, [3, 8, 1, 6], max_tokens=12, draft="mtp") == want


@on_cpu
def test_dense_and_float32_checkpoints_are_left_as_stored(tmp_path):
    dense = write_tiny_checkpoint(tmp_path / "dense", "qwen3_5", dtype="bfloat16")
    model, _ = mlx_spec.load(dense)
    assert mx.bfloat16 in _dtypes(model)  # runs on the CPU as is: no upcast
    moe = write_tiny_checkpoint(tmp_path / "moe", "qwen3_next", dtype="float32")
    model, _ = mlx_spec.load(moe)
    assert _dtypes(model) == {mx.float32}


@on_cpu
def test_upcast_model_decodes_on_another_thread(tmp_path):
    # The server decodes on an engine thread; a cast left lazy on the loading
    # thread's stream failed there ("There is no Stream(cpu, 0) in current thread").
    path = write_tiny_checkpoint(tmp_path, "qwen3_next", dtype="bfloat16")
    model, tok = mlx_spec.load(path)
    want = spec_tokens(model, tok, [3, 8, 1, 6], max_tokens=8, draft="none")
    got, errors = [], []

    def decode():
        try:
            got.extend(spec_tokens(model, tok, [3, 8, 1, 6], max_tokens=8, draft="mtp"))
        except Exception as e:  # reported below, with the thread's error
            errors.append(e)

    worker = threading.Thread(target=decode)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive() and not errors, errors
    assert got == want
