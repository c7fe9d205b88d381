"""The fake hub's repos for the hub tests, and its clients.

:func:`publish_repos` writes what the hub serves: a raw release (two shards,
``mtp.*`` in the second), its MLX conversion without the head, the same with
the head (``convert --hf-path``) and a sidecar-only repo. ``huggingface_hub``
reads ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` when it is imported,
so every client of the hub runs in a subprocess started with
:func:`client_env`.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator

from .fake_hub import FakeHub
from .hub_repos import shard_name, write_sharded_release

RELEASE = "Qwen/Tiny-Release"  # raw, two shards, mtp.* in the second
MLX_REPO = "mlx-community/Tiny-MLX"  # mlx-lm's format, no mtp.* tensors
SIDECAR_REPO = "someone/Tiny-MTP"  # only config.json and mtp.safetensors
FAMILY = "qwen3_5"
LAST_SHARD = shard_name(2, 2)
TIMEOUT = 300  # generous: a subprocess imports mlx and mlx-lm
WITH_HEAD_REPO = "mlx-community/Tiny-MLX-MTP"  # the conversion with its head


def publish_repos(root: Path, save_mlx_dir) -> Dict[str, Path]:
    """The directories the hub publishes, written under ``root``
    (``save_mlx_dir(raw, out)``: mlx-lm's conversion of ``raw``)."""
    raw = write_sharded_release(root / "raw", FAMILY, num_hidden_layers=12)
    mlx = save_mlx_dir(raw, root / "mlx")
    with_head = root / "mlx_with_head"
    shutil.copytree(mlx, with_head)
    done = run_cli(
        "convert",
        "--hf-path",
        str(raw),
        "--mlx-path",
        str(with_head),
        "--mtp-dtype",
        "float32",
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sidecar = root / "sidecar"
    sidecar.mkdir()
    shutil.copy(raw / "config.json", sidecar / "config.json")
    shutil.copy(with_head / "mtp.safetensors", sidecar / "mtp.safetensors")
    return {"raw": raw, "mlx": mlx, "with_head": with_head, "sidecar": sidecar}


@contextmanager
def serving_repos(repos: Dict[str, Path]) -> Iterator[FakeHub]:
    """A fake hub serving ``repos`` (:func:`publish_repos`) under their ids."""
    with FakeHub() as hub:
        hub.add_repo(RELEASE, repos["raw"])
        hub.add_repo(MLX_REPO, repos["mlx"])
        hub.add_repo(SIDECAR_REPO, repos["sidecar"])
        hub.add_repo(WITH_HEAD_REPO, repos["with_head"])
        yield hub


def client_env(hub: FakeHub, home: Path) -> Dict[str, str]:
    """The environment of a client of ``hub`` with its cache in ``home``."""
    return dict(
        os.environ,
        HF_ENDPOINT=hub.url,
        HF_HOME=str(home),
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )


def run_cli(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "mlx_spec", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def run_python(code: str, env) -> dict:
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


def error_line(done, retries: bool = False) -> str:
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


def decode_in_subprocess(name, env, mtp=None) -> dict:
    """Whether ``name`` (a path or a repo id) loaded by mlx_spec decodes with
    its MTP head as mlx-lm does (24 greedy tokens): ``equal``, ``n``, ``head``."""
    return run_python(_DECODE.format(name=name, mtp=mtp), env)
