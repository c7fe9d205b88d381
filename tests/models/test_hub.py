"""Models named by Hugging Face repo id, against a fake hub on 127.0.0.1:
loading (the head's files with the model, every layout of them, the cache, a
revision) and the failures (an unknown repo or revision, a server dying mid
file), each one line. ``convert --mtp-from``: test_hub_mtp_from.py.

``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE``
when it is imported, so every download runs in a subprocess started with
them (an empty ``HF_HOME`` per test); the hub counts what it sends. The
fixtures: tests/models/conftest.py.
"""

import json
import shutil
from pathlib import Path

import pytest

from mlx_spec.testing.hub_release import (
    LAST_SHARD,
    MLX_REPO,
    RELEASE,
    SIDECAR_REPO,
    decode_in_subprocess,
    error_line,
    run_cli,
    run_python,
)

from mlx_spec.testing.hub_repos import shard_name

GENERATE = ["--prompt", "def f(x):", "--max-tokens", "12", "--temp", "0"]


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
    result = decode_in_subprocess(RELEASE, env)
    assert result == {"equal": True, "n": 24, "head": True}
    assert hub.sent(RELEASE, LAST_SHARD) == len(hub.repos[RELEASE].files[LAST_SHARD])


@pytest.mark.slow
def test_the_sidecar_mlx_lm_leaves_out_is_downloaded(hub, env, repos):
    """An MLX repo shipping ``mtp.safetensors`` (not in mlx-lm's download
    patterns) gets its head; ``--mtp-path REPO`` fetches only MTP files."""
    assert decode_in_subprocess("mlx-community/Tiny-MLX-MTP", env)["head"] is True
    hub.reset_counts()
    result = decode_in_subprocess(MLX_REPO, env, mtp=SIDECAR_REPO)
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
    got = run_python(
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
    assert decode_in_subprocess(RELEASE, env)["equal"]
    hub.stop()
    assert decode_in_subprocess(RELEASE, env) == {"equal": True, "n": 24, "head": True}
    offline = dict(env, HF_HUB_OFFLINE="1")
    assert decode_in_subprocess(RELEASE, offline)["head"]
    line = error_line(run_cli("generate", "--model", MLX_REPO, *GENERATE, env=offline))
    assert MLX_REPO in line and "HF_HUB_OFFLINE" in line


@pytest.mark.slow
def test_a_cli_command_takes_a_repo_id_and_a_revision(hub, env):
    sha = hub.repos[MLX_REPO].sha
    done = run_cli(
        "generate", "--model", MLX_REPO, "--revision", sha, *GENERATE, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "Generation: 12 tokens" in done.stdout


# ------------------------------------------------------------------- errors


@pytest.mark.slow
def test_an_unknown_repo_and_a_missing_revision_are_one_line(hub, env, repos):
    line = error_line(run_cli("generate", "--model", "org/nope", *GENERATE, env=env))
    assert "'org/nope'" in line and "no repo" in line
    line = error_line(
        run_cli("generate", "--model", MLX_REPO, "--revision", "v9", *GENERATE, env=env)
    )
    assert MLX_REPO in line and "no revision 'v9'" in line
    line = error_line(
        run_cli(
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
    line = error_line(
        run_cli(
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
    done = run_cli("generate", "--model", RELEASE, *GENERATE, env=env)
    line = error_line(done, retries=True)
    assert RELEASE in line and "again" in line
    sizes = {n: len(b) for n, b in hub.repos[RELEASE].files.items()}
    for name, size in _snapshot_files(env, RELEASE).items():
        assert size == sizes[name], name  # whatever is in a snapshot is whole
    assert shard_name(1, 2) not in _snapshot_files(env, RELEASE)
    hub.die_after = None
    assert decode_in_subprocess(RELEASE, env) == {"equal": True, "n": 24, "head": True}


def test_the_server_names_a_downloaded_model_by_its_repo_id(tmp_path):
    from mlx_spec.model_files import model_name

    snapshot = tmp_path / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    assert model_name("org/model", snapshot) == "org/model"
    assert model_name(str(snapshot), snapshot) == "0123abcd"
    assert model_name(None, snapshot) == "0123abcd"
