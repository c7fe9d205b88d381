"""``mlx_spec server``: an OpenAI- and Anthropic-compatible HTTP server that
decodes every request speculatively (a drop-in for ``mlx_lm.server``).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions`` and ``POST /v1/messages``. Binds to 127.0.0.1 unless
told otherwise; ``--port 0`` picks a free port. Once it accepts connections
it prints one line, ``[mlx_spec server] listening on http://HOST:PORT ...``.
Every flag is checked before the model loads; a bad one is refused with one
line naming it.
"""

import argparse
import json
import logging
import math
import os
import re
import sys


from ..drafters import default_draft
from ..server.engine import Engine
from ..server.pipeline_engine import PipelineEngine
from ..server.http import bind, make_app, serve
from ..server.limits import BODY_SECONDS, HEADER_SECONDS, WRITE_SECONDS
from ..server.limits import ClientLimits
from ..server.requests import MAX_TEMPERATURE, MAX_TOKENS_LIMIT, MIN_TEMPERATURE
from ..server.requests import ServerContext
from ..model_files import load_model, model_name
from .common import (
    CommandError,
    MODEL_HELP,
    add_draft_model_flags,
    add_draft_options,
    add_pipeline_flag,
    add_state_dir_flags,
    attach_draft_model,
    bad_input,
    byte_size,
    check_state_dir_flags,
    command,
    join_pipeline,
    open_state_store,
)

PROG = "mlx_spec server"
API_KEY_ENV = "MLX_SPEC_API_KEY"
ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+")


def setup_parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address to bind (default: 127.0.0.1). Bound to a loopback address, "
        "the server answers only requests for localhost, 127.0.0.1, [::1] or this "
        "host (which stops DNS rebinding).",
    )
    p.add_argument(
        "--port", type=int, default=8080, help="Port, 0..65535 (0: a free one)."
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="A web origin (e.g. http://localhost:3000; '*': any) whose pages may "
        "use the server from a browser (CORS); repeatable. Default: none, and "
        "requests from other pages are refused.",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        metavar="KEY",
        help="Require this key on every route but /health (an 'Authorization: "
        f"Bearer KEY' or 'x-api-key: KEY' header). Default: ${API_KEY_ENV}, "
        "else no key.",
    )
    add_draft_options(p)
    add_draft_model_flags(p)
    p.add_argument(
        "--temp", type=float, default=0.0, help="Default sampling temperature."
    )
    p.add_argument("--top-p", type=float, default=1.0, help="Default top-p.")
    p.add_argument("--top-k", type=int, default=0, help="Default top-k.")
    p.add_argument("--min-p", type=float, default=0.0, help="Default min-p.")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="Default max tokens, for requests that do not say (default: 512).",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=MAX_TOKENS_LIMIT,
        metavar="N",
        help="The most tokens any reply may have: a request asking for more is "
        "capped (finish_reason 'length'), as it is at what the prompt leaves of "
        f"the model's context (default: {MAX_TOKENS_LIMIT}).",
    )
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
        type=byte_size,
        default=1 << 30,
        help="Most bytes of conversation states kept, e.g. 2G (default: 1G).",
    )
    add_state_dir_flags(
        p,
        "states leaving memory and all of them when the server stops are "
        "written there, and a later request (after a restart too, or in "
        "another server sharing DIR) continues one",
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
    p.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_SECONDS,
        metavar="SECONDS",
        help="A request's headers must arrive within this time of the connection "
        "opening (or of the previous response); else the connection is closed "
        f"(default: {HEADER_SECONDS:g}).",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_SECONDS,
        metavar="SECONDS",
        help="A request's body must arrive within this time of its headers; else "
        f"a 408 error (default: {BODY_SECONDS:g}).",
    )
    p.add_argument(
        "--write-timeout",
        type=float,
        default=WRITE_SECONDS,
        metavar="SECONDS",
        help="A connection whose client reads nothing of what it is sent for this "
        f"long is closed, ending its request (default: {WRITE_SECONDS:g}).",
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


def _check_range(flag: str, value, low=None, high=None, finite=False):
    if finite and not math.isfinite(value):
        raise CommandError(f"{flag} must be a finite number, got {value}")
    if low is not None and value < low or high is not None and value > high:
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise CommandError(f"{flag} must be {bounds}, got {value}")


def check_flags(args):
    """A :class:`CommandError` naming the first flag out of its range (before
    anything loads, so no client is ever blamed for a server default)."""
    _check_range("--port", args.port, 0, 65535)
    _check_range("--temp", args.temp, 0, MAX_TEMPERATURE, finite=True)
    if 0 < args.temp < MIN_TEMPERATURE:
        raise CommandError(
            f"--temp must be 0 or in {MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}, "
            f"got {args.temp}"
        )
    _check_range("--top-p", args.top_p, 0, 1, finite=True)
    _check_range("--top-k", args.top_k, 0)
    _check_range("--min-p", args.min_p, 0, 1, finite=True)
    _check_range("--max-tokens-limit", args.max_tokens_limit, 1)
    _check_range("--max-tokens", args.max_tokens, 1, args.max_tokens_limit)
    for flag in ("--header-timeout", "--body-timeout", "--write-timeout"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not (math.isfinite(value) and value > 0):
            raise CommandError(
                f"{flag} must be a positive number of seconds, got {value}"
            )
    _check_range("--prompt-cache-size", args.prompt_cache_size, 0)
    _check_range("--prompt-cache-bytes", args.prompt_cache_bytes, 0)
    check_state_dir_flags(args)
    _check_range("--decode-concurrency", args.decode_concurrency, 1)
    _check_range("--prefill-step-size", args.prefill_step_size, 1)
    _check_range("--prefill-chunk", args.prefill_chunk, 1)
    for origin in args.allow_origin:
        if origin != "*" and not ORIGIN.fullmatch(origin):
            raise CommandError(
                f"--allow-origin must be '*' or scheme://host[:port] (no path), "
                f"got {origin!r}"
            )
    if args.api_key is not None and not args.api_key.strip():
        raise CommandError("--api-key must not be empty")
    if not isinstance(args.chat_template_args, dict):
        raise CommandError("--chat-template-args must be a JSON object")


@command(PROG)
def main(argv=None):
    args = setup_parser().parse_args(argv)
    check_flags(args)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(message)s"
    )
    group = join_pipeline(args)
    path, model, tokenizer = load_model(
        args.model,
        mtp_path=args.mtp_path,
        revision=args.revision,
        pipeline_group=group,
    )
    draft = attach_draft_model(args, model) or default_draft(model)
    vocab_size = config_int(model, "vocab_size")
    if vocab_size is not None and args.top_k >= vocab_size:
        raise CommandError(
            f"--top-k must be below the vocabulary size {vocab_size}, got {args.top_k}"
        )
    engine_class, extra = Engine, {}
    if group is not None:
        engine_class, extra = PipelineEngine, {"group": group}
    store = open_state_store(args, model, tokenizer, model_name(args.model, path))
    if store is not None:
        extra["state_store"] = store
    context_length = config_int(model, "max_position_embeddings")
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
            context_length=context_length,
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
        context_length=context_length,
        max_tokens_limit=args.max_tokens_limit,
        vocab_size=vocab_size,
        chat_template_args=args.chat_template_args,
    )
    with bad_input(OSError):
        sock = bind(args.host, args.port)
    app = make_app(
        engine,
        ctx,
        host=args.host,
        allow_origins=args.allow_origin,
        api_key=args.api_key,
        hidden=(str(path), str(path.resolve())),
        limits=ClientLimits(
            header_seconds=args.header_timeout,
            body_seconds=args.body_timeout,
            write_seconds=args.write_timeout,
        ),
    )
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    print(
        f"[mlx_spec server] listening on http://{host}:{port} "
        f"(model {ctx.model_id!r} from {path}, draft {draft})",
        flush=True,
    )
    try:
        serve(app, sock, args.log_level)
    finally:
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
