"""What the commands share: the drafting and model flags added to mlx-lm's
parsers, the pipeline joined, the end-of-sequence tokens, input read and
output files checked. Bad input (:mod:`.command_errors`), the sampling flags
(:mod:`.sampling_flags`) and the state directory's flags
(:mod:`.state_dir_flags`) have modules of their own; their names are
re-exported here for the commands that import them from this module."""

import argparse
import os
import tempfile
from pathlib import Path

import mlx.core as mx

from ..core.state import ROLLBACK_STRATEGIES
from ..drafters import draft_names
from ..drafters.base import MAX_DRAFT_TOKENS
from ..models.pipeline import shared_seed
from ..session import DecodeOptions
from .command_errors import BAD_INPUT, CommandError, bad_input, command
from .sampling_flags import (
    MAX_SEED,
    add_penalty_flags,
    check_run_flags,
    check_sampling_flags,
    check_seed,
    logits_processors_from_flags,
    sampler_from_flags,
)
from .state_dir_flags import (
    add_state_dir_flags,
    byte_size,
    check_state_dir_flags,
    open_state_store,
)

__all__ = [
    # this module's
    "draft_length",
    "add_draft_options",
    "add_draft_model_flags",
    "add_draft_quantize_flag",
    "attach_draft_model",
    "decode_options",
    "add_revision_flag",
    "MODEL_HELP",
    "add_pipeline_flag",
    "join_pipeline",
    "add_speculation_flags",
    "refuse_unsupported",
    "add_extra_eos_tokens",
    "read_text",
    "check_output_file",
    # re-exported from the modules above, for the commands that import them here
    "BAD_INPUT",
    "CommandError",
    "bad_input",
    "command",
    "MAX_SEED",
    "add_penalty_flags",
    "check_run_flags",
    "check_sampling_flags",
    "check_seed",
    "logits_processors_from_flags",
    "sampler_from_flags",
    "add_state_dir_flags",
    "byte_size",
    "check_state_dir_flags",
    "open_state_store",
]


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
