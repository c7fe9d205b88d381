"""``mlx_spec chat``: a terminal chat with speculative decoding.

Across turns only the new tokens are prefilled: the target's KV and GDN state,
the drafter's state (MTP cache, n-gram index) and the history carry over in one
:class:`~mlx_spec.Session`. Each turn's prompt is built as
``mlx_lm.chat`` builds it (the chat template applied to the new user message),
or, for a tokenizer without a chat template, the user's text as a plain
continuation of the conversation so far.

A line starting with ``/`` is a command (see ``COMMANDS``); an empty line
prompts again. Ctrl-C during a reply stops it after the current verify pass:
the tokens shown so far are kept, and the state is consistent (exactly as if
generation had stopped there). Ctrl-C or Ctrl-D at the prompt exits.
"""

import contextlib
import os
import signal
import sys
import time
from typing import Optional

from ..core.stats import SpecStats
from ..drafters import default_draft
from ..mlx_lm_compat import chat_arg_parser
from ..model_files import load_model
from ..models.pipeline import broadcast_text
from ..session import Session, check_max_tokens
from ..states.memory import common_prefix
from ..states.session_file import check_writable, load_session, save_session
from ..states.snapshot import capture, drafter_name
from .common import (
    CommandError,
    add_draft_model_flags,
    add_penalty_flags,
    add_pipeline_flag,
    add_speculation_flags,
    add_state_dir_flags,
    attach_draft_model,
    bad_input,
    check_run_flags,
    check_state_dir_flags,
    command,
    decode_options,
    join_pipeline,
    logits_processors_from_flags,
    open_state_store,
    refuse_unsupported,
    sampler_from_flags,
)

PROG = "mlx_spec chat"
# mlx_lm.chat flags that speculative decoding here does not implement.
_UNSUPPORTED = {"max_kv_size": "--max-kv-size"}
COMMANDS = {
    "/reset": "forget the conversation",
    "/stats": "speculation statistics",
    "/help": "this list",
    "/quit": "exit, as Ctrl-D does",
}
ALIASES = {"/exit": "/quit", "q": "/quit", "r": "/reset", "h": "/help"}
HELP = "Commands: " + ", ".join(f"{c} ({what})" for c, what in COMMANDS.items())
SHARED_MIN = 32  # tokens of a system prompt worth keeping a state for


class ChatSession:
    """One conversation: turn prompts, the decoder and per-turn statistics."""

    def __init__(self, model, tokenizer, args, store=None):
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.store = store  # states on disk (--state-dir): None when off
        self.sampler = sampler_from_flags(args, tokenizer)
        self.logits_processors = logits_processors_from_flags(args)
        self.session_stats = SpecStats()
        self.turn_stats = None  # no reply yet
        self.turn_tps = self.session_tokens = self.session_seconds = 0.0
        self.prefilled = 0
        self.reset()

    def reset(self):
        draft = self.args.draft or default_draft(self.model)
        options = decode_options(self.args, draft)
        self.session = Session(self.model, options, stats=self.session_stats)
        self.decoder = self.session.decoder

    def turn_tokens(self, text: str):
        tok = self.tokenizer
        if tok.has_chat_template:
            messages = [{"role": "user", "content": text}]
            if self.args.system_prompt is not None:
                messages.insert(
                    0, {"role": "system", "content": self.args.system_prompt}
                )
            return tok.apply_chat_template(messages, add_generation_prompt=True)
        # Plain continuation: the user's text follows what was said so far.
        first = not self.decoder.history
        if first and self.args.system_prompt:
            text = self.args.system_prompt + "\n" + text
        return tok.encode(text if first else "\n" + text, add_special_tokens=first)

    def _from_store(self, tokens):
        """``(tokens still to feed, tokens read from disk)`` of a first turn's
        ``tokens``: the decoder takes the longest state on disk they
        continue; without one, the system prompt's part is fed now and its
        state kept there, so the next conversation with that system prompt
        starts after it."""
        draft = drafter_name(self.decoder.drafter)
        state = self.store.lookup(draft, tokens[:-1])  # one token at least left
        if state is not None:
            self.session.restore(state)
            n = len(state.history)
            return tokens[n:], n - state.pending
        shared = min(
            common_prefix(tokens, self.turn_tokens(other)) for other in ("a", "b")
        )
        if shared < SHARED_MIN or shared >= len(tokens):
            return tokens, 0
        self.decoder.feed(tokens[:shared])
        self.store.put(capture(self.decoder, copy_caches=True, flush=False))
        return tokens[shared:], 0

    def reply(self, text: str, interrupted=lambda: False):
        """Yield the reply's text segments; stops early when ``interrupted()``."""
        tokens, read = self.turn_tokens(text), 0
        self.prefilled = len(tokens)
        if self.store is not None and not self.decoder.history:
            tokens, read = self._from_store(tokens)
            self.prefilled -= read
        before = SpecStats(**vars(self.session_stats))
        detok = self.tokenizer.detokenizer
        detok.reset()
        steps = self.session.generate(
            tokens,
            max_tokens=self.args.max_tokens,
            sampler=self.sampler,
            logits_processors=self.logits_processors,
            stop_tokens=self.tokenizer.eos_token_ids,
            should_stop=interrupted,  # checked between passes: state stays whole
        )
        tic, n = time.perf_counter(), 0
        for token, _, _ in steps:
            if n == 0:
                tic = time.perf_counter()  # generation time excludes the prefill
            n += 1
            if token in self.tokenizer.eos_token_ids:
                break
            detok.add_token(token)
            yield detok.last_segment
        detok.finalize()
        yield detok.last_segment
        seconds = time.perf_counter() - tic
        s = self.session_stats
        self.turn_stats = SpecStats(
            verify_passes=s.verify_passes - before.verify_passes,
            generated=s.generated - before.generated,
            drafted=s.drafted - before.drafted,
            accepted=s.accepted - before.accepted,
        )
        self.turn_tps = n / seconds if seconds > 0 else 0.0
        self.session_tokens += n
        self.session_seconds += seconds

    def stats_text(self) -> str:
        t, s = self.turn_stats, self.session_stats
        session_tps = (
            self.session_tokens / self.session_seconds if self.session_seconds else 0
        )
        last = (
            "no reply yet"
            if t is None
            else f"{t.generated} tokens, {self.turn_tps:.1f} tokens/s, "
            f"{t.accepted}/{t.drafted} drafts accepted ({t.acceptance_rate:.1%}), "
            f"{t.tokens_per_pass:.2f} tokens per pass, prefilled {self.prefilled} tokens"
        )
        return (
            f"last turn: {last}\n"
            f"session:   {s.generated} tokens, {session_tps:.1f} tokens/s, "
            f"{s.accepted}/{s.drafted} drafts accepted ({s.acceptance_rate:.1%}), "
            f"{len(self.decoder.history)} tokens of context\n"
            f"acceptance per draft position: "
            + " ".join(f"{a:.2f}" for a in s.acceptance_per_position)
        )


class _Interrupt:
    """SIGINT during a reply sets a flag that the reply checks between passes."""

    def __init__(self):
        self.hit = False

    def __enter__(self):
        self.hit = False
        self.old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_):
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.old)


def setup_parser():
    parser = add_speculation_flags(
        chat_arg_parser(), PROG, "Chat with speculative decoding."
    )
    parser.add_argument("--top-k", type=int, default=0, help="Sampling top-k")
    add_penalty_flags(parser)
    add_draft_model_flags(parser)
    add_pipeline_flag(parser, "reads the lines and prints")
    parser.add_argument(
        "--prompt-cache-file",
        help="Load the session from this file if it exists, and save it to "
        "exactly this path on exit.",
    )
    add_state_dir_flags(
        parser,
        "the state where the system prompt ends is kept there, so a later "
        "chat (or a server sharing DIR) with the same system prompt starts "
        "after it",
    )
    return parser


def run_command(chat, line: str) -> bool:
    """Run the command ``line`` names; False when it asks to quit."""
    word = line.split()[0]
    name = ALIASES.get(word, word)
    if name == "/quit":
        return False
    if name == "/reset":
        chat.reset()
        print("[conversation reset]")
    elif name == "/stats":
        print(chat.stats_text())
    elif name == "/help":
        print(HELP)
    else:
        print(f"unknown command {name}. {HELP}")
    return True


def _read_line() -> Optional[str]:
    """The next input line; None at Ctrl-D or Ctrl-C. A line that is not
    valid UTF-8 is reported on stderr and skipped (the chat goes on)."""
    while True:
        try:
            line = input(">> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return None
        except UnicodeDecodeError as e:  # a stdin that cannot escape bad bytes
            print(f"\n{PROG}: {_NOT_UTF8} ({e.reason})", file=sys.stderr)
            continue
        try:
            line.encode("utf-8")  # bad bytes read as lone surrogates
            return line
        except UnicodeEncodeError as e:
            bad = ord(line[e.start]) & 0xFF
            print(f"{PROG}: {_NOT_UTF8} (byte 0x{bad:02x})", file=sys.stderr)


_NOT_UTF8 = "that line is not valid UTF-8 text; it was skipped"


def _escape_bad_input_bytes():
    """Read stdin's bytes that are not UTF-8 as lone surrogates, so such a
    line is skipped whole (a strict decoder fails on a block of input,
    which may hold the lines after it too)."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None and sys.stdin.encoding.lower().replace("-", "") in (
        "utf8",
    ):
        reconfigure(errors="surrogateescape")


def converse(chat, group=None):
    """Read lines until /quit, Ctrl-D or Ctrl-C at the prompt; stream replies.

    With a pipeline ``group`` rank 0 reads and every rank gets the line; a
    reply then runs to its end (Ctrl-C ends the chat at the prompt only)."""
    interrupt = _Interrupt()
    while True:
        line = _read_line() if group is None or group.rank() == 0 else None
        if group is not None:
            line = broadcast_text(group, line)
        if line is None:
            return
        if not line:
            continue
        if line.startswith("/") or line in ALIASES:
            if not run_command(chat, line):
                return
            continue
        stop = (lambda: interrupt.hit) if group is None else (lambda: False)
        with interrupt:
            for segment in chat.reply(line, stop):
                print(segment, end="", flush=True)
        print("\n[interrupted]" if interrupt.hit else "", flush=True)


@command(PROG)
def main(argv=None):
    args = setup_parser().parse_args(argv)
    check_run_flags(args)
    cache_file = args.prompt_cache_file
    with bad_input():
        check_max_tokens(args.max_tokens)
        decode_options(args, args.draft or "ngram")  # the model's default: below
        refuse_unsupported(args, _UNSUPPORTED)
        if cache_file:
            check_writable(cache_file)
    if args.pipeline and cache_file:
        raise CommandError("--prompt-cache-file is not supported with --pipeline")
    check_state_dir_flags(args)
    group = join_pipeline(args)
    model_path, model, tokenizer = load_model(
        args.model,
        mtp_path=args.mtp_path,
        revision=args.revision,
        tokenizer_config={"trust_remote_code": args.trust_remote_code},
        adapter_path=args.adapter_path,
        pipeline_group=group,
    )
    args.draft = attach_draft_model(args, model) or default_draft(model)
    store = open_state_store(args, model, tokenizer, model_path)
    with bad_input():
        chat = ChatSession(model, tokenizer, args, store)
        if cache_file:
            try:
                load_session(cache_file, chat.session, model_path)
            except FileNotFoundError:
                pass  # a new session, saved there on exit
    quiet = group is not None and group.rank() != 0  # rank 0 speaks
    with contextlib.ExitStack() as stack:
        if quiet:
            devnull = stack.enter_context(open(os.devnull, "w"))
            stack.enter_context(contextlib.redirect_stdout(devnull))
        print(
            f"[mlx_spec chat] {model_path} (draft: {args.draft}). {HELP}.", flush=True
        )
        _escape_bad_input_bytes()
        converse(chat, group)
    if store is not None:
        store.close()  # the states handed to its writer are written
    if cache_file:
        with bad_input(OSError):
            save_session(cache_file, chat.session, model_path)
    return 0
