"""``mlx_spec <command>``: the command-line entry point."""

import importlib
import sys

# command -> module with a ``main(argv)``
COMMANDS = {
    "generate": "mlx_spec.commands.generate",
    "convert": "mlx_spec.commands.convert",
    "chat": "mlx_spec.commands.chat",
    "bench": "mlx_spec.commands.bench",
    "bench-kernels": "mlx_spec.commands.bench_kernels",
    "server": "mlx_spec.commands.server",
    "doctor": "mlx_spec.commands.doctor",
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: mlx_spec {{{','.join(COMMANDS)}}} [options]")
        print("Run 'mlx_spec COMMAND --help' for the options of a command.")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(
            f"mlx_spec: unknown command {command!r}; choose one of {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    return importlib.import_module(COMMANDS[command]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
