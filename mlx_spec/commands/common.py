"""What the commands share: the drafting flags added to mlx-lm's parsers, bad
input reported as one line with exit status 2, loading a model (every failure
to load named by its directory or file), and the sampler and logits
processors their flags ask for."""

import argparse
import functools
import math
import os
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from ..core.sampling import make_sampler, xtc_special_tokens
from ..core.state import ROLLBACK_STRATEGIES
from ..drafters import draft_names
from ..drafters.base import MAX_DRAFT_TOKENS
from ..errors import InputError, reported_as
from ..mlx_lm_compat import PENALTIES, make_logits_processors
from ..models.pipeline import shared_seed
from ..session import DecodeOptions
from ..states.store import DEFAULT_DIR, StateStore, check_state_dir

BAD_INPUT = 2  # exit status, as argparse uses for bad flags


def draft_length(value: str):
    """``--num-draft-tokens`` value: 'auto' or an integer (range checked later)."""
    return value if value == "auto" else int(value)


def add_draft_options(parser: argparse.ArgumentParser):
    """The drafting flags: ``--draft``, ``--num-draft-tokens`` (replacing one
    the parser has), ``--mtp-path``, ``--max-ngram``, ``--rollback``."""
    parser.add_argument(
        "--draft",
        choices=draft_names(),
        default=None,
        help="Drafter: 'mtp' the model's own multi-token-prediction head, "
        "'ngram' a lookup of the context for a continuation, 'mtp+ngram' both, "
        "'dflash' a block drafter (with --draft-model), "
        "'none' plain decoding (default: mtp+ngram when the model has an MTP "
        "head, else ngram).",
    )
    parser.add_argument(
        "--mtp-path",
        help="MTP head for a model without one: a sidecar file (mtp.safetensors "
        "written by 'mlx_spec convert'), a directory holding one, or a Hugging "
        "Face repo id (only its MTP files are downloaded).",
    )
    add_revision_flag(parser)
    parser.add_argument(
        "--max-ngram",
        type=int,
        default=3,
        help="Longest n-gram the lookup drafter matches (>= 2).",
    )
    parser.add_argument(
        "--rollback",
        choices=ROLLBACK_STRATEGIES,
        default="store",
        help="How Gated-DeltaNet layers are rolled back after a verify pass.",
    )
    actions = {a.dest: a for a in parser._actions}
    drafts = actions.get("num_draft_tokens") or parser.add_argument(
        "--num-draft-tokens"
    )
    drafts.type, drafts.default = draft_length, "auto"
    drafts.help = (
        f"Tokens drafted per verify pass (0..{MAX_DRAFT_TOKENS}), or 'auto' "
        "(default): chosen each pass from the measured verify cost and the "
        "acceptance so far, 0 while speculation does not pay."
    )


def add_draft_model_flags(parser: argparse.ArgumentParser):
    """``--draft-model`` (mlx-lm's flag, given a DFlash drafter's meaning)
    and ``--draft-quantize``."""
    actions = {a.dest: a for a in parser._actions}
    flag = actions.get("draft_model") or parser.add_argument("--draft-model")
    flag.help = (
        "DFlash block drafter for --draft dflash (the default when this is "
        "given): a directory or a Hugging Face repo id holding its config.json "
        "and safetensors (e.g. z-lab's drafter for this model)."
    )
    add_draft_quantize_flag(parser)


def add_draft_quantize_flag(parser: argparse.ArgumentParser):
    """``--draft-quantize``: the drafter quantised in memory."""
    parser.add_argument(
        "--draft-quantize",
        type=int,
        choices=(4, 8),
        default=None,
        help="Quantise the --draft-model drafter's linear layers in memory "
        "to 4 or 8 bits (default: as stored).",
    )


def attach_draft_model(args, model) -> "str | None":
    """Load ``--draft-model`` for ``model`` (a drafter that does not fit is
    refused in one line naming the field); the draft the flags then ask
    for. ``--draft dflash`` without a drafter takes the one that ships with
    the model (the demo model's), else it is refused in one line."""
    from ..demo import bundled_drafter
    from ..loading import use_draft_model

    if args.draft_model is None:
        if args.draft != "dflash":
            return args.draft
        with bad_input(FileNotFoundError):
            bundled = bundled_drafter(args.model)
        if bundled is None:
            raise CommandError(
                "--draft dflash needs --draft-model PATH_OR_REPO (only the "
                "bundled demo model brings its own)"
            )
        args.draft_model = str(bundled)
    if args.draft not in (None, "dflash"):
        raise CommandError(
            f"--draft-model is read by --draft dflash, not --draft {args.draft}"
        )
    if getattr(args, "pipeline", False):
        # Each rank holds some of the layers; the drafter reads layers of all.
        raise CommandError("--draft-model is not supported with --pipeline yet")
    with bad_input(ValueError, FileNotFoundError):
        use_draft_model(model, args.draft_model, quantize=args.draft_quantize)
    return "dflash"


def decode_options(args, draft) -> DecodeOptions:
    """The :class:`~mlx_spec.DecodeOptions` of the drafting flags, for the
    drafter ``draft`` (``--draft``, or the model's default); ``ValueError``
    naming a bad value."""
    return DecodeOptions(
        draft=draft,
        num_draft_tokens=args.num_draft_tokens,
        max_ngram=args.max_ngram,
        rollback=args.rollback,
        prefill_step_size=args.prefill_step_size,
    )


def add_revision_flag(parser: argparse.ArgumentParser):
    """``--revision``: the branch, tag or commit of a ``--model`` repo id."""
    if not any(a.dest == "revision" for a in parser._actions):
        parser.add_argument(
            "--revision",
            default=None,
            help="Branch, tag or commit of a --model given as a Hugging Face "
            "repo id (default: main).",
        )


MODEL_HELP = (
    "Model directory or Hugging Face repo id (downloaded as mlx_lm does, into "
    "the Hugging Face cache; default: the bundled demo model)."
)


def add_pipeline_flag(parser: argparse.ArgumentParser, rank0_does: str):
    """``--pipeline``; mlx-lm's own flag (chat) is kept."""
    if not any(a.dest == "pipeline" for a in parser._actions):
        parser.add_argument("--pipeline", action="store_true")
    flag = next(a for a in parser._actions if a.dest == "pipeline")
    flag.help = (
        "Split the model across the processes of an mx.distributed group "
        f"(start them with mlx.launch); rank 0 {rank0_does}."
    )


def join_pipeline(args):
    """The pipeline group of ``--pipeline`` (None without it), and the random
    seed every rank then shares (``args.seed``, or rank 0's choice), set."""
    check_seed(getattr(args, "seed", None))
    if not getattr(args, "pipeline", False):
        if getattr(args, "seed", None) is not None:
            mx.random.seed(args.seed)
        return None
    group = mx.distributed.init()
    args.seed = shared_seed(group, getattr(args, "seed", None))
    mx.random.seed(args.seed)
    return group


def add_speculation_flags(parser: argparse.ArgumentParser, prog: str, about: str):
    """Turn one of mlx-lm's parsers into ``prog``'s: the demo model as the
    default model, and the drafting flags."""
    parser.prog, parser.description = prog, about
    add_draft_options(parser)
    model = next(a for a in parser._actions if a.dest == "model")
    model.default = None
    model.help = MODEL_HELP
    return parser


def refuse_unsupported(args, flags):
    """CommandError for the first of mlx-lm's ``flags`` (dest -> flag) that
    is set but not implemented here."""
    for dest, flag in flags.items():
        if getattr(args, dest, None):
            raise CommandError(f"{flag} is not supported with speculative decoding")


class CommandError(InputError):
    """Bad input to a command: printed as one line, exit status 2."""


def command(prog: str):
    """Decorate a command's ``main(argv)``: an :class:`~mlx_spec.errors.InputError`
    it raises (a :class:`CommandError`, or the library's own, e.g. a model
    that cannot be opened) is printed as ``prog: message`` on stderr and
    returned as exit status 2."""

    def decorate(main):
        @functools.wraps(main)
        def run(argv=None):
            try:
                return main(argv)
            except InputError as e:
                print(f"{prog}: {e}", file=sys.stderr)
                return BAD_INPUT

        return run

    return decorate


def bad_input(*errors):
    """Report ``errors`` (default: ``ValueError``) raised in the block as bad input."""
    return reported_as(CommandError, *errors)


def check_sampling_flags(args):
    """:class:`CommandError` naming the first sampling flag out of range
    (checked before the model loads). A ``--top-k`` of at least the
    vocabulary size keeps every token, as it does in the server."""
    if not (math.isfinite(args.temp) and args.temp >= 0):
        raise CommandError(f"--temp must be >= 0, got {args.temp}")
    for name, low, high in (
        ("top_p", 0, 1),
        ("min_p", 0, 1),
        ("xtc_probability", 0, 1),
        ("xtc_threshold", 0, 0.5),
    ):
        value = getattr(args, name, None)
        if value is not None and not low <= value <= high:  # NaN is neither
            raise CommandError(f"{_flag(name)} must be in {low}..{high}, got {value}")
    if getattr(args, "top_k", 0) < 0:
        raise CommandError(f"--top-k must be >= 0 (0: off), got {args.top_k}")
    if getattr(args, "min_tokens_to_keep", 1) < 1:
        raise CommandError(
            f"--min-tokens-to-keep must be >= 1, got {args.min_tokens_to_keep}"
        )


def sampler_from_flags(args, tokenizer):
    """The sampler of ``--temp``, ``--top-p``, ``--top-k``, ``--xtc-*`` (and
    ``--min-p``, ``--min-tokens-to-keep`` where the command has them)."""
    check_sampling_flags(args)
    with bad_input():
        return make_sampler(
            args.temp,
            args.top_p,
            getattr(args, "min_p", 0.0),
            getattr(args, "min_tokens_to_keep", 1),
            top_k=args.top_k,
            xtc_probability=args.xtc_probability,
            xtc_threshold=args.xtc_threshold,
            xtc_special_tokens=xtc_special_tokens(tokenizer),
        )


def add_penalty_flags(parser: argparse.ArgumentParser):
    """``--repetition-penalty``, ``--presence-penalty``, ``--frequency-penalty``
    and their ``--*-context-size``: the penalties mlx_lm.server takes per request."""
    for name, _, context in PENALTIES:
        kind = name.split("_")[0]
        parser.add_argument(
            _flag(name),
            type=float,
            default=0.0,
            help=f"Penalty on the tokens seen in the last --{kind}-context-size "
            f"tokens (0: off), as mlx_lm.server's {name}.",
        )
        parser.add_argument(
            _flag(context),
            type=int,
            default=20,
            help=f"Tokens of context the {kind} penalty looks at (default 20).",
        )


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def logits_processors_from_flags(args):
    """mlx-lm's logits processors for the penalty flags (None when all are 0)."""
    chosen = {}
    for name, low, context in PENALTIES:
        value, size = getattr(args, name), getattr(args, context)
        if not math.isfinite(value) or (low is not None and value < low):
            floor = "a number" if low is None else f"a number >= {low}"
            raise CommandError(f"{_flag(name)} must be {floor}, got {value}")
        if size < 1:
            raise CommandError(f"{_flag(context)} must be >= 1, got {size}")
        if value:
            chosen[name], chosen[context] = value, size
    return make_logits_processors(**chosen) if chosen else None


MAX_SEED = 2**64 - 1  # MLX's random seed is an unsigned 64-bit integer


def check_seed(seed):
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise CommandError(f"--seed must be in 0..2**64-1, got {seed}")


def check_run_flags(args):
    """The flags of a generating command checked before its model loads:
    sampling, ``--seed``, ``--prefill-step-size``, ``--adapter-path``."""
    check_sampling_flags(args)
    check_seed(getattr(args, "seed", None))
    step = getattr(args, "prefill_step_size", None)
    if step is not None and step < 1:
        raise CommandError(f"--prefill-step-size must be >= 1, got {step}")
    adapter = getattr(args, "adapter_path", None)
    if adapter is not None and not Path(adapter).exists():
        raise CommandError(f"--adapter-path {adapter!r} does not exist")


def add_extra_eos_tokens(tokenizer, tokens, vocab: int):
    """``--extra-eos-token``: each a token of the tokenizer's vocabulary (its
    text) or a token id below ``vocab``; anything else is refused by name
    (an unknown text would otherwise become the unknown token, or fail)."""
    known = tokenizer.get_vocab()
    for token in tokens:
        if token.isdecimal() and int(token) < vocab:
            tokenizer.add_eos_token(token)
        elif token in known:
            tokenizer.add_eos_token(str(known[token]))
        else:
            raise CommandError(
                f"--extra-eos-token {token!r} is neither a token of this "
                f"tokenizer nor a token id below {vocab}"
            )


def read_text(stream, what: str) -> str:
    """All of ``stream`` (text, or its bytes where it has them, decoded as
    UTF-8); :class:`CommandError` naming ``what`` and the first bad byte
    when it is not valid UTF-8."""
    data = getattr(stream, "buffer", None)
    if data is None:
        return stream.read()
    raw = data.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CommandError(
            f"{what} is not valid UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
            f"{e.start})"
        ) from None


def check_output_file(path, flag: str):
    """:class:`CommandError` naming ``flag`` and ``path`` unless a file can
    be written there: checked before a long run, by creating a file beside it."""
    target = Path(path)
    if target.is_dir():
        raise CommandError(f"{flag} {str(path)!r} is a directory")
    try:
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise CommandError(f"{flag} {str(path)!r} cannot be written: {e.strerror}")


def byte_size(text: str) -> int:
    """A size flag's value: a number of bytes, or with K/M/G/T (1024s)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None


def add_state_dir_flags(parser: argparse.ArgumentParser, what: str):
    """``--state-dir`` and ``--state-dir-bytes``: conversation states kept on
    disk (``what``: which states the command writes there)."""
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help=f"Keep conversation states on disk in DIR (e.g. {DEFAULT_DIR}): "
        f"{what}. Default: off.",
    )
    parser.add_argument(
        "--state-dir-bytes",
        type=byte_size,
        metavar="SIZE",
        default=10 << 30,
        help="Most bytes of states kept in --state-dir, least recently used "
        "removed first, e.g. 20G (default: 10G).",
    )


def check_state_dir_flags(args):
    """Refuse unusable ``--state-dir`` flags before a model is loaded."""
    if args.state_dir_bytes < 0:
        size = args.state_dir_bytes
        raise CommandError(f"--state-dir-bytes must be >= 0, got {size}")
    if args.state_dir is None:
        return
    if getattr(args, "pipeline", False):
        raise CommandError("--state-dir does not work with --pipeline")
    with bad_input():
        check_state_dir(args.state_dir)


def open_state_store(args, model, tokenizer, name: str):
    """The disk tier ``--state-dir`` asks for (None: off)."""
    if args.state_dir is None:
        return None
    with bad_input(OSError, ValueError):
        return StateStore.for_model(
            args.state_dir, args.state_dir_bytes, model, tokenizer, name
        )
