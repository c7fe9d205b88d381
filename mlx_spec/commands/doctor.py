"""``mlx_spec doctor``: does speculation work, and pay, on this machine?

Checks the platform, the model, its MTP head and a DFlash drafter
(``--draft-model``), the kernels, greedy losslessness and speed, each part with pass / fail / skip and a reason, and
ends with a Markdown block to paste into an issue; ``--json`` writes the
whole report (docs/doctor.md). Exit status 1 when a part failed.
"""

import argparse
import sys

from ..doctor import run_doctor
from ..doctor.report import format_part, markdown, write_json
from .common import (
    MODEL_HELP,
    CommandError,
    add_draft_quantize_flag,
    add_revision_flag,
    check_output_file,
)


def setup_parser():
    p = argparse.ArgumentParser(
        prog="mlx_spec doctor",
        description="Does speculative decoding work, and pay, on this machine? "
        "Checks the platform, the model and its MTP head, the kernels, greedy "
        "losslessness and speed (docs/doctor.md).",
    )
    p.add_argument("--model", help=MODEL_HELP)
    add_revision_flag(p)
    p.add_argument(
        "--draft-model",
        metavar="PATH_OR_REPO",
        help="A DFlash block drafter for the model (a directory or a Hugging "
        "Face repo id): named in the model part, and --draft dflash checked "
        "for losslessness and measured with the other drafters.",
    )
    add_draft_quantize_flag(p)
    p.add_argument(
        "--json", help="Write the whole report, machine-readable, to this file."
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="Short prompts and kernel shapes, two timed runs per setting "
        "(under a minute on a small model).",
    )
    return p


def main(argv=None) -> int:
    args = setup_parser().parse_args(argv)
    if args.draft_quantize is not None and args.draft_model is None:
        print("mlx_spec doctor: --draft-quantize needs --draft-model", file=sys.stderr)
        return 2
    json_error = None
    if args.json:  # before the long parts, and no reason not to run them
        try:
            check_output_file(args.json, "--json")
        except CommandError as e:
            json_error = str(e)

    def announce(part):
        print(format_part(part), flush=True)

    report = run_doctor(
        args.model,
        quick=args.quick,
        json_error=json_error,
        json_path=args.json,
        revision=args.revision,
        announce=announce,
        draft_model=args.draft_model,
        draft_quantize=args.draft_quantize,
    )
    if args.json and not json_error:
        try:
            write_json(report, args.json)
        except OSError as e:
            report["parts"]["report"].update(
                status="fail", reason=f"--json {args.json!r} cannot be written: {e}"
            )
            report["status"] = "fail"
    rep = report["parts"]["report"]
    print(f"[{rep['status'].upper()}] report: {rep['reason']}")
    print()
    print(markdown(report))
    return 1 if report["status"] == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
