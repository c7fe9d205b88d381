"""Bad input said in one line: the error the library raises for something a
user named (a model directory, a file, a key), and any error's message as
one line."""

from contextlib import contextmanager


class InputError(Exception):
    """Bad input; the message is one line naming the value, file or key."""


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line (with its type where that is unclear)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if isinstance(error, (OSError, ValueError, RuntimeError)) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextmanager
def reported_as(kind: type, *errors: type):
    """Raise ``errors`` (default: ``ValueError``) raised in the block again as
    ``kind``, their message on one line."""
    caught = errors or (ValueError,)
    try:
        yield
    except caught as e:
        raise kind(one_line(e)) from None
