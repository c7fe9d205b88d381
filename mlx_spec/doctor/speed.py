"""The doctor's speed part: what speculation pays on this machine.

- the verify-cost curve: a target forward over T = 1..9 tokens, the profile
  ``--num-draft-tokens auto`` decides from (measured once, then cached);
- tokens/s of plain mlx-lm decoding and of each drafter at ``auto``, on a
  copy and a free-text prompt (``bench``'s runs, alternated in rounds), with
  the acceptance at each draft position pooled over the runs. A cell's
  speedup is the median of its rounds' ratios (each run against the plain
  run of its own round, so a busy spell falls on both), with their range
  widened by what a second plain run in each round reads against the first
  (plain against plain: the noise a ratio of two runs has on this machine
  now, which a few rounds' range alone understates): its spread;
- the settings it recommends: a drafter only when it is faster beyond its
  spread, plain decoding only when every drafter is slower beyond its own,
  and otherwise the default drafter at ``auto`` (which drafts where it pays),
  saying that no difference was measurable; and whether the kernels help
  (from the kernels part).
"""

import statistics
from typing import Callable, Dict, List, Optional, Tuple

from ..timed_runs import run_plain, run_spec, first_difference, interleaved
from ..core.verify_profile import verify_cost_profile
from ..drafters import default_draft
from .lossless import available_drafters
from .result import FAIL, PASS, Part


def repeats(quick: bool) -> int:
    """Timed rounds per prompt (each runs every setting once)."""
    return 3 if quick else 5


# A second plain run in each round, set against the first like a drafter's.
CONTROL = "none (again)"

# A drafter is recommended when its speedups, at the low end of their spread,
# average at least this: a gain this small is not worth a setting.
PAYS = 1.05


class Verdict:
    """What a cell's spread says of its drafter against plain decoding."""

    FASTER = "faster"  # the whole spread above 1x
    SLOWER = "slower"  # the whole spread below 1x
    WITHIN = "within spread"  # 1x inside the spread: no measurable difference
    NO_DRAFTS = "no drafts made"  # it decoded plainly: a ratio is noise alone


def verdict(low: float, high: float, drafts: int) -> str:
    """A cell's :class:`Verdict` from its range of speedups."""
    if drafts == 0:
        return Verdict.NO_DRAFTS
    if low > 1.0:
        return Verdict.FASTER
    if high < 1.0:
        return Verdict.SLOWER
    return Verdict.WITHIN


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


def ratios(plain: List[dict], runs: List[dict]) -> List[float]:
    """Each round's run of ``runs`` against that round's plain run."""
    return [s["tps"] / p["tps"] for p, s in zip(plain, runs) if p["tps"] > 0]


def noise(plain: List[dict], control: List[dict]) -> float:
    """The factor a ratio of two runs of the same setting strayed from 1 at
    most over the rounds (``control``: a second plain run in each round; 1
    without one)."""
    return max((max(r, 1 / r) for r in ratios(plain, control) if r > 0), default=1.0)


def _row(w, draft, plain, spec, control=()) -> dict:
    """One cell: ``plain``, ``spec`` and ``control`` (a second plain run in
    each round) are the runs of the same rounds, in order (round i's spec
    run is set against round i's plain run)."""
    speedups = ratios(plain, spec)
    acceptance, drafted, per_pass = pooled_acceptance(spec)
    low, high = (min(speedups), max(speedups)) if speedups else (0.0, 0.0)
    widen = noise(plain, list(control))
    return {
        "prompt": w["name"],
        "kind": w["kind"],
        "draft": draft,
        "plain_tps": statistics.median(r["tps"] for r in plain),
        "tps": statistics.median(r["tps"] for r in spec),
        "speedup": statistics.median(speedups) if speedups else 0.0,
        "speedup_range": [low / widen, high * widen],
        "plain_against_plain": widen,
        "verdict": verdict(low / widen, high * widen, sum(drafted)),
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
    progress: Optional[Callable[[], None]] = None,
) -> List[dict]:
    """One row per (prompt, drafter at ``auto``)."""
    drafters = available_drafters(model)
    rows = []
    for w in prompts:
        prompt, n = w["prompt"], w["max_tokens"]
        # Compile and allocate every setting before timing: a short quick run
        # that pays for it reads as a loss.
        run_plain(model, tokenizer, prompt, 4)
        for d in drafters:
            run_spec(model, tokenizer, prompt, 4, d, "auto")
        settings = ["none", *drafters, CONTROL]
        runs: Dict[str, list] = {s: [] for s in settings}
        for _, setting in interleaved(settings, repeats):
            if setting in ("none", CONTROL):
                runs[setting].append(run_plain(model, tokenizer, prompt, n))
            else:
                runs[setting].append(
                    run_spec(model, tokenizer, prompt, n, setting, "auto")
                )
            progress and progress()
        rows += [_row(w, d, runs["none"], runs[d], runs[CONTROL]) for d in drafters]
    return rows


def recommend(rows: List[dict], kernels_help: Optional[bool], default: str) -> dict:
    """The settings to use: the drafter whose speedups are highest on average
    when it is faster beyond its spread (the low ends of its cells average
    :data:`PAYS` or more), plain decoding when every drafter is slower beyond
    its own (the high ends average below 1x), else ``default`` at ``auto``:
    no difference this machine can tell now, and ``auto`` drafts only where
    it pays. So a run that differs from the last only by noise recommends
    the same."""
    cells: Dict[str, List[dict]] = {}
    for r in rows:
        cells.setdefault(r["draft"], []).append(r)

    def mean(d, pick):
        return statistics.mean(pick(r) for r in cells[d])

    means = {d: mean(d, lambda r: r["speedup"]) for d in cells}
    lows = {d: mean(d, lambda r: r["speedup_range"][0]) for d in cells}
    highs = {d: mean(d, lambda r: r["speedup_range"][1]) for d in cells}
    best = max(means, key=means.get) if means else None
    if best is not None and lows[best] >= PAYS:
        draft, k = best, "auto"
        why = (
            f"{best} at auto: {means[best]:.2f}x plain decoding on the built-in "
            f"prompts (its spread {lows[best]:.2f}-{highs[best]:.2f}x)"
        )
    elif cells and all(h < 1.0 for h in highs.values()):
        draft, k = "none", 0
        why = (
            "every drafter was slower than plain decoding beyond its spread "
            "here; decode plainly (--draft none)"
        )
    else:
        draft, k = default, "auto"
        spread = ", ".join(f"{d} {lows[d]:.2f}-{highs[d]:.2f}x" for d in cells)
        why = (
            "no drafter measurably faster or slower than plain decoding here "
            f"({spread}); the default {default} at auto drafts only where it pays"
        )
    if kernels_help is None:
        kernels = "n/a (no Metal)"
    else:
        kernels = "auto (a kernel beats its reference)" if kernels_help else "off"
    return {
        "draft": draft,
        "num_draft_tokens": k,
        "kernels": kernels,
        "mean_speedup": {d: round(m, 3) for d, m in means.items()},
        "why": why,
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
    rows = measure(model, tokenizer, prompts, repeats(quick), progress)
    part.facts["runs"] = rows
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"][:6]) or "-"
        differs = r["first_differing_token"]
        low, high = r["speedup_range"]
        part.check(
            f"{r['prompt']} / {r['draft']} / auto",
            FAIL if differs is not None else PASS,
            f"{r['tps']:.1f} tok/s against plain {r['plain_tps']:.1f} "
            f"({r['speedup']:.2f}x, {low:.2f}-{high:.2f}x over the rounds "
            f"with plain against plain's {r['plain_against_plain']:.2f}x: "
            f"{r['verdict']}), acceptance per position {acc}"
            + ("" if differs is None else f"; tokens differ from plain from {differs}"),
        )
    part.facts["recommended"] = recommend(rows, kernels_help, default_draft(model))
    return part.settle(part.facts["recommended"]["why"])


def speed_steps(model, prompts: List[dict], quick: bool) -> int:
    return len(prompts) * repeats(quick) * (2 + len(available_drafters(model)))
