"""``python -m mlx_spec.plugin MODULE [ARGS...]``: one of mlx-lm's own
commands (``mlx_lm.generate``, ``mlx_lm.chat``, ``mlx_lm.server``) with the
plugin enabled: its command line, its output, speculation underneath.

The plugin's options come from the environment, so that every argument
after the module stays mlx-lm's: ``MLX_SPEC_DRAFT`` (default ``auto``) and
``MLX_SPEC_NUM_DRAFT_TOKENS`` (``auto`` or an integer).
"""

import os
import signal
import sys
from typing import List, Optional

from ..errors import one_line
from ..mlx_lm_compat import PLUGIN_COMMANDS, command_main
from . import enable, report

USAGE = (
    "usage: python -m mlx_spec.plugin {" + ",".join(PLUGIN_COMMANDS) + "} [ARGS...]\n"
    "runs that mlx-lm command with lossless speculation (mlx_spec.plugin); "
    "MLX_SPEC_DRAFT and MLX_SPEC_NUM_DRAFT_TOKENS choose the drafter and "
    "draft length (default: auto); a line on stderr says what it did"
)


def _num_draft_tokens(text: str):
    if text == "auto" or text.isdigit():
        return "auto" if text == "auto" else int(text)
    raise ValueError(
        f"MLX_SPEC_NUM_DRAFT_TOKENS must be 'auto' or an integer, got {text!r:.40}"
    )


def _exit_on_terminate(signum, frame):
    # A server is stopped by SIGTERM: leaving through SystemExit lets the
    # report below be printed.
    sys.exit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    name, args = argv[0], argv[1:]
    if name not in PLUGIN_COMMANDS:
        print(f"error: unknown command {name!r:.80}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        plugin = enable(
            draft=os.environ.get("MLX_SPEC_DRAFT", "auto"),
            num_draft_tokens=_num_draft_tokens(
                os.environ.get("MLX_SPEC_NUM_DRAFT_TOKENS", "auto")
            ),
        )
    except ValueError as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    # mlx-lm's parsers read sys.argv: the command sees its own arguments.
    sys.argv = [name] + args
    signal.signal(signal.SIGTERM, _exit_on_terminate)
    try:
        command_main(name)()
    finally:
        # stderr: the command's own output (stdout) stays mlx-lm's
        print(report(plugin), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
