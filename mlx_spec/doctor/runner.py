"""Running the doctor's parts in order, each on its own: a part that fails
(or cannot run: no model loaded) never stops the ones after it."""

import sys
import time
from datetime import datetime, timezone
from typing import Optional

from .kernels import check_kernels
from .lossless import check_lossless, lossless_steps
from .model import check_model
from .platform import check_platform
from .prompts import doctor_prompts
from .report import SCHEMA, SCHEMA_VERSION
from .result import FAIL, PASS, SKIP, Part, run_part, skipped

PARTS = ("platform", "model", "kernels", "lossless", "speed", "report")


def _bar(total: int, desc: str):
    """A progress bar on stderr (shown on a terminal only)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=None)


def run_doctor(
    model: Optional[str] = None,
    quick: bool = False,
    json_error: Optional[str] = None,
    json_path: Optional[str] = None,
    revision: Optional[str] = None,
    announce=None,
    draft_model: Optional[str] = None,
    draft_quantize: Optional[int] = None,
) -> dict:
    """The report (see docs/doctor.md). ``json_error``: why ``json_path``
    cannot be written (checked by the caller before the long parts);
    ``announce(part)`` is called as each part finishes. ``draft_model``: a
    DFlash drafter (path or repo id, ``draft_quantize`` 4 or 8 bits in
    memory) named by the model part, and ``dflash`` checked and measured
    beside the other drafters."""
    tic = time.perf_counter()
    announce = announce or (lambda part: None)
    parts = {}

    def done(part: Part):
        parts[part.name] = part
        announce(part)

    done(run_part("platform", check_platform))
    loaded = {}
    done(
        run_part(
            "model",
            lambda p: loaded.update(
                r=check_model(p, model, revision, draft_model, draft_quantize)
            ),
        )
    )
    triple = loaded.get("r")
    kernels_help = None
    if triple is None:
        for name in ("kernels", "lossless", "speed"):
            done(skipped(name, "skipped: no model loaded (see the model part)"))
    else:
        _, m, tok = triple
        kernels = {}

        def kernels_body(p):
            kernels["help"] = check_kernels(p, m, quick)[1]

        done(run_part("kernels", kernels_body))
        kernels_help = kernels.get("help")
        prompts = doctor_prompts(quick)

        def lossless_body(p):
            with _bar(lossless_steps(m, prompts, quick), "losslessness") as bar:
                check_lossless(p, m, tok, prompts, quick, bar.update)

        done(run_part("lossless", lossless_body))
        from .speed import check_speed, speed_steps

        def speed_body(p):
            with _bar(speed_steps(m, prompts, quick), "speed") as bar:
                check_speed(p, m, tok, prompts, quick, kernels_help, bar.update)

        done(run_part("speed", speed_body))
    report_part = Part("report")
    if json_error:
        report_part.status, report_part.reason = FAIL, json_error
    elif json_path:
        report_part.status, report_part.reason = PASS, f"JSON written to {json_path}"
    else:
        report_part.status, report_part.reason = SKIP, "no --json file asked for"
    parts["report"] = report_part
    speed = parts.get("speed")
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(quick),
        "model": model,
        "draft_model": None if draft_model is None else str(draft_model),
        "seconds": round(time.perf_counter() - tic, 2),
        "status": FAIL if any(p.status == FAIL for p in parts.values()) else PASS,
        "parts": {name: parts[name].to_json() for name in PARTS},
        "recommended": (speed.facts.get("recommended") if speed else None),
    }
