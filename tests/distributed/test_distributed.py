"""A target split over two local processes (``mlx.launch --backend ring``):
speculative output equals single-process and mlx-lm output, and a rank that
dies ends the run with the rank named, never a hang.

Every launch runs in its own process group, bounded by a timeout, and is
killed whatever happens.
"""

import os
import signal
import subprocess
import sys
import time

import mlx_lm
import pytest

from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.server import free_ports

PROMPT = "def fibonacci(n):"
LAUNCH = [
    sys.executable,
    "-c",
    "from mlx._distributed_utils.launch import main; main()",
]


def launch_argv(model, *args, command="generate"):
    # ports free now: mlx.launch's default ones may be held by another run's ranks
    ring = ["--backend", "ring", "-n", "2", "--starting-port", str(free_ports(2))]
    argv = LAUNCH + ring + [sys.executable, "-m", "mlx_spec"]
    argv += [command, "--pipeline", "--model", str(model)]
    return argv + (["--prompt", PROMPT] if command == "generate" else []) + list(args)


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def run_launch(argv, timeout=240, stdin=b""):
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(stdin, timeout=timeout)
        return proc.returncode, out.decode(errors="replace")
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return {
        f: write_tiny_checkpoint(root / f, f)
        for f in ("qwen3_next", "qwen3_5", "qwen3_5_moe")
    }


@pytest.mark.parametrize(
    "family, draft",
    [
        ("qwen3_next", "ngram"),
        ("qwen3_next", "mtp"),
        ("qwen3_5", "mtp+ngram"),
        ("qwen3_5_moe", "mtp+ngram"),
        ("qwen3_5_moe", "none"),
        ("qwen3_next", "mtp+ngram:auto"),
    ],
)
@pytest.mark.slow
def test_pipeline_output_equals_single_process_and_mlx_lm(checkpoints, family, draft):
    """(With ``auto`` the ranks time their passes differently, and must still
    agree on every pass's length.)"""
    path = checkpoints[family]
    draft, _, k = draft.partition(":")
    code, out = run_launch(
        launch_argv(
            path, "--max-tokens", "16", "--draft", draft, "--num-draft-tokens", k or "3"
        )
    )
    assert code == 0, out
    model, tok = mlx_lm.load(str(path))
    want = mlx_lm.generate(
        model,
        tok,
        (
            tok.apply_chat_template(
                [{"role": "user", "content": PROMPT}], add_generation_prompt=True
            )
            if tok.has_chat_template
            else PROMPT
        ),
        max_tokens=16,
    )
    # rank 0 prints the text between its two rules, the other rank nothing
    assert out.count("==========") == 2, out
    text = out.split("==========\n")[1]
    assert text == want + "\n"


def _rank_processes(launcher_pid):
    """pid -> MLX rank of the launcher's child processes."""
    ranks = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(
                    kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv
                )
        except OSError:
            continue
        if b"MLX_RANK" in env:
            ranks[int(pid)] = int(env[b"MLX_RANK"])
    return ranks


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc")
@pytest.mark.slow
def test_a_rank_that_dies_ends_every_rank_naming_it(tmp_path):
    from mlx_spec.testing.mtp_heads import write_cycle_checkpoint

    # a model whose text never reaches EOS: the run lasts until it is stopped
    path = write_cycle_checkpoint(tmp_path / "cycle", "qwen3_next")
    argv = launch_argv(path, "--max-tokens", "100000")
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        for _ in range(50):  # the launcher's lines, then rank 0's first rule
            if proc.stdout.readline().startswith(b"=========="):
                break
        else:
            raise AssertionError("generation did not start")
        ranks = {}
        for _ in range(100):  # the ranks are there once generation started
            ranks = _rank_processes(proc.pid)
            if len(ranks) == 2:
                break
            time.sleep(0.05)
        victim = next(pid for pid, rank in ranks.items() if rank == 1)
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)  # never a hang
        text = out.decode(errors="replace")
        assert "rank 1 exited" in text, text[-2000:]  # the launcher names it
        assert not _rank_processes(proc.pid)  # and no rank is left
    finally:
        stop(proc)


@pytest.mark.slow
def test_pipeline_chat_equals_single_process_chat(checkpoints):
    """Rank 0 reads the lines and every rank replies; the transcript is the
    single-process chat's (itself tested against mlx-lm)."""
    path = checkpoints["qwen3_5"]
    # mlx.launch never passes the end of its input on: the chat ends on /quit
    lines = b"def add(a, b):\n/stats\nnow subtract\n/quit\n"
    code, out = run_launch(
        launch_argv(path, "--max-tokens", "12", command="chat"), stdin=lines
    )
    assert code == 0, out
    single = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_spec",
            "chat",
            "--model",
            str(path),
            "--max-tokens",
            "12",
        ],
        input=lines,
        capture_output=True,
        timeout=240,
    )
    ours = [l for l in out.splitlines() if not l.startswith("\x1b[")]

    def replies(lines):  # /stats: timings and auto's draft lengths vary by run
        return [
            l for l in lines if "tokens/s" not in l and "per draft position" not in l
        ]

    assert replies(ours) == replies(single.stdout.decode(errors="replace").splitlines())


@pytest.mark.slow
def test_pipeline_server_answers_as_mlx_lm(checkpoints):
    """Rank 0 serves HTTP; both ranks decode every request in lock-step,
    concurrent ones in one batch."""
    import threading

    import openai

    from mlx_spec.testing.server import free_port, wait_until_answers

    path, port = checkpoints["qwen3_5"], free_port()
    argv = launch_argv(path, "--port", str(port), command="server")
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until_answers(port, proc, timeout=180)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
        )
        prompts = ["def fibonacci(n):", "import os\n"]
        got = {}

        def ask(p):
            r = client.completions.create(model=path.name, prompt=p, max_tokens=12)
            got[p] = r.choices[0].text

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        model, tok = mlx_lm.load(str(path))
        for p in prompts:
            assert got[p] == mlx_lm.generate(model, tok, p, max_tokens=12)
    finally:
        stop(proc)
