"""``--state-dir`` and ``--state-dir-bytes``: conversation states kept on
disk (:mod:`mlx_spec.states.store`), the flags checked before a model loads."""

import argparse

from ..states.store import DEFAULT_DIR, StateStore, check_state_dir
from .command_errors import CommandError, bad_input


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
