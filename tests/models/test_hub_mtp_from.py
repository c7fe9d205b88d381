"""``convert --mtp-from`` (and ``--hf-path``) with a repo id, against a fake
hub on 127.0.0.1: only the MTP tensors' byte ranges fetched (resumed after the
server dies, the whole shard where ranges are refused, a damaged cached fetch
fetched again), checked against the shard's header, and the head written
equal to the raw checkpoint's; failures in one line. The fixtures:
tests/models/conftest.py.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_spec
from mlx_spec.testing.hub_release import (
    LAST_SHARD,
    MLX_REPO,
    RELEASE,
    decode_in_subprocess,
    error_line,
    run_cli,
)

from mlx_spec.testing.hub_repos import shard_name


def _mtp_bytes(shard: Path) -> tuple:
    """(header bytes, MTP tensor bytes) of a local shard."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    mtp = sum(
        v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in header.items()
        if k.startswith("mtp.")
    )
    return 8 + n, mtp


def _head_params(model) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(model.mtp_head.parameters())}


def _same_head(mlx_dir: Path, raw: Path):
    """The head written into ``mlx_dir`` is the raw checkpoint's: every
    parameter and the logits of one forward equal, bit for bit."""
    got, _ = mlx_spec.load(mlx_dir)
    want, _ = mlx_spec.load(raw)
    a, b = _head_params(got), _head_params(want)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    mx.random.seed(0)
    ids = mx.random.randint(0, 300, (1, 9))
    hidden = mx.random.normal((1, 9, got.mtp_head.hidden_size))
    la, _ = got.mtp_head(ids, hidden, got.mtp_head.make_cache())
    lb, _ = want.mtp_head(ids, hidden, want.mtp_head.make_cache())
    assert mx.array_equal(la, lb).item()


def _mtp_from(env, mlx_dir, *extra):
    return run_cli(
        "convert",
        "--mtp-from",
        RELEASE,
        "--mlx-path",
        str(mlx_dir),
        "--mtp-dtype",
        "float32",
        *extra,
        env=env,
    )


@pytest.mark.slow
def test_mtp_from_fetches_only_the_mtp_byte_ranges(hub, env, repos, tmp_path):
    """Of the release only the last shard's header and its MTP tensors' bytes
    cross the wire (the first shard: nothing), and the head written equals
    the one loaded from the full checkpoint."""
    mlx = shutil.copytree(repos["mlx"], tmp_path / "mlx")
    done = _mtp_from(env, mlx)
    assert done.returncode == 0, done.stderr
    header, mtp = _mtp_bytes(repos["raw"] / LAST_SHARD)
    shard = len(hub.repos[RELEASE].files[LAST_SHARD])
    assert hub.sent(RELEASE, shard_name(1, 2)) == 0
    assert hub.sent(RELEASE, LAST_SHARD) == header + mtp
    assert header + mtp < 0.2 * shard
    assert f"fetched {(header + mtp) / 1000:.1f} KB (range reads)" in done.stdout
    _same_head(mlx, repos["raw"])
    # again, offline with the hub stopped: the tensors are in the cache
    hub.stop()
    done = _mtp_from(dict(env, HF_HUB_OFFLINE="1"), mlx)
    assert done.returncode == 0 and "already fetched" in done.stdout, done.stderr


@pytest.mark.slow
def test_mtp_from_resumes_after_the_server_dies(hub, env, repos, tmp_path):
    """The connection drops 30 kB into the MTP tensors: one line, no
    sidecar; the next run fetches only the rest and writes the same head."""
    mlx = shutil.copytree(repos["mlx"], tmp_path / "mlx")
    header, mtp = _mtp_bytes(repos["raw"] / LAST_SHARD)
    hub.die_on, hub.die_after = LAST_SHARD, 30_000
    line = error_line(_mtp_from(env, mlx, "--no-progress"))
    assert LAST_SHARD in line and "again" in line
    assert not (mlx / "mtp.safetensors").exists()
    first = hub.sent(RELEASE, LAST_SHARD)
    assert first == header + 30_000
    hub.die_after = None
    hub.reset_counts()
    done = _mtp_from(env, mlx)
    assert done.returncode == 0, done.stderr
    assert hub.sent(RELEASE, LAST_SHARD) == header + mtp - 30_000
    _same_head(mlx, repos["raw"])


def test_mtp_from_downloads_the_whole_shard_when_ranges_are_refused(
    hub, env, repos, tmp_path
):
    mlx = shutil.copytree(repos["mlx"], tmp_path / "mlx")
    hub.refuse_ranges = True
    done = _mtp_from(env, mlx)
    assert done.returncode == 0, done.stderr
    assert "does not answer range requests" in done.stdout
    assert "(whole shard)" in done.stdout
    assert hub.sent(RELEASE, shard_name(1, 2)) == 0
    _same_head(mlx, repos["raw"])


@pytest.mark.slow
def test_mtp_from_a_repo_without_mtp_tensors_is_one_line(hub, env, repos, tmp_path):
    mlx = shutil.copytree(repos["mlx"], tmp_path / "mlx")
    line = error_line(
        run_cli("convert", "--mtp-from", MLX_REPO, "--mlx-path", str(mlx), env=env)
    )
    assert MLX_REPO in line and "no MTP tensors" in line
    line = error_line(
        run_cli("convert", "--mtp-from", RELEASE, "--mlx-path", str(tmp_path), env=env)
    )
    assert "has no config.json" in line


def test_fetched_tensors_are_checked_against_the_shard_header(tmp_path):
    """A header whose offsets do not fit a tensor's dtype and shape is refused."""
    from mlx_spec.hub.resolve import HubError
    from mlx_spec.hub.mtp_ranges import parse_header

    good = {"mtp.a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    _, tensors = parse_header("x", json.dumps(good).encode(), 200)
    assert (tensors[0].end - tensors[0].start) == 24
    bad = {"mtp.a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}
    with pytest.raises(HubError, match="mtp.a"):
        parse_header("x", json.dumps(bad).encode(), 200)
    with pytest.raises(HubError, match="mtp.a"):  # past the end of the file
        parse_header("x", json.dumps(good).encode(), 30)


def test_the_mtp_byte_ranges_of_a_shard_make_a_file_of_those_tensors(tmp_path):
    """A shard's header -> its MTP tensors in byte order, adjacent ones read
    as one range; those bytes behind the small header load as the tensors."""
    from safetensors.numpy import load_file, save_file

    from mlx_spec.hub.mtp_ranges import (
        byte_runs,
        header_length,
        mtp_tensors,
        parse_header,
        small_header,
    )

    arrays = {
        "model.embed_tokens.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "mtp.fc.weight": np.arange(4, dtype=np.float16),
        "mtp.norm.weight": np.ones(3, dtype=np.float32),
        "z.trunk.weight": np.zeros(5, dtype=np.int8),
    }
    shard = tmp_path / "shard.safetensors"
    save_file(arrays, str(shard))
    data = shard.read_bytes()
    length = header_length("shard", data[:8], len(data))
    meta, tensors = parse_header("shard", data[8 : 8 + length], len(data))
    wanted = mtp_tensors(tensors)
    assert {t.name for t in wanted} == {"mtp.fc.weight", "mtp.norm.weight"}
    assert wanted[0].end <= wanted[1].start  # in the order of their bytes
    runs = byte_runs(wanted)
    assert runs == [(wanted[0].start, wanted[1].end)]  # stored side by side
    small = tmp_path / "small.safetensors"
    body = b"".join(data[a:b] for a, b in runs)
    small.write_bytes(small_header(meta, wanted, "repo@c/shard", "e") + body)
    loaded = load_file(str(small))
    assert sorted(loaded) == ["mtp.fc.weight", "mtp.norm.weight"]
    for name, array in loaded.items():
        assert array.dtype == arrays[name].dtype
        np.testing.assert_array_equal(array, arrays[name])


@pytest.mark.parametrize(
    "named, used",
    [
        ("heads/mtp.safetensors", "heads/mtp.safetensors"),
        ("/etc/passwd", None),
        ("../other/mtp.safetensors", None),
        ("a\\..\\b", None),
        (7, None),
    ],
)
def test_the_config_names_an_mtp_file_only_inside_the_model(tmp_path, named, used):
    """``mlx_lm_extra_tensors.mtp_file`` is untrusted: absolute and ``..``
    paths are ignored (with a warning), never fetched or read."""
    from mlx_spec.hub.resolve import config_mtp_file

    config = {"model_type": "qwen3_5", "mlx_lm_extra_tensors": {"mtp_file": named}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if used is None and isinstance(named, str):
        with pytest.warns(UserWarning, match="mtp_file"):
            assert config_mtp_file(tmp_path) is None
    else:
        assert config_mtp_file(tmp_path) == used


def test_a_shard_missing_from_the_repo_is_one_line(hub, env, repos, tmp_path):
    broken = shutil.copytree(repos["raw"], tmp_path / "broken")
    (broken / LAST_SHARD).unlink()
    hub.add_repo("Qwen/Broken", broken)
    mlx = shutil.copytree(repos["mlx"], tmp_path / "mlx")
    line = error_line(
        run_cli("convert", "--mtp-from", "Qwen/Broken", "--mlx-path", str(mlx), env=env)
    )
    assert "Qwen/Broken" in line and f"{LAST_SHARD} not found" in line
    assert not (mlx / "mtp.safetensors").exists()


def test_mtp_from_a_local_directory_reads_it_in_place(repos, tmp_path):
    """``--mtp-from DIR`` is the same head as ``--hf-path DIR`` (no hub)."""
    from mlx_spec.commands.convert import main

    mlx = shutil.copytree(repos["mlx"], tmp_path / "mlx")
    argv = ["--mtp-from", str(repos["raw"]), "--mlx-path", str(mlx)]
    assert main([*argv, "--mtp-dtype", "float32", "--no-progress"]) == 0
    _same_head(mlx, repos["raw"])


@pytest.mark.slow
def test_convert_hf_path_takes_a_repo_id(hub, env, repos, tmp_path):
    """``--hf-path REPO`` downloads the whole release, converts the target
    and writes the head: the model decodes with its head losslessly."""
    out = tmp_path / "converted"
    done = run_cli(
        "convert",
        "--hf-path",
        RELEASE,
        "--mlx-path",
        str(out),
        "--mtp-dtype",
        "float32",
        "--no-progress",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert hub.sent(RELEASE, shard_name(1, 2)) > 0  # the trunk came down too
    assert decode_in_subprocess(str(out), env) == {"equal": True, "n": 24, "head": True}


@pytest.mark.slow
def test_a_damaged_cached_fetch_is_fetched_again(hub, env, repos, tmp_path):
    mlx = shutil.copytree(repos["mlx"], tmp_path / "mlx")
    assert _mtp_from(env, mlx).returncode == 0
    sha = hub.repos[RELEASE].sha
    cached = Path(env["HF_HOME"]) / "mlx_spec" / "mtp" / "models--Qwen--Tiny-Release"
    cached = cached / sha / LAST_SHARD
    cached.write_bytes(cached.read_bytes()[:100])
    hub.reset_counts()
    done = _mtp_from(env, mlx)
    assert done.returncode == 0, done.stderr
    header, mtp = _mtp_bytes(repos["raw"] / LAST_SHARD)
    assert hub.sent(RELEASE, LAST_SHARD) == header + mtp
    _same_head(mlx, repos["raw"])
