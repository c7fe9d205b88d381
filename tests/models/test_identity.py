"""A model's identity (mlx_spec.models.identity): every byte of every weight
counts (a fine-tune of one layer, adapters, the MTP head's file), a copy of
the same files is the same model, a second load reads no weight file, and
what is keyed on the model (verify-cost profiles) follows it."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

import mlx_spec
from mlx_spec.core import verify_profile
from mlx_spec.models import identity
from mlx_spec.models.identity import head_fingerprint, model_fingerprint
from mlx_spec.testing.checkpoints import fine_tune_copy


def write_adapters(model_dir, out, seed: int):
    """LoRA adapters for the last two layers of the model in ``model_dir``,
    with random (non-zero) weights, as mlx_lm.lora saves them."""
    model, _ = mlx_lm.load(str(model_dir))
    params = {"rank": 4, "scale": 4.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(seed)
    lora = {
        name: mx.random.normal(w.shape) * 0.1
        for name, w in tree_flatten(model.parameters())
        if name.endswith(("lora_a", "lora_b"))
    }
    assert lora
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), lora)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tiny(checkpoint_dirs):
    return checkpoint_dirs["qwen3_next"]


def test_one_changed_layer_is_another_model(tiny, tmp_path):
    base, _ = mlx_spec.load(tiny)
    changed = fine_tune_copy(tiny, tmp_path / "ft")
    tuned, _ = mlx_spec.load(tmp_path / "ft")
    assert "layers.3" in changed
    assert model_fingerprint(tuned) != model_fingerprint(base)
    # a copy of the same files is the same model, wherever it lies
    shutil.copytree(tiny, tmp_path / "copy")
    copy, _ = mlx_spec.load(tmp_path / "copy")
    assert model_fingerprint(copy) == model_fingerprint(base)
    assert head_fingerprint(copy) == head_fingerprint(base)


def test_adapters_are_part_of_the_model(tiny, tmp_path):
    base, _ = mlx_spec.load(tiny)
    one = write_adapters(tiny, tmp_path / "one", seed=1)
    two = write_adapters(tiny, tmp_path / "two", seed=2)
    with_one, _ = mlx_spec.load(tiny, adapter_path=str(one))
    with_two, _ = mlx_spec.load(tiny, adapter_path=str(two))
    again, _ = mlx_spec.load(tiny, adapter_path=str(one))
    prints = [model_fingerprint(m) for m in (base, with_one, with_two)]
    assert len(set(prints)) == 3
    assert model_fingerprint(again) == prints[1]


def test_another_mtp_head_file_is_another_head(tmp_path, tiny):
    """A model whose head comes from a sidecar: changing one of the head's
    tensors changes the head's identity, not the target's."""
    from mlx_spec.commands.convert import main as convert_main

    convert_main(["--hf-path", str(tiny), "--mlx-path", str(tmp_path / "mlx")])
    sidecar = tmp_path / "mlx" / "mtp.safetensors"
    assert sidecar.exists()
    model, _ = mlx_spec.load(tmp_path / "mlx")
    head = head_fingerprint(model)
    assert head
    shutil.copytree(tmp_path / "mlx", tmp_path / "other")
    tensors, meta = mx.load(
        str(tmp_path / "other" / sidecar.name), return_metadata=True
    )
    name = next(n for n in sorted(tensors) if n.endswith("fc.weight"))
    tensors[name] = tensors[name] * 1.5
    mx.save_safetensors(str(tmp_path / "other" / sidecar.name), tensors, meta)
    other, _ = mlx_spec.load(tmp_path / "other")
    assert head_fingerprint(other) != head
    assert head_fingerprint(mlx_spec.load(tmp_path / "mlx")[0]) == head


def test_a_model_not_loaded_from_files_is_identified_by_its_bytes(tiny):
    """mlx-lm's own load (no source files recorded) and a model quantized in
    memory after loading: the parameters themselves are hashed."""
    plain, _ = mlx_lm.load(str(tiny))
    before = model_fingerprint(plain)
    assert model_fingerprint(plain) == before  # remembered, and stable
    again, _ = mlx_lm.load(str(tiny))
    layer = again.model.layers[3].self_attn.o_proj
    layer.weight = layer.weight * 1.5
    assert model_fingerprint(again) != before
    loaded, _ = mlx_spec.load(tiny)
    from_files = model_fingerprint(loaded)
    nn.quantize(loaded, group_size=32, bits=8)
    assert model_fingerprint(loaded) != from_files


def test_a_second_load_reads_the_digest_cache(tmp_path, tiny, monkeypatch):
    """The digest of a file is read from the cache while the file's size,
    times and inode are unchanged, and computed again once it is written."""
    monkeypatch.setenv("MLX_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    shutil.copytree(tiny, tmp_path / "m")
    shard = tmp_path / "m" / "model.safetensors"
    (digest,) = identity.file_digests([shard])
    cached = json.loads(identity.digest_cache_file().read_text())
    (key,) = [k for k, v in cached.items() if v == digest]
    # a planted digest is believed: the file was not read again
    cached[key] = "f" * 64
    identity.digest_cache_file().write_text(json.dumps(cached))
    assert identity.file_digests([shard]) == ["f" * 64]
    # a write (same bytes, so same size) changes its change time: read again
    shard.write_bytes(shard.read_bytes())
    assert identity.file_digests([shard]) == [digest]


def test_a_hub_blob_is_named_by_its_digest(tmp_path):
    """A file in the Hugging Face cache is a link to a blob named by the
    SHA-256 of its bytes: that name is its digest, nothing is read."""
    data = b"weights"
    import hashlib

    name = hashlib.sha256(data).hexdigest()
    blobs = tmp_path / "models--a--b" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / name).write_bytes(data)
    snapshot = tmp_path / "models--a--b" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(blobs / name)
    assert identity.file_digests([snapshot / "model.safetensors"]) == [name]
    # the same bytes outside the hub's cache have the same digest
    (tmp_path / "plain.safetensors").write_bytes(data)
    assert identity.file_digests([tmp_path / "plain.safetensors"]) == [name]


def test_the_verify_profile_follows_the_weights(tiny, tmp_path):
    base, _ = mlx_spec.load(tiny)
    fine_tune_copy(tiny, tmp_path / "ft")
    tuned, _ = mlx_spec.load(tmp_path / "ft")
    key = verify_profile._profile_key
    assert key(base, 9, 0) != key(tuned, 9, 0)
    assert key(base, 9, 0) == key(mlx_spec.load(tiny)[0], 9, 0)
