"""What the commands share: bad input reported as one line with exit status 2,
loading a model (every failure to load named by its directory or file), and
the sampler their flags ask for."""

import functools
import json
import sys
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError, safe_open

from .demo import default_model_path
from .loading import load
from .mtp import SIDECAR_NAME
from .sampling import make_sampler

BAD_INPUT = 2  # exit status, as argparse uses for bad flags


class CommandError(Exception):
    """Bad input to a command: printed as one line, exit status 2."""


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line (with its type where that is unclear)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if isinstance(error, (OSError, ValueError, RuntimeError)) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def command(prog: str):
    """Decorate a command's ``main(argv)``: a :class:`CommandError` it raises is
    printed as ``prog: message`` on stderr and returned as exit status 2."""

    def decorate(main):
        @functools.wraps(main)
        def run(argv=None):
            try:
                return main(argv)
            except CommandError as e:
                print(f"{prog}: {e}", file=sys.stderr)
                return BAD_INPUT

        return run

    return decorate


@contextmanager
def bad_input(*errors):
    """Report ``errors`` (default: ``ValueError``) raised in the block as bad input."""
    caught = errors or (ValueError,)
    try:
        yield
    except caught as e:
        raise CommandError(one_line(e)) from None


def check_safetensors(file: Path):
    """Raise :class:`CommandError` naming ``file`` unless it is a whole
    safetensors file (reads only its header)."""
    try:
        with safe_open(str(file), framework="numpy"):
            pass
    except (OSError, SafetensorError) as e:
        raise CommandError(
            f"{file} is not a complete safetensors file ({one_line(e)})"
        ) from None


def check_model_files(path: Path, mtp_path=None):
    """Check what loading reads first: ``config.json`` and every weight file's
    header, so a broken one is named rather than failing deep inside loading."""
    config = path / "config.json"
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        raise CommandError(f"{path} has no config.json") from None
    except (OSError, ValueError) as e:
        raise CommandError(f"{config} is not a valid config: {one_line(e)}") from None
    files = sorted(path.glob("*.safetensors"))
    if mtp_path is not None:
        mtp = Path(mtp_path)
        files.append(mtp / SIDECAR_NAME if mtp.is_dir() else mtp)
    for file in files:
        if file.is_file():
            check_safetensors(file)


def load_model(path=None, mtp_path=None, **kwargs):
    """``(path, model, tokenizer)``: ``path`` (default: the bundled demo model)
    loaded by :func:`mlx_spec.load`; any failure is a :class:`CommandError`."""
    with bad_input(FileNotFoundError):
        path = Path(path) if path else default_model_path()
    if not path.is_dir():
        state = "is not a directory" if path.exists() else "does not exist"
        raise CommandError(f"model directory {str(path)!r} {state}")
    check_model_files(path, mtp_path)
    try:
        model, tokenizer = load(path, mtp_path=mtp_path, **kwargs)
    except Exception as e:  # whatever the files hold, one line naming them
        raise CommandError(f"cannot load the model in {path}: {one_line(e)}") from None
    return path, model, tokenizer


def sampler_from_flags(args, tokenizer):
    """The sampler of ``--temp``, ``--top-p``, ``--top-k``, ``--xtc-*`` (and
    ``--min-p``, ``--min-tokens-to-keep`` where the command has them)."""
    if args.temp < 0:
        raise CommandError(f"--temp must be >= 0, got {args.temp}")
    return make_sampler(
        args.temp,
        args.top_p,
        getattr(args, "min_p", 0.0),
        getattr(args, "min_tokens_to_keep", 1),
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )
