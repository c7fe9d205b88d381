"""Time to first token of a new conversation with a long system prompt on
``mlx_spec server --state-dir``: cold (nothing kept), from memory (the state
kept where the system prompt ends, by an earlier conversation), and from disk
after the server restarted; and the bytes of the state files per 1k tokens.

The system prompt is the start of the Python standard library's
``argparse.py`` (what the demo model was trained on), cut to ``--tokens``
tokens; every server is warmed up by a short unrelated request first.

    python scripts/bench_state_dir.py [--model DIR] [--tokens 8000] [--rounds 2]

On Linux preload OpenBLAS for GPU-like matmul scaling (say so in results):
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
"""

import argparse
import argparse as argparse_module
import json
import statistics
import tempfile
from pathlib import Path

from bench_server import stream
from mlx_spec.timed_runs import machine_info
from mlx_spec.demo import default_model_path
from mlx_spec.mlx_lm_compat import load
from mlx_spec.states.file import read_metadata
from mlx_spec.testing.server import free_port, mlx_spec_server, running_server

QUESTIONS = [
    "Write a function that parses a date.",
    "Add a stack class.",
    "Explain the parser in one line.",
    "Write a test for it.",
]


def system_prompt(model: str, tokens: int) -> str:
    """The first ``tokens`` tokens of argparse.py's source, as text."""
    _, tok = load(model)
    source = Path(argparse_module.__file__).read_text()
    ids = tok.encode(source)
    if len(ids) < tokens:
        source = (source + "\n\n") * (tokens // max(len(ids), 1) + 1)
        ids = tok.encode(source)
    return tok.decode(ids[:tokens])


def ask(port, system, question, max_tokens=8):
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
    ]
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    return stream(port, "/v1/chat/completions", body)["ttft"]


def serve(model, state_dir, log):
    port = free_port()
    argv = mlx_spec_server(model, port, "--state-dir", str(state_dir))
    server = running_server(argv, port, timeout=300, log=log)
    return port, server


def one_round(model, system, root: Path):
    """(cold, from memory, from disk) seconds to first token, and the
    (bytes, tokens) of each state file written."""
    state_dir = root / "states"
    port, server = serve(model, state_dir, str(root / "server1.log"))
    with server:
        stream(port, "/v1/completions", {"prompt": "import os\n", "max_tokens": 4})
        cold = ask(port, system, QUESTIONS[0])
        memory = ask(port, system, QUESTIONS[1])
    port, server = serve(model, state_dir, str(root / "server2.log"))
    with server:
        stream(port, "/v1/completions", {"prompt": "import sys\n", "max_tokens": 4})
        disk = ask(port, system, QUESTIONS[2])
    files = []
    for path in state_dir.iterdir():
        if path.suffix == ".safetensors" and not path.name.startswith("."):
            tokens = len(read_metadata(path)["tokens"].split(","))
            files.append((path.stat().st_size, tokens))
    return cold, memory, disk, files


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    system = system_prompt(args.model, args.tokens)
    print(json.dumps(machine_info()), flush=True)
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            rounds.append(one_round(args.model, system, Path(tmp)))
        cold, memory, disk, files = rounds[-1]
        print(
            json.dumps(
                {"round": i, "cold_s": cold, "memory_s": memory, "disk_s": disk}
            ),
            flush=True,
        )
    cold, memory, disk = (statistics.median(r[k] for r in rounds) for k in range(3))
    files = rounds[-1][3]
    print(f"system prompt: {args.tokens} tokens (argparse.py), model {args.model}")
    print("| TTFT, new conversation | cold | from memory | from disk after restart |")
    print("|---|---|---|---|")
    print(
        f"| seconds (median of {args.rounds}) | {cold:.2f} | {memory:.2f} | {disk:.2f} |"
    )
    print("| state file | tokens | bytes | bytes per 1k tokens |")
    print("|---|---|---|---|")
    for size, tokens in sorted(files, key=lambda f: f[1]):
        if tokens < 1000:
            continue  # the warm-up requests' states
        print(f"| | {tokens} | {size} | {size * 1000 / tokens:.0f} |")


if __name__ == "__main__":
    main()
