"""``mlx_spec server``: an OpenAI- and Anthropic-compatible HTTP server that
decodes every request speculatively (a drop-in for ``mlx_lm.server``).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions`` and ``POST /v1/messages``. Binds to 127.0.0.1 unless
told otherwise; ``--port 0`` picks a free port. Once it accepts connections
it prints one line, ``[mlx_spec server] listening on http://HOST:PORT ...``.
"""

import argparse
import json
import logging
import os
import signal
import sys
import threading


from ..drafters import default_draft
from ..server.engine import Engine, PipelineEngine
from ..server.http import make_server
from ..server.requests import ServerContext
from .common import (
    CommandError,
    add_draft_options,
    add_pipeline_flag,
    bad_input,
    command,
    join_pipeline,
    MODEL_HELP,
    load_model,
    model_name,
)

PROG = "mlx_spec server"


def _size(text: str) -> int:
    """``--prompt-cache-bytes``: a number of bytes, or with K/M/G/T (1024s)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None


def setup_parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument(
        "--host", default="127.0.0.1", help="Address to bind (default: 127.0.0.1)."
    )
    p.add_argument("--port", type=int, default=8080, help="Port (0: a free one).")
    add_draft_options(p)
    p.add_argument(
        "--temp", type=float, default=0.0, help="Default sampling temperature."
    )
    p.add_argument("--top-p", type=float, default=1.0, help="Default top-p.")
    p.add_argument("--top-k", type=int, default=0, help="Default top-k.")
    p.add_argument("--min-p", type=float, default=0.0, help="Default min-p.")
    p.add_argument("--max-tokens", type=int, default=512, help="Default max tokens.")
    p.add_argument(
        "--chat-template-args",
        type=json.loads,
        default={},
        help="JSON object of extra chat template arguments, e.g. '{\"enable_thinking\": false}'.",
    )
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="Most conversation states kept for reuse (default: 10).",
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=_size,
        default=1 << 30,
        help="Most bytes of conversation states kept, e.g. 2G (default: 1G).",
    )
    p.add_argument(
        "--decode-concurrency",
        type=int,
        default=4,
        help="Most requests verified together in one batched pass (default: 4).",
    )
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="Prompt tokens prefilled between two decoding passes while other "
        "requests decode (default: 256).",
    )
    add_pipeline_flag(p, "serves HTTP")
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
    )
    return p


def config_int(model, name: str):
    """A positive integer of the model's config (or its ``text_config``)."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    for source in (args, text if isinstance(text, dict) else None):
        if isinstance(source, dict):
            value = source.get(name)
        else:
            value = getattr(source, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@command(PROG)
def main(argv=None):
    args = setup_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(message)s"
    )
    if not isinstance(args.chat_template_args, dict):
        raise CommandError("--chat-template-args must be a JSON object")
    group = join_pipeline(args)
    path, model, tokenizer = load_model(
        args.model,
        mtp_path=args.mtp_path,
        revision=args.revision,
        pipeline_group=group,
    )
    draft = args.draft or default_draft(model)
    engine_class, extra = Engine, {}
    if group is not None:
        engine_class, extra = PipelineEngine, {"group": group}
    with bad_input():
        engine = engine_class(
            model,
            tokenizer,
            draft,
            args.num_draft_tokens,
            max_ngram=args.max_ngram,
            rollback=args.rollback,
            cache_bytes=args.prompt_cache_bytes,
            cache_entries=args.prompt_cache_size,
            prefill_step_size=args.prefill_step_size,
            batch_size=args.decode_concurrency,
            prefill_chunk=args.prefill_chunk,
            **extra,
        )
    if group is not None and group.rank() != 0:
        engine.join()  # decodes what rank 0 sends until rank 0 closes
        _exit_after_serving()
    ctx = ServerContext(
        tokenizer,
        model_id=model_name(args.model, path),
        defaults={
            "temperature": args.temp,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "max_tokens": args.max_tokens,
        },
        context_length=config_int(model, "max_position_embeddings"),
        vocab_size=config_int(model, "vocab_size"),
        chat_template_args=args.chat_template_args,
    )
    with bad_input(OSError):
        server = make_server(args.host, args.port, engine, ctx)
    host, port = server.server_address[:2]
    stop = threading.Event()

    def shut_down(*_):
        if not stop.is_set():
            stop.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, shut_down)
    print(
        f"[mlx_spec server] listening on http://{host}:{port} "
        f"(model {ctx.model_id!r} from {path}, draft {draft})",
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()
    _exit_after_serving()


def _exit_after_serving():
    """End the process with status 0 now that the engine has closed.

    The generation worker ran MLX on its own thread. When that OS thread
    ends, MLX frees the thread's compile cache, which takes Python's lock; if
    the main thread is by then finalizing the interpreter, the process aborts
    ("terminate called without an active exception", status -6) after a clean
    shutdown. Nothing is left to tear down here, so skip finalization."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
