"""Measure the shipped demo model: held-out loss and speculation acceptance.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python scripts/train_demo/evaluate.py [--model mlx_spec/data/demo] [--json out.json]

Everything is rebuilt from the checkpoint directory and the running
interpreter's standard library (the held-out file list is in the
checkpoint's ``training.json``):

1. held-out loss: mean next-token cross-entropy (nats/token) of the model
   over the held-out files (windows of the training length) against the
   unigram baseline of the same tokenizer (add-one counts of the training
   files);
2. MTP acceptance, greedy, k = 1..4: ``mlx_spec.stream_generate(...,
   draft="mtp", num_draft_tokens=k)`` on prompts cut from held-out files;
   the same with the head's weights shuffled (each tensor's entries
   permuted: same statistics, no learned structure) as a control;
3. copy-heavy workload: prompt = a held-out function followed by its
   ``def`` line again, so the model regenerates it: tokens per verify pass
   for ``ngram``, ``mtp`` and ``mtp+ngram``;
4. the README's first command: 128 greedy tokens after ``def fibonacci(n):``,
   printed, with the share of its 16-token windows that already occurred
   earlier in the text (near 1 for a model stuck in a loop); plain greedy,
   then under the repetition penalty the command passes
   (``FIRST_COMMAND_PENALTY``);
5. loops over many prompts: the same share for 128 greedy tokens after the
   ``def`` lines of ``--loop-prompts`` held-out functions (each line alone,
   as a first prompt), against the share of the held-out code that follows
   each line; "looping" counts the texts whose share exceeds 0.3; plain
   greedy, then under that penalty;
6. MTP acceptance as in 2, under that penalty (the head drafts its argmax
   after the penalty, as the target chooses).

Acceptance per position i is ``stats.accepted_at[i] / stats.drafted_at[i]``
(the first i+1 drafts all accepted); "conditional" divides by the passes
whose first i drafts were accepted.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.sample_utils import make_logits_processors

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chunked_gdn import chunked_gdn  # noqa: E402
from demo_data import build_corpus, encode_files, unigram_loss  # noqa: E402

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import mlx_spec  # noqa: E402


def heldout_texts(training: dict) -> tuple:
    """(train texts, held-out texts {name: text}) rebuilt from the stdlib."""
    c = training["corpus"]
    corpus = build_corpus(
        c["seed"], training["config"]["holdout"], training["config"]["max_files"]
    )
    if corpus.file_list_sha256 != c["file_list_sha256"]:
        print(
            f"warning: this interpreter's stdlib (Python {corpus.python_version}) is not "
            f"the training corpus (Python {c['python_version']}); numbers will differ",
            file=sys.stderr,
        )
    held = {n: corpus.texts[n] for n in c["eval_files"] if n in corpus.texts}
    train = [corpus.texts[n] for n in c["train_files"] if n in corpus.texts]
    return train, held


def model_loss(model, stream: np.ndarray, length: int) -> float:
    """Mean next-token cross-entropy (nats) over every token of ``stream`` but the first."""
    total, count = 0.0, 0
    with chunked_gdn(model=model):  # the chunked GDN equals mlx-lm's (tested)
        for s in range(0, stream.size - 1, length - 1):
            w = mx.array(stream[s : s + length].astype(np.int32))[None]
            if w.shape[1] < 2:
                break
            logits = model(w[:, :-1]).astype(mx.float32)
            total += nn.losses.cross_entropy(logits, w[:, 1:], reduction="sum").item()
            count += w.shape[1] - 1
    return total / count


def functions(text: str, min_lines: int = 6, max_lines: int = 30):
    """(source, def line) of the functions / methods of a module, in order."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.decorator_list:
                continue
            n = node.end_lineno - node.lineno + 1
            if min_lines <= n <= max_lines:
                src = "".join(lines[node.lineno - 1 : node.end_lineno])
                out.append((node.lineno, src, lines[node.lineno - 1]))
    return [(s, d) for _, s, d in sorted(out)]


def spread(items, n):
    if len(items) <= n:
        return list(items)
    idx = np.linspace(0, len(items) - 1, n).round().astype(int)
    return [items[i] for i in idx]


def code_prompts(held: dict, tok, n: int, max_prompt_tokens: int) -> list:
    """Prompts cut from held-out files: context up to a function's first lines."""
    candidates = []
    for name in sorted(held):
        text = held[name]
        for src, _ in functions(text):
            start = text.find(src)
            head = "".join(src.splitlines(keepends=True)[:2])
            prefix = text[:start] + head
            ids = tok.encode(prefix)
            candidates.append(ids[-max_prompt_tokens:])
    return spread(candidates, n)


def copy_prompts(held: dict, tok, n: int) -> list:
    """(prompt ids, function token count): a function, a blank line, its def line."""
    candidates = []
    for name in sorted(held):
        for src, def_line in functions(held[name], 8, 30):
            body = tok.encode(src)
            if len(body) > 300:
                continue
            candidates.append((tok.encode(src + "\n" + def_line), len(body)))
    return spread(candidates, n)


def run_drafts(model, tok, prompts, draft, k, max_tokens, penalty=None) -> dict:
    """Greedy generation over ``prompts``; ``max_tokens``: an int or one per
    prompt; ``penalty``: keyword arguments of ``make_logits_processors``."""
    stats = mlx_spec.SpecStats()
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    t0 = time.perf_counter()
    for p, n in zip(prompts, max_tokens):
        for _ in mlx_spec.stream_generate(
            model,
            tok,
            p,
            max_tokens=n,
            draft=draft,
            num_draft_tokens=k,
            stats=stats,
            logits_processors=processors(penalty),
        ):
            pass
    cum = stats.acceptance_per_position
    cond = [
        a / prev if prev else 0.0
        for a, prev in zip(stats.accepted_at, [None] + stats.accepted_at[:-1])
    ]
    cond[0] = cum[0] if cum else 0.0
    return {
        "draft": draft,
        "k": k,
        "verify_passes": stats.verify_passes,
        "generated": stats.generated,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_per_position": [round(x, 3) for x in cum],
        "conditional_per_position": [round(x, 3) for x in cond],
        "tokens_per_pass": round(stats.tokens_per_pass, 3),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def shuffled(head, seed: int):
    """The head's parameters with each tensor's entries randomly permuted."""
    rng = np.random.default_rng(seed)
    flat = []
    for name, v in tree_flatten(head.parameters()):
        a = np.array(v.astype(mx.float32)).reshape(-1)
        flat.append(
            (name, mx.array(rng.permutation(a).reshape(v.shape)).astype(v.dtype))
        )
    return tree_unflatten(flat)


def repeated_share(tokens, n: int = 16) -> float:
    """Share of the n-token windows of ``tokens`` that occurred earlier in it."""
    seen, repeats, windows = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        w = tuple(tokens[i : i + n])
        repeats += w in seen
        windows += 1
        seen.add(w)
    return repeats / max(windows, 1)


LOOPING_SHARE = 0.3  # a text with more repeated windows than this loops
# What the README's first command adds to greedy decoding (its flags
# --repetition-penalty 1.25 --repetition-context-size 64).
FIRST_COMMAND_PENALTY = dict(repetition_penalty=1.25, repetition_context_size=64)


def processors(penalty):
    return make_logits_processors(**penalty) if penalty else None


def greedy_tokens(model, tok, prompt: str, n: int, penalty=None) -> list:
    """``n`` tokens of plain greedy decoding (under ``penalty``) after ``prompt``."""
    out = mlx_spec.stream_generate(
        model, tok, prompt, n, draft="none", logits_processors=processors(penalty)
    )
    return [r.token for r in out]


def loop_shares(
    model, tok, held: dict, n: int, max_tokens: int = 128, penalty=None
) -> dict:
    """Repeated shares of greedy text (under ``penalty``) after ``n`` held-out
    ``def`` lines and of the code that really follows them (see item 5)."""
    starts = []
    for name in sorted(held):
        text = held[name]
        for src, def_line in functions(text):  # a def line may recur: find its body
            starts.append((def_line, text[text.find(src) :]))
    model_shares, code_shares = [], []
    for def_line, code in spread(starts, n):
        prompt = tok.encode(def_line)
        out = greedy_tokens(model, tok, def_line, max_tokens, penalty)
        model_shares.append(repeated_share(prompt + out))
        code_shares.append(repeated_share(tok.encode(code)[: len(prompt) + len(out)]))
    res = {}
    for name, shares in (("model", model_shares), ("code", code_shares)):
        res[name] = {
            "mean_share": float(np.mean(shares)) if shares else 0.0,
            "looping": sum(x > LOOPING_SHARE for x in shares),
        }
    res["prompts"], res["penalty"] = len(model_shares), penalty or {}
    print(
        f"{'penalised: ' if penalty else ''}loops over {res['prompts']} held-out "
        f"def lines: model mean share "
        f"{res['model']['mean_share']:.3f}, {res['model']['looping']} looping; the "
        f"held-out code {res['code']['mean_share']:.3f}, {res['code']['looping']} looping",
        flush=True,
    )
    return res


def first_command_sample(
    model, tok, prompt="def fibonacci(n):", n=128, penalty=None
) -> dict:
    out = greedy_tokens(model, tok, prompt, n, penalty)
    text = tok.decode(out)
    share = repeated_share(tok.encode(prompt) + out)
    print(f"first command, penalty {penalty or 'none'}", end=" ")
    print(f"({len(out)} tokens, repeated share {share:.2f}):")
    print(prompt + text, flush=True)
    return {
        "prompt": prompt,
        "penalty": penalty or {},
        "tokens": len(out),
        "text": text,
        "repeated_share": share,
    }


def _print(title: str, r: dict) -> None:
    print(
        f"{title:<22} k={r['k']} passes={r['verify_passes']:4d} "
        f"accepted {r['accepted']}/{r['drafted']} "
        f"per-position {r['acceptance_per_position']} "
        f"conditional {r['conditional_per_position']} "
        f"tokens/pass {r['tokens_per_pass']:.2f} ({r['seconds']}s)",
        flush=True,
    )


def evaluate(
    model_dir: Path,
    n_prompts: int = 16,
    max_tokens: int = 64,
    n_copy: int = 8,
    ks=(1, 2, 3, 4),
    seed: int = 0,
    n_loop_prompts: int = 20,
) -> dict:
    model_dir = Path(model_dir)
    training = json.loads((model_dir / "training.json").read_text())
    length = training["config"]["seq_len"] + 1
    model, tok = mlx_spec.load(str(model_dir))
    train_texts, held = heldout_texts(training)
    vocab = training["config"]["vocab_size"]
    from tokenizers import Tokenizer

    enc = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train_stream = encode_files(enc, train_texts)
    held_stream = encode_files(enc, [held[n] for n in sorted(held)])
    res = {
        "heldout_files": len(held),
        "heldout_tokens": int(held_stream.size),
        "model_loss": model_loss(model, held_stream, length),
        "unigram_loss": unigram_loss(train_stream, held_stream, vocab),
    }
    print(
        f"held-out loss: model {res['model_loss']:.4f} nats/token, unigram "
        f"{res['unigram_loss']:.4f} nats/token over {res['heldout_tokens']} tokens "
        f"of {res['heldout_files']} held-out files",
        flush=True,
    )

    penalty = FIRST_COMMAND_PENALTY
    res["first_command"] = first_command_sample(model, tok)
    res["first_command_penalised"] = first_command_sample(model, tok, penalty=penalty)
    res["loops"] = loop_shares(model, tok, held, n_loop_prompts)
    res["loops_penalised"] = loop_shares(
        model, tok, held, n_loop_prompts, penalty=penalty
    )
    prompts = code_prompts(held, tok, n_prompts, 320)
    res["code_prompts"] = len(prompts)
    res["mtp"], res["mtp_penalised"] = [], []
    for k in ks:
        r = run_drafts(model, tok, prompts, "mtp", k, max_tokens)
        _print("mtp", r)
        res["mtp"].append(r)
    for k in ks:
        r = run_drafts(model, tok, prompts, "mtp", k, max_tokens, penalty)
        _print("mtp (penalised)", r)
        res["mtp_penalised"].append(r)
    head = model.mtp_head
    trained = head.parameters()
    head.update(shuffled(head, seed))
    res["mtp_shuffled"] = []
    for k in ks:
        r = run_drafts(model, tok, prompts, "mtp", k, max_tokens)
        _print("mtp (shuffled head)", r)
        res["mtp_shuffled"].append(r)
    head.update(trained)

    copies = copy_prompts(held, tok, n_copy)
    res["copy_prompts"] = len(copies)
    res["copy"] = []
    for draft in ("ngram", "mtp", "mtp+ngram"):
        r = run_drafts(
            model, tok, [p for p, _ in copies], draft, 4, [n for _, n in copies]
        )
        _print(f"copy {draft}", r)
        res["copy"].append(r)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--loop-prompts", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for name in ("prompts", "max_tokens", "copies", "loop_prompts"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            p.error(f"{flag} must be at least 1, got {getattr(args, name)}")
    if args.model is None:
        from mlx_spec.demo import default_model_path

        args.model = default_model_path()
    res = evaluate(
        args.model,
        args.prompts,
        args.max_tokens,
        args.copies,
        n_loop_prompts=args.loop_prompts,
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
