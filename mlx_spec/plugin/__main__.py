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
import sysconfig
from typing import List, Optional

from ..errors import one_line
from ..mlx_lm_compat import PLUGIN_COMMANDS, command_main
from . import enable_from_environment, report

# The start-up file: its one line, exactly as shipped in the wheel and as
# --install-hook writes it (a test holds the two equal); it imports the hook
# (_mlx_spec_hook) only when the switch is on. site runs a .pth line that
# starts with "import", in the order of the file names: this one comes after
# setuptools' "__editable__.*.pth", whose finder an editable install needs
# to import the hook.
PTH_NAME = "mlx_spec_plugin.pth"
PTH_LINE = (
    'import os; os.environ.get("MLX_SPEC_PLUGIN", "0") not in ("", "0") and '
    '__import__("_mlx_spec_hook").install()\n'
)

USAGE = (
    "usage: python -m mlx_spec.plugin {" + ",".join(PLUGIN_COMMANDS) + "} [ARGS...]\n"
    "runs that mlx-lm command with lossless speculation (mlx_spec.plugin); "
    "MLX_SPEC_DRAFT and MLX_SPEC_NUM_DRAFT_TOKENS choose the drafter and "
    "draft length (default: auto); a line on stderr says what it did\n"
    "       python -m mlx_spec.plugin {--install-hook,--remove-hook}\n"
    f"writes (removes) {PTH_NAME} in site-packages: MLX_SPEC_PLUGIN=1 then "
    "enables the plugin in any Python program that imports mlx_lm"
)


def _hook_path() -> str:
    # This interpreter's site-packages (a virtual environment's own), where
    # a wheel install puts the same file.
    return os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def install_hook() -> int:
    path = _hook_path()
    found = _read(path)
    if found == PTH_LINE:
        print(f"{path}: already installed")
        return 0
    if found is not None:  # not ours: left as it is
        print(f"error: {path} exists with other content; not replaced", file=sys.stderr)
        return 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(PTH_LINE)
    print(f"{path}: installed; MLX_SPEC_PLUGIN=1 turns the plugin on")
    return 0


def remove_hook() -> int:
    path = _hook_path()
    found = _read(path)
    if found is None:
        print(f"{path}: not installed")
        return 0
    if found != PTH_LINE:  # only the file --install-hook writes is removed
        print(f"error: {path} has other content; not removed", file=sys.stderr)
        return 1
    os.remove(path)
    print(f"{path}: removed")
    return 0


def _exit_on_terminate(signum, frame):
    # A server is stopped by SIGTERM: leaving through SystemExit lets the
    # report below be printed.
    sys.exit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv in (["--install-hook"], ["--remove-hook"]):
        return install_hook() if argv[0] == "--install-hook" else remove_hook()
    name, args = argv[0], argv[1:]
    if name not in PLUGIN_COMMANDS:
        print(f"error: unknown command {name!r:.80}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        plugin = enable_from_environment()
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
