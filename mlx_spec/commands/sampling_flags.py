"""The sampling flags of the generating commands (``--temp``, ``--top-p``,
``--top-k``, ``--min-p``, ``--xtc-*``, the penalties, ``--seed``): checked
before a model loads, then turned into mlx-lm's sampler and logits
processors."""

import argparse
import math
from pathlib import Path

from ..core.sampling import make_sampler, xtc_special_tokens
from ..mlx_lm_compat import PENALTIES, make_logits_processors
from .command_errors import CommandError, bad_input


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
