"""Models named by Hugging Face repo id, against a fake hub on 127.0.0.1.

``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE``
when it is imported, so every download runs in a subprocess started with
them (an empty ``HF_HOME`` per test); the hub counts what it sends.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_spec
from mlx_spec.testing.fake_hub import FakeHub
from mlx_spec.testing.hub_repos import shard_name, write_sharded_release

RELEASE = "Qwen/Tiny-Release"  # raw, two shards, mtp.* in the second
MLX_REPO = "mlx-community/Tiny-MLX"  # mlx-lm's format, no mtp.* tensors
SIDECAR_REPO = "someone/Tiny-MTP"  # only config.json and mtp.safetensors
FAMILY = "qwen3_5"
LAST_SHARD = shard_name(2, 2)
TIMEOUT = 300  # generous: a subprocess imports mlx and mlx-lm


@pytest.fixture(scope="module")
def repos(tmp_path_factory, save_mlx_dir):
    """Directories published on the fake hub: the raw release, its MLX
    conversion and a sidecar-only repo (written by ``convert --hf-path``)."""
    root = tmp_path_factory.mktemp("hub_repos")
    raw = write_sharded_release(root / "raw", FAMILY, num_hidden_layers=12)
    mlx = save_mlx_dir(raw, root / "mlx")
    with_head = root / "mlx_with_head"
    shutil.copytree(mlx, with_head)
    assert (
        _cli(
            "convert",
            "--hf-path",
            str(raw),
            "--mlx-path",
            str(with_head),
            "--mtp-dtype",
            "float32",
            env=dict(os.environ),
        ).returncode
        == 0
    )
    sidecar = root / "sidecar"
    sidecar.mkdir()
    shutil.copy(raw / "config.json", sidecar / "config.json")
    shutil.copy(with_head / "mtp.safetensors", sidecar / "mtp.safetensors")
    return {"raw": raw, "mlx": mlx, "with_head": with_head, "sidecar": sidecar}


@pytest.fixture
def hub(repos):
    with FakeHub() as hub:
        hub.add_repo(RELEASE, repos["raw"])
        hub.add_repo(MLX_REPO, repos["mlx"])
        hub.add_repo(SIDECAR_REPO, repos["sidecar"])
        hub.add_repo("mlx-community/Tiny-MLX-MTP", repos["with_head"])
        yield hub


@pytest.fixture
def env(hub, tmp_path):
    """The environment of a client of ``hub`` with an empty cache."""
    return dict(
        os.environ,
        HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )


def _cli(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "mlx_spec", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _python(code: str, env) -> dict:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _error_line(done, retries: bool = False) -> str:
    """The command's error: exit status 2 and one line on stderr (after
    huggingface_hub's own retry notices when ``retries``), no traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr, done.stderr
    if retries:
        notices = ("Error while downloading", "Trying to resume", "Max retries")
        assert all(line.startswith(notices) for line in lines[:-1]), done.stderr
    else:
        assert len(lines) == 1, done.stderr
    return lines[-1]


GENERATE = ["--prompt", "def f(x):", "--max-tokens", "12", "--temp", "0"]

_DECODE = """
    import json, mlx_lm, mlx_spec
    from mlx_spec.testing.reference import reference_tokens, spec_tokens
    model, tok = mlx_spec.load({name!r}, mtp_path={mtp!r})
    plain, _ = mlx_lm.load({name!r})
    prompt = tok.encode("def push(self, value):")
    want = reference_tokens(plain, tok, prompt, 24)
    got = spec_tokens(model, tok, prompt, 24, draft="mtp", num_draft_tokens=2)
    print(json.dumps({{"equal": got == want, "n": len(got),
        "head": model.mtp_head is not None}}))
"""


def _decode(name, env, mtp=None) -> dict:
    return _python(_DECODE.format(name=name, mtp=mtp), env)


def _snapshot_files(env, repo) -> dict:
    """name -> size of every file of ``repo``'s snapshots in the cache of ``env``."""
    root = Path(env["HF_HOME"]) / "hub" / ("models--" + repo.replace("/", "--"))
    return {
        p.relative_to(snapshot).as_posix(): p.stat().st_size
        for snapshot in (root / "snapshots").glob("*")
        for p in snapshot.rglob("*")
        if p.is_file()
    }


# ------------------------------------------------------------------ loading


def test_a_repo_id_loads_with_its_head_and_decodes_losslessly(hub, env):
    """``mlx_spec.load("Qwen/...")`` downloads the raw release, attaches the
    head from its shards, and MTP decoding equals mlx_lm's greedy output."""
    result = _decode(RELEASE, env)
    assert result == {"equal": True, "n": 24, "head": True}
    assert hub.sent(RELEASE, LAST_SHARD) == len(hub.repos[RELEASE].files[LAST_SHARD])


@pytest.mark.slow
def test_the_sidecar_mlx_lm_leaves_out_is_downloaded(hub, env, repos):
    """An MLX repo shipping ``mtp.safetensors`` (not in mlx-lm's download
    patterns) gets its head; ``--mtp-path REPO`` fetches only MTP files."""
    assert _decode("mlx-community/Tiny-MLX-MTP", env)["head"] is True
    hub.reset_counts()
    result = _decode(MLX_REPO, env, mtp=SIDECAR_REPO)
    assert result == {"equal": True, "n": 24, "head": True}
    assert set(f for (r, f) in hub.bytes_sent if r == SIDECAR_REPO) == {
        "config.json",
        "mtp.safetensors",
    }


def test_every_mtp_file_layout_is_downloaded(tmp_path, env, hub, repos):
    """Every published MTP file name (and the one config.json names) comes
    down with the model; other files stay on the hub."""
    repo = tmp_path / "layouts"
    shutil.copytree(repos["mlx"], repo)
    config = json.loads((repo / "config.json").read_text())
    config["mlx_lm_extra_tensors"] = {"mtp_file": "heads/mtp-head.safetensors"}
    (repo / "config.json").write_text(json.dumps(config))
    names = [
        "mtp-00001-of-00002.safetensors",
        "mtp-00002-of-00002.safetensors",
        "mtp.safetensors.index.json",
        "mtp/weights.safetensors",
        "mtp/manifest.json",
        "model-mtp.safetensors",
        "heads/mtp-head.safetensors",
        "README.md",
        "original/consolidated.safetensors",
    ]
    for name in names:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(b"{}" if name.endswith(".json") else b"x" * 16)
    hub.add_repo("org/layouts", repo)
    got = _python(
        """
        import json
        from mlx_spec.hub.resolve import resolve_model
        path = resolve_model("org/layouts")
        print(json.dumps(sorted(p.relative_to(path).as_posix()
                                for p in path.rglob("*") if p.is_file())))
        """,
        env,
    )
    assert set(names[:-2]) <= set(got)
    assert "README.md" not in got and "original/consolidated.safetensors" not in got


@pytest.mark.slow
def test_a_second_load_comes_from_the_cache(hub, env):
    """Loaded once, a repo loads again with the hub stopped, and with
    HF_HUB_OFFLINE=1; a repo never loaded is then one clear line."""
    assert _decode(RELEASE, env)["equal"]
    hub.stop()
    assert _decode(RELEASE, env) == {"equal": True, "n": 24, "head": True}
    offline = dict(env, HF_HUB_OFFLINE="1")
    assert _decode(RELEASE, offline)["head"]
    line = _error_line(_cli("generate", "--model", MLX_REPO, *GENERATE, env=offline))
    assert MLX_REPO in line and "HF_HUB_OFFLINE" in line


@pytest.mark.slow
def test_a_cli_command_takes_a_repo_id_and_a_revision(hub, env):
    sha = hub.repos[MLX_REPO].sha
    done = _cli("generate", "--model", MLX_REPO, "--revision", sha, *GENERATE, env=env)
    assert done.returncode == 0, done.stderr
    assert "Generation: 12 tokens" in done.stdout


# ------------------------------------------------------------------- errors


@pytest.mark.slow
def test_an_unknown_repo_and_a_missing_revision_are_one_line(hub, env, repos):
    line = _error_line(_cli("generate", "--model", "org/nope", *GENERATE, env=env))
    assert "'org/nope'" in line and "no repo" in line
    line = _error_line(
        _cli("generate", "--model", MLX_REPO, "--revision", "v9", *GENERATE, env=env)
    )
    assert MLX_REPO in line and "no revision 'v9'" in line
    line = _error_line(
        _cli(
            "generate",
            "--model",
            MLX_REPO,
            "--mtp-path",
            "org/nope",
            *GENERATE,
            env=env,
        )
    )
    assert "MTP path 'org/nope'" in line
    offline = dict(env, HF_HUB_OFFLINE="1")
    line = _error_line(
        _cli(
            "convert",
            "--mtp-from",
            RELEASE,
            "--mlx-path",
            str(repos["mlx"]),
            env=offline,
        )
    )
    assert "is not in the Hugging Face cache" in line and "HF_HUB_OFFLINE" in line
    assert not any((Path(env["HF_HOME"]) / "hub").glob("models--org--nope/snapshots/*"))


@pytest.mark.slow
def test_a_server_dying_mid_file_is_one_line_and_leaves_no_corrupt_cache(hub, env):
    """The connection drops 1000 bytes into the first shard, every time: one
    line; nothing truncated in the snapshot; with the hub healthy again the
    next load completes and decodes losslessly."""
    hub.die_on, hub.die_after = shard_name(1, 2), 1000
    done = _cli("generate", "--model", RELEASE, *GENERATE, env=env)
    line = _error_line(done, retries=True)
    assert RELEASE in line and "again" in line
    sizes = {n: len(b) for n, b in hub.repos[RELEASE].files.items()}
    for name, size in _snapshot_files(env, RELEASE).items():
        assert size == sizes[name], name  # whatever is in a snapshot is whole
    assert shard_name(1, 2) not in _snapshot_files(env, RELEASE)
    hub.die_after = None
    assert _decode(RELEASE, env) == {"equal": True, "n": 24, "head": True}


# ---------------------------------------------------------------- --mtp-from


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
    return _cli(
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
    line = _error_line(_mtp_from(env, mlx, "--no-progress"))
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
    line = _error_line(
        _cli("convert", "--mtp-from", MLX_REPO, "--mlx-path", str(mlx), env=env)
    )
    assert MLX_REPO in line and "no MTP tensors" in line
    line = _error_line(
        _cli("convert", "--mtp-from", RELEASE, "--mlx-path", str(tmp_path), env=env)
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
    line = _error_line(
        _cli("convert", "--mtp-from", "Qwen/Broken", "--mlx-path", str(mlx), env=env)
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
    done = _cli(
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
    assert _decode(str(out), env) == {"equal": True, "n": 24, "head": True}


def test_the_server_names_a_downloaded_model_by_its_repo_id(tmp_path):
    from mlx_spec.model_files import model_name

    snapshot = tmp_path / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    assert model_name("org/model", snapshot) == "org/model"
    assert model_name(str(snapshot), snapshot) == "0123abcd"
    assert model_name(None, snapshot) == "0123abcd"


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
