"""A command's bad input: :class:`CommandError`, reported as one line
(``prog: message``) with exit status 2 by the :func:`command` decorator."""

import functools
import sys

from ..errors import InputError, reported_as

BAD_INPUT = 2  # exit status, as argparse uses for bad flags


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
