"""The doctor's speed part: what speculation pays on this machine.

- the verify-cost curve: a target forward over T = 1..9 tokens, the profile
  ``--num-draft-tokens auto`` decides from (measured once, then cached);
- tokens/s of plain mlx-lm decoding and of each drafter at ``auto``, on a
  copy and a free-text prompt (``bench``'s runs, alternated, medians), with
  the acceptance at each draft position pooled over the runs;
- the settings it recommends: the drafter with the best mean speedup (plain
  decoding when none reaches :data:`PAYS`), ``auto`` draft lengths, and
  whether the kernels help (from the kernels part).
"""

import statistics
from typing import Callable, Dict, List, Optional, Tuple

from ..timed_runs import run_plain, run_spec, first_difference, interleaved
from ..core.verify_profile import verify_cost_profile
from .lossless import available_drafters
from .result import FAIL, PASS, Part


def repeats(quick: bool) -> int:
    """Timed runs per setting and prompt (medians are reported)."""
    return 2 if quick else 3


# A mean speedup below this is within a busy machine's noise: not worth it.
PAYS = 1.05


def pooled_acceptance(runs: List[dict]) -> Tuple[List[float], List[int], float]:
    """Acceptance per draft position over all ``runs`` (each run's
    ``stats``), the drafts made at each position, and tokens per pass."""
    drafted: List[int] = []
    accepted: List[int] = []
    for r in runs:
        st = r["stats"]
        grow = len(st.drafted_at) - len(drafted)
        drafted += [0] * max(grow, 0)
        accepted += [0] * max(grow, 0)
        for i, (d, a) in enumerate(zip(st.drafted_at, st.accepted_at)):
            drafted[i] += d
            accepted[i] += a
    passes = sum(r["stats"].verify_passes for r in runs)
    generated = sum(r["stats"].generated for r in runs)
    return (
        [a / d if d else 0.0 for a, d in zip(accepted, drafted)],
        drafted,
        generated / passes if passes else 0.0,
    )


def _row(w, draft, plain, spec) -> dict:
    plain_tps = statistics.median(r["tps"] for r in plain)
    tps = statistics.median(r["tps"] for r in spec)
    acceptance, drafted, per_pass = pooled_acceptance(spec)
    return {
        "prompt": w["name"],
        "kind": w["kind"],
        "draft": draft,
        "plain_tps": plain_tps,
        "tps": tps,
        "speedup": tps / plain_tps if plain_tps else 0.0,
        "acceptance_per_position": acceptance,
        "drafted_per_position": drafted,
        "tokens_per_pass": per_pass,
        "first_differing_token": first_difference(plain, spec),
    }


def measure(
    model,
    tokenizer,
    prompts: List[dict],
    repeats: int,
    warm_up: bool,
    progress: Optional[Callable[[], None]] = None,
) -> List[dict]:
    """One row per (prompt, drafter at ``auto``)."""
    drafters = available_drafters(model)
    rows = []
    for w in prompts:
        prompt, n = w["prompt"], w["max_tokens"]
        if warm_up:  # compile and allocate every setting before timing
            run_plain(model, tokenizer, prompt, 4)
            for d in drafters:
                run_spec(model, tokenizer, prompt, 4, d, "auto")
        runs: Dict[str, list] = {s: [] for s in ["none", *drafters]}
        for _, setting in interleaved(["none", *drafters], repeats):
            if setting == "none":
                runs["none"].append(run_plain(model, tokenizer, prompt, n))
            else:
                runs[setting].append(
                    run_spec(model, tokenizer, prompt, n, setting, "auto")
                )
            progress and progress()
        rows += [_row(w, d, runs["none"], runs[d]) for d in drafters]
    return rows


def recommend(rows: List[dict], kernels_help: Optional[bool]) -> dict:
    by_draft: Dict[str, List[float]] = {}
    for r in rows:
        by_draft.setdefault(r["draft"], []).append(r["speedup"])
    means = {d: statistics.mean(s) for d, s in by_draft.items()}
    best = max(means, key=means.get) if means else None
    pays = best is not None and means[best] >= PAYS
    if kernels_help is None:
        kernels = "n/a (no Metal)"
    else:
        kernels = "auto (a kernel beats its reference)" if kernels_help else "off"
    return {
        "draft": best if pays else "none",
        "num_draft_tokens": "auto" if pays else 0,
        "kernels": kernels,
        "mean_speedup": {d: round(m, 3) for d, m in means.items()},
        "why": (
            f"{best} at auto: {means[best]:.2f}x plain decoding on the built-in prompts"
            if pays
            else "no drafter reached "
            f"{PAYS:.2f}x plain decoding here; decode plainly (--draft none)"
        ),
    }


def check_speed(
    part: Part,
    model,
    tokenizer,
    prompts: List[dict],
    quick: bool,
    kernels_help: Optional[bool],
    progress: Optional[Callable[[], None]] = None,
) -> Part:
    costs = verify_cost_profile(model)
    part.facts["verify_cost_ms"] = [round(c * 1e3, 3) for c in costs]
    part.facts["verify_cost_over_one_token"] = [round(c / costs[0], 3) for c in costs]
    part.check(
        "verify cost",
        PASS,
        f"T=1..{len(costs)}: "
        + " ".join(f"{c / costs[0]:.2f}" for c in costs)
        + f" x a one-token step ({costs[0] * 1e3:.1f} ms)",
    )
    rows = measure(model, tokenizer, prompts, repeats(quick), not quick, progress)
    part.facts["runs"] = rows
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"][:6]) or "-"
        differs = r["first_differing_token"]
        part.check(
            f"{r['prompt']} / {r['draft']} / auto",
            FAIL if differs is not None else PASS,
            f"{r['tps']:.1f} tok/s against plain {r['plain_tps']:.1f} "
            f"({r['speedup']:.2f}x), acceptance per position {acc}"
            + ("" if differs is None else f"; tokens differ from plain from {differs}"),
        )
    part.facts["recommended"] = recommend(rows, kernels_help)
    return part.settle(part.facts["recommended"]["why"])


def speed_steps(model, prompts: List[dict], quick: bool) -> int:
    return len(prompts) * repeats(quick) * (1 + len(available_drafters(model)))
