"""How the doctor's report is shown: each part on the terminal as it
finishes, a Markdown block to paste into an issue, and the JSON file.

The JSON's layout is versioned (:data:`SCHEMA_VERSION`, documented field by
field in docs/doctor.md): a field is added without a new version, renamed or
removed only with one.
"""

import json
from pathlib import Path
from typing import List

SCHEMA = "mlx_spec.doctor"
SCHEMA_VERSION = 1

_MARK = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP"}


def format_part(part) -> str:
    """``[PASS] model: reason`` and one indented line per check."""
    lines = [f"[{_MARK[part.status]}] {part.name}: {part.reason}"]
    for c in part.checks:
        lines.append(f"    {c.status:<4}  {c.name}: {c.reason}")
    return "\n".join(lines)


def _cell(text: str, width: int = 110) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= width else text[: width - 1] + "…"


def markdown(report: dict) -> str:
    """A short block for an issue: the machine, each part's verdict, the
    measured speedups and the recommendation."""
    parts = report["parts"]
    plat = parts["platform"]["facts"]
    model = parts["model"]["facts"]
    lines: List[str] = [
        "### mlx_spec doctor" + (" --quick" if report["quick"] else ""),
        "",
        f"- machine: {plat.get('chip', '?')}, {plat.get('os', '?')} "
        f"{plat.get('os_version', '')}, {plat.get('memory_gb', '?')} GB, "
        f"device {plat.get('device', '?')}, BLAS {plat.get('blas', '?')}",
        f"- versions: mlx-spec {plat.get('mlx_spec', '?')}, MLX {plat.get('mlx', '?')}, "
        f"mlx-lm {plat.get('mlx_lm', '?')}, Python {plat.get('python', '?')}",
        f"- model: {model.get('requested', '?')} ({model.get('model_type', 'not loaded')})",
    ]
    drafter = model.get("draft_model")
    if drafter:
        lines.append(
            f"- drafter: {drafter['requested']} "
            + (
                f"(DFlash, target layers {drafter['target_layer_ids']}, block "
                f"{drafter['block_size']}, identity {drafter['identity'][:12]})"
                if "identity" in drafter
                else "(not loaded)"
            )
        )
    lines += [
        "",
        "| part | status | summary |",
        "|---|---|---|",
    ]
    for name, part in parts.items():
        lines.append(f"| {name} | {part['status']} | {_cell(part['reason'])} |")
    speed = parts["speed"]["facts"]
    if speed.get("verify_cost_over_one_token"):
        curve = " ".join(f"{c:.2f}" for c in speed["verify_cost_over_one_token"])
        lines += ["", f"verify cost T=1..9 (x one-token step): {curve}"]
    if speed.get("runs"):
        lines += [
            "",
            "| prompt | draft | plain tok/s | tok/s | speedup | spread | verdict "
            "| acceptance |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in speed["runs"]:
            acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"][:6])
            low, high = r["speedup_range"]
            lines.append(
                f"| {r['prompt']} | {r['draft']} | {r['plain_tps']:.1f} | "
                f"{r['tps']:.1f} | {r['speedup']:.2f}x | {low:.2f}-{high:.2f}x | "
                f"{r['verdict']} | {acc or '-'} |"
            )
    rec = report.get("recommended")
    if rec:
        lines += [
            "",
            f"recommended: --draft {rec['draft']} --num-draft-tokens "
            f"{rec['num_draft_tokens']}"
            + (
                f" --draft-model {drafter['requested']}"
                if rec["draft"] == "dflash" and drafter
                else ""
            )
            + f", kernels {rec['kernels']}",
        ]
    return "```markdown\n" + "\n".join(lines) + "\n```"


def write_json(report: dict, path) -> None:
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
