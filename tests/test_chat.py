"""``mlx_spec chat``: turns, state carried across turns, save/load, Ctrl-C."""

import signal
import subprocess
import sys
import time

import mlx.core as mx
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.models.cache import make_prompt_cache

from mlx_spec.chat import ChatSession, setup_parser

TURNS = ["def area(width, height):", "x = area(3, 4)", "print(x)"]


def chat_cmd(model_dir, *extra):
    return [
        sys.executable,
        "-m",
        "mlx_spec",
        "chat",
        "--model",
        str(model_dir),
        "--max-tokens",
        "24",
        *extra,
    ]


def replies_of(stdout):
    """The reply after each '>> ' prompt (stdin is not echoed)."""
    return [part.rstrip("\n") for part in stdout.split(">> ")[1:]]


def reference_replies(model, tok, turns, max_tokens=24):
    """What mlx-lm greedy gives for the same conversation: the same turn
    tokens (plain-continuation fallback: this tokenizer has no chat template),
    one prompt cache carried across turns."""
    args = setup_parser().parse_args(["--max-tokens", str(max_tokens)])
    session = ChatSession(model, tok, args)  # only used to build turn tokens
    cache, out = make_prompt_cache(model), []
    for i, text in enumerate(turns):
        session.decoder.history = [0] * i  # "not the first turn" after turn 0
        tokens = session.turn_tokens(text)
        reply = [
            r.token
            for r in mlx_stream_generate(
                model, tok, mx.array(tokens), max_tokens, prompt_cache=cache
            )
        ]
        detok = tok.detokenizer  # the streaming detokenizer, as the chat prints
        detok.reset()
        for t in reply:
            if t not in tok.eos_token_ids:
                detok.add_token(t)
        detok.finalize()
        out.append((detok.text, len(tokens)))
    return out


def test_three_turns_match_mlx_lm_and_prefill_only_new_tokens(checkpoint_dirs, models):
    model, tok = models["qwen3_next"]
    stdin = "\n".join(TURNS + ["/stats"]) + "\n"
    run = subprocess.run(
        chat_cmd(checkpoint_dirs["qwen3_next"]),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    got = replies_of(run.stdout)
    ref = reference_replies(model, tok, TURNS)
    assert got[:3] == [text for text, _ in ref]
    stats = got[3]
    assert f"prefilled {ref[2][1]} tokens" in stats  # turn 3: its own tokens only
    context = int(stats.split(" tokens of context")[0].split()[-1])
    assert ref[2][1] < context // 3


def test_save_quit_load_continue(checkpoint_dirs, tmp_path):
    model_dir = checkpoint_dirs["qwen3_5"]
    once = subprocess.run(
        chat_cmd(model_dir),
        input="\n".join(TURNS) + "\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    cache_file = tmp_path / "session.safetensors"
    first = subprocess.run(
        chat_cmd(model_dir, "--prompt-cache-file", str(cache_file)),
        input="\n".join(TURNS[:2]) + "\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert first.returncode == 0 and cache_file.exists(), first.stderr
    second = subprocess.run(
        chat_cmd(model_dir, "--prompt-cache-file", str(cache_file)),
        input=TURNS[2] + "\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert second.returncode == 0, second.stderr
    assert (
        replies_of(first.stdout)[:2] + replies_of(second.stdout)[:1]
        == replies_of(once.stdout)[:3]
    )


def test_cache_file_of_another_model_is_refused(checkpoint_dirs, tmp_path):
    cache_file = tmp_path / "s.safetensors"
    subprocess.run(
        chat_cmd(checkpoint_dirs["qwen3_5"], "--prompt-cache-file", str(cache_file)),
        input="a = 1\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    run = subprocess.run(
        chat_cmd(checkpoint_dirs["qwen3_next"], "--prompt-cache-file", str(cache_file)),
        input="b = 2\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 2
    assert "was saved for another model" in run.stderr and str(cache_file) in run.stderr


def test_interrupted_reply_keeps_a_consistent_state(models):
    """Stopping mid-reply (what Ctrl-C does) keeps exactly the tokens shown."""
    model, tok = models["qwen3_5_moe"]
    args = setup_parser().parse_args(["--max-tokens", "200", "--num-draft-tokens", "4"])
    chat = ChatSession(model, tok, args)
    shown = []
    for segment in chat.reply(TURNS[0], interrupted=lambda: len(shown) >= 5):
        shown.append(segment)
    decoder = chat.decoder
    assert 5 <= chat.turn_stats.generated < 200
    detok = tok.detokenizer
    detok.reset()
    for t in decoder.history[chat.prefilled :]:
        detok.add_token(t)
    detok.finalize()
    assert detok.text == "".join(shown)
    # Attention caches hold everything but the pending last token.
    kv = [c for c in decoder.cache.caches if hasattr(c, "offset")]
    assert kv[0].offset == len(decoder.history) - 1


def test_ctrl_c_returns_to_the_prompt_and_ctrl_d_exits(checkpoint_dirs):
    proc = subprocess.Popen(
        chat_cmd(checkpoint_dirs["qwen3_next"], "--max-tokens", "100000"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdin.write(TURNS[0] + "\n")
    proc.stdin.flush()
    time.sleep(4)  # model loaded and generating a very long reply
    proc.send_signal(signal.SIGINT)
    time.sleep(1)
    out, err = proc.communicate("/stats\n", timeout=120)  # then EOF
    assert proc.returncode == 0, err
    assert "[interrupted]" in out
    assert "last turn:" in out
