"""``python -m mlx_spec.plugin``: mlx-lm's own commands, run as a user runs
them, print what they print without the plugin, while it speculates."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from mlx_spec.testing.agent_checkpoint import write_agent_checkpoint
from mlx_spec.testing.plugin_commands import PROMPT, generate_args
from mlx_spec.testing.server import completion, free_port, running_server


def run(argv, timeout=300):
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )


# qwen3_5_moe too: mlx-lm runs the tiny checkpoint's float32 experts on the
# CPU (a half-precision one, like the demo model's, it cannot: GatherMM).
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_generate_command_prints_mlx_lms_text(checkpoint_dirs, family):
    model = checkpoint_dirs[family]
    plain = run(["-m", "mlx_lm", "generate", *generate_args(model)])
    assert plain.returncode == 0, plain.stderr
    spec = run(["-m", "mlx_spec.plugin", "mlx_lm.generate", *generate_args(model)])
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and plain.stdout.strip()
    assert "mlx_spec.plugin: 1 call(s) speculated;" in spec.stderr


def without_rates(text):
    """The chat's screen less its timing lines (tokens/s, peak memory)."""
    return [line for line in text.splitlines() if "tok/s" not in line]


def test_chat_command_shows_mlx_lms_replies(tmp_path):
    """Two turns of ``mlx_lm.chat`` (its prompt cache kept between them)
    read from stdin: the same screen, both turns speculated on."""
    model = write_agent_checkpoint(tmp_path / "agent")  # it has a chat template
    turns = "hello there\nwhat now\nq\n"
    env = dict(os.environ, NO_COLOR="1", TERM="dumb")
    screens = {}
    for name, argv in (
        ("plain", ["-m", "mlx_lm", "chat"]),
        ("plugin", ["-m", "mlx_spec.plugin", "mlx_lm.chat"]),
    ):
        result = subprocess.run(
            [sys.executable, *argv, "--model", str(model), "--max-tokens", "16"],
            input=turns,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert result.returncode == 0, result.stderr
        screens[name] = result
    assert without_rates(screens["plugin"].stdout) == without_rates(
        screens["plain"].stdout
    )
    assert "bye" in screens["plain"].stdout
    assert "mlx_spec.plugin: 2 call(s) speculated;" in screens["plugin"].stderr


def test_an_uncovered_command_line_is_run_by_mlx_lm(checkpoint_dirs):
    args = generate_args(checkpoint_dirs["qwen3_5"]) + ["--max-kv-size", "8"]
    plain = run(["-m", "mlx_lm", "generate", *args])
    spec = run(["-m", "mlx_spec.plugin", "mlx_lm.generate", *args])
    assert spec.stdout == plain.stdout and plain.returncode == spec.returncode == 0
    assert "0 call(s) speculated, 1 run by mlx-lm (argument 'max_kv_size')" in (
        spec.stderr
    )


@pytest.mark.parametrize(
    "argv, said",
    [
        (["mlx_lm.nope"], "unknown command 'mlx_lm.nope'"),
        ([], "usage: python -m mlx_spec.plugin"),
    ],
)
def test_a_bad_command_is_refused_in_one_line(argv, said):
    result = run(["-m", "mlx_spec.plugin", *argv], timeout=60)
    assert result.returncode == 2
    assert said in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_bad_plugin_options_are_refused_in_one_line():
    env = dict(os.environ, MLX_SPEC_NUM_DRAFT_TOKENS="lots")
    result = subprocess.run(
        [sys.executable, "-m", "mlx_spec.plugin", "mlx_lm.generate"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "MLX_SPEC_NUM_DRAFT_TOKENS" in result.stderr


@pytest.mark.slow
def test_server_answers_mlx_lms_text(checkpoint_dirs, tmp_path):
    """``mlx_lm.server`` with the plugin: its own HTTP front, the same
    greedy completions as without it, one after the other (the second
    reusing the first's prompt cache) and two at once (which mlx-lm alone
    would batch)."""
    model = str(checkpoint_dirs["qwen3_next"])
    prompts = [PROMPT, PROMPT + " sat on"]
    answers = {}
    for name, argv in (
        ("plain", ["-m", "mlx_lm", "server"]),
        ("plugin", ["-m", "mlx_spec.plugin", "mlx_lm.server"]),
    ):
        port = free_port()
        log = tmp_path / f"{name}.log"
        command = [sys.executable, *argv, "--model", model, "--port", str(port)]
        with running_server(command, port, log=str(log)):
            one_by_one = [completion(port, p) for p in prompts]
            with ThreadPoolExecutor(len(prompts)) as pool:
                together = list(pool.map(lambda p: completion(port, p), prompts))
            answers[name] = one_by_one, together
    assert answers["plugin"] == answers["plain"]
    one_by_one, together = answers["plain"]
    assert all(one_by_one) and together == one_by_one
    # its report, printed when it was stopped
    report = (tmp_path / "plugin.log").read_text()
    assert "mlx_spec.plugin: 4 call(s) speculated;" in report
