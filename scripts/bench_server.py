"""Drive ``mlx_spec server`` and ``mlx_lm.server`` on the same model with N
concurrent clients, in one run, and report throughput, time to first token
and the speculation counters (for mlx_spec's servers also where the worker's
time went, prefilling prompts or running passes, read from its /health); then
time the first token of turn 2 of a long conversation against turn 1 (the
kept conversation state at work), and of two new conversations with the same
long system prompt (the state kept where it ends, at work in the second).

Servers: ``mlx_spec`` (batched speculation, ``--decode-concurrency 8``),
``mlx_spec-serial`` (the same server one request at a time) and ``mlx_lm``
(``mlx_lm.server``, which batches plain decoding). Each runs alone (one after
the other) on 127.0.0.1; every client streams greedy ``/v1/completions``
requests of the bundled bench workloads.

    python scripts/bench_server.py [--model DIR] [--clients 1 2 4 8] [--max-tokens 128]
        [--shared-prefix-chars N]  # the same N characters before every prompt
        [--rounds 3]  # every server in turn, reversed each round; medians

With ``--rounds`` each line is the round with the median aggregate tokens/s
(time to first token of the conversations: medians), so a busy spell of a
shared machine falls on every server alike.

On Linux preload OpenBLAS for GPU-like matmul scaling (say so in results):
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
"""

import argparse
import http.client
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

import mlx_spec
from bench_helpers import concurrent_clients, interleaved, median_run
from mlx_spec.timed_runs import load_workloads, machine_info
from mlx_spec.demo import default_model_path
from mlx_spec.drafters import draft_names
from mlx_spec.testing.server import free_port, mlx_spec_server, running_server


def stream(port, path, body):
    """One streamed request: time to first text, seconds, tokens, speculation."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    tic = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{path}: HTTP {r.status}: {r.read()[:300]!r}")
    first, tokens, speculation = None, 0, None
    for line in r:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or []:
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text and first is None:
                first = time.perf_counter() - tic
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        speculation = chunk.get("speculation") or speculation
    conn.close()
    return {
        "ttft": first or 0.0,
        "seconds": time.perf_counter() - tic,
        "tokens": tokens,
        "speculation": speculation,
    }


def concurrent(port, prompts, clients, max_tokens, extra):
    """``clients`` threads, each sending ``prompts`` in turn (offset by its index)."""

    def request(prompt):
        body = {"prompt": prompt, "max_tokens": max_tokens, **extra}
        return stream(port, "/v1/completions", body)

    results, wall = concurrent_clients(request, prompts, clients)
    drafted = sum((r["speculation"] or {}).get("drafted", 0) for r in results)
    accepted = sum((r["speculation"] or {}).get("accepted", 0) for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "aggregate_tps": sum(r["tokens"] for r in results) / wall,
        "request_tps": statistics.median(
            r["tokens"] / (r["seconds"] - r["ttft"]) for r in results
        ),
        "ttft_median": statistics.median(r["ttft"] for r in results),
        "accepted": accepted,
        "drafted": drafted,
    }


def worker_time(port):
    """The mlx_spec worker's time so far (its /health), or None (mlx_lm.server)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    r = conn.getresponse()
    text = r.read()
    conn.close()
    try:
        body = json.loads(text) if r.status == 200 else None
    except ValueError:
        body = None
    return body.get("worker") if isinstance(body, dict) else None


def worker_split(before, after) -> dict:
    """Where the worker's time went between two /health readings."""
    if not before or not after:
        return {}
    passes = after["passes"] - before["passes"]
    rows = after["rows_per_pass"] * after["passes"]
    rows -= before["rows_per_pass"] * before["passes"]
    return {
        "prefill_s": after["prefill_s"] - before["prefill_s"],
        "passes_s": after["passes_s"] - before["passes_s"],
        "passes": passes,
        "rows_per_pass": rows / max(passes, 1),
    }


def conversation(port, context, max_tokens, extra):
    """Time to first token of turn 1 (a long context) and turn 2 (the same
    conversation plus the reply and a short question)."""
    messages = [{"role": "user", "content": context}]
    body = {"messages": messages, "max_tokens": max_tokens, **extra}
    one = stream(port, "/v1/chat/completions", body)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body))
    reply = json.loads(conn.getresponse().read())["choices"][0]["message"]["content"]
    conn.close()
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Now add a docstring."},
    ]
    two = stream(port, "/v1/chat/completions", {**body, "messages": messages})
    return one["ttft"], two["ttft"]


def new_conversations(port, system, max_tokens, extra):
    """Time to first token of two new conversations with the same (long)
    system prompt and different questions, one after the other."""
    ttfts = []
    for question in ("Write a function that parses a date.", "Add a stack class."):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
        body = {"messages": messages, "max_tokens": max_tokens, **extra}
        ttfts.append(stream(port, "/v1/chat/completions", body)["ttft"])
    return ttfts


def run_server(name, argv, port, prompts, context, args, log):
    extra = {"temperature": 0.0}
    rows = []
    with running_server(argv, port, timeout=300, log=log):
        stream(port, "/v1/completions", {"prompt": prompts[0], "max_tokens": 8})
        for n in args.clients:
            before = worker_time(port)
            row = concurrent(port, prompts, n, args.max_tokens, extra)
            rows.append(
                {"server": name, **row, **worker_split(before, worker_time(port))}
            )
            print(json.dumps(rows[-1]), flush=True)
        turns = list(conversation(port, context, 32, extra))
        turns += new_conversations(port, context, 32, extra)
    keys = ("turn1_ttft", "turn2_ttft", "system1_ttft", "system2_ttft")
    print(json.dumps({"server": name, **dict(zip(keys, turns))}), flush=True)
    return rows, turns


def cpu_float32_copy(model: str, into: Path) -> str:
    """``model``, or on the CPU, when it is a half-precision MoE, a float32
    copy of it in ``into``: mlx_lm.server cannot run it there (MLX's CPU
    ``gather_mm`` runs float32 only and mlx-lm does not upcast), and every
    server then serves the same float32 values (mlx_spec upcasts anyway)."""
    src = Path(model)
    config = json.loads((src / "config.json").read_text())
    half = config.get("torch_dtype") in ("bfloat16", "float16")
    if mx.default_device() != mx.cpu or not config.get("num_experts") or not half:
        return model
    into.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            weights = {k: v.astype(mx.float32) for k, v in mx.load(str(f)).items()}
            mx.save_safetensors(str(into / f.name), weights, {"format": "pt"})
        elif f.is_file():
            shutil.copy(f, into / f.name)
    config["torch_dtype"] = "float32"
    (into / "config.json").write_text(json.dumps(config, indent=2))
    print(f"serving a float32 copy of {model} (mlx_lm needs it on the CPU)", flush=True)
    return str(into)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--context-chars", type=int, default=6000)
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["copy-function", "edit-class", "free-main", "free-class"]
        + ["long-context"],
        help="the bench workloads the clients send, by name (default: the "
        "five of 27 to 2,119 tokens, as in docs/measurements.md)",
    )
    p.add_argument(
        "--shared-prefix-chars",
        type=int,
        default=0,
        help="begin every prompt with the same N characters of standard-library "
        "source (a shared system prompt, as parallel agents send)",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="extra arguments for the mlx_spec servers, e.g. '--prefill-chunk 128'",
    )
    p.add_argument(
        "--servers",
        nargs="+",
        default=["mlx_spec", "mlx_spec-serial", "mlx_lm"],
        help="mlx_spec, mlx_spec-serial, mlx_lm; mlx_spec/DRAFT: the batched "
        "server with --draft DRAFT (e.g. mlx_spec/none mlx_spec/ngram)",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="every server in turn, this many times"
    )
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    known = ["mlx_spec", "mlx_spec-serial", "mlx_lm"] + [
        f"mlx_spec/{d}" for d in draft_names()
    ]
    for name in args.servers:
        if name not in known:
            p.error(f"unknown server {name!r}: one of {', '.join(known)}")
    _, tok = mlx_spec.load(args.model)
    prompts = [
        w["prompt"]
        for w in load_workloads(tokenizer=tok)
        if w["name"] in args.workloads
    ]
    context = "\n\n".join(prompts)[: args.context_chars]
    if args.shared_prefix_chars:
        shared = "\n\n".join(reversed(prompts))[: args.shared_prefix_chars]
        prompts = [shared + "\n\n" + p for p in prompts]
    print(json.dumps(machine_info()), flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_server_"))
    if "mlx_lm" in args.servers:
        args.model = cpu_float32_copy(args.model, log_dir / "model")
    rounds = {name: [] for name in args.servers}  # name -> [(rows, turns)]
    for r, name in interleaved(args.servers, args.rounds):
        port = free_port()
        if name.startswith("mlx_spec"):
            concurrency = "1" if name.endswith("serial") else "8"
            extra = ["--decode-concurrency", concurrency] + args.server_args.split()
            if name.startswith("mlx_spec/"):
                extra += ["--draft", name.split("/", 1)[1]]
            argv = mlx_spec_server(args.model, port, *extra)
        else:
            argv = [sys.executable, "-m", "mlx_lm.server", "--model", args.model]
            argv += ["--port", str(port), "--host", "127.0.0.1"]
        log = str(log_dir / f"{name.replace('/', '-')}-{r}.log")
        rounds[name].append(run_server(name, argv, port, prompts, context, args, log))
    table, turns = [], {}
    for name, runs in rounds.items():
        for i in range(len(args.clients)):
            table.append(median_run([rows[i] for rows, _ in runs], "aggregate_tps"))
        turns[name] = [statistics.median(t) for t in zip(*(t for _, t in runs))]
    print()
    print(
        "| server | clients | aggregate tok/s | per-request tok/s | TTFT median s | "
        "accepted/drafted | worker: prefill s, passes s, rows a pass |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in table:
        spec = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
        work = "-"
        if "passes_s" in r:
            work = (
                f"{r['prefill_s']:.2f}, {r['passes_s']:.2f}, {r['rows_per_pass']:.2f}"
            )
        print(
            f"| {r['server']} | {r['clients']} | {r['aggregate_tps']:.1f} | "
            f"{r['request_tps']:.1f} | {r['ttft_median']:.3f} | {spec} | {work} |"
        )
    print()
    print(
        "| server | turn 1 TTFT s | turn 2 TTFT s | new conversation, same system "
        "prompt: first, second TTFT s |"
    )
    print("|---|---|---|---|")
    for name, (one, two, first, second) in turns.items():
        print(f"| {name} | {one:.3f} | {two:.3f} | {first:.3f}, {second:.3f} |")
    print(f"\nserver logs: {log_dir}")


if __name__ == "__main__":
    main()
