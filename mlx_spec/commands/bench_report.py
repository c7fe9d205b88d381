"""How ``mlx_spec bench`` shows its results: the table, the plot, and what
it reports when a speculative run's tokens leave plain decoding's."""

from typing import Dict, List, Optional


def format_table(results: List[dict]) -> str:
    head = (
        f"{'workload':<14} {'draft':<10} {'k':>4} {'plain':>7} {'spec':>7} "
        f"{'speedup':>7} {'prompt':>6} {'tok/pass':>8} {'ideal':>6} {'ach/id':>6} "
        f"{'phases':>6} {'work':>5} {'cpu':>5} {'plain cpu':>9} {'tokens':>7} "
        f"{'acceptance per position'}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"][:8])
        lines.append(
            f"{r['workload']:<14} {r['draft']:<10} {str(r['num_draft_tokens']):>4} "
            f"{r['plain_tps']:>7.1f} {r['tps']:>7.1f} {r['speedup']:>6.2f}x "
            f"{r['prompt_tps'] / r['plain_prompt_tps']:>5.2f}x "
            f"{r['tokens_per_pass']:>8.2f} {r['ideal_speedup']:>5.2f}x "
            f"{r['achieved_over_ideal']:>6.2f} {r['host_overhead_ms_per_pass']:>6.2f} "
            f"{r['host_work_ms_per_pass']:>5.2f} {r['host_cpu_ms_per_pass']:>5.2f} "
            f"{r['plain_host_cpu_ms_per_step']:>9.2f} "
            f"{_same_tokens(r['first_token_differing_from_plain']):>7} {acc}"
        )
    return "\n".join(lines)


def _same_tokens(first_difference: Optional[int]) -> str:
    if first_difference is None:
        return "= plain"
    return "plain ?" if first_difference < 0 else f"DIFF@{first_difference}"


def lossless_report(results: List[dict]) -> List[str]:
    """One line per row whose speculative tokens left plain decoding's (or
    whose plain runs disagreed), for stderr."""
    lines = []
    for r in results:
        at = r["first_token_differing_from_plain"]
        setting = f"{r['workload']} / {r['draft']} / {r['num_draft_tokens']}"
        if at is not None and at >= 0:
            lines.append(
                f"error: {setting}: the speculative tokens differ from plain "
                f"greedy decoding's from token {at} (see docs/losslessness.md)"
            )
        elif at is not None:
            lines.append(
                f"note: {setting}: plain greedy decoding gave different tokens in "
                "different runs on this machine; losslessness was not judged"
            )
    return lines


def plot(results: List[dict], path: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'mlx-spec[plot]'") from e
    fig, ax = plt.subplots(figsize=(7, 4))
    keyed: Dict[tuple, list] = {}
    for r in results:
        if isinstance(r["num_draft_tokens"], int):
            keyed.setdefault((r["workload"], r["draft"]), []).append(r)
    for (workload, draft), rows in sorted(keyed.items()):
        rows.sort(key=lambda r: r["num_draft_tokens"])
        ax.plot(
            [r["num_draft_tokens"] for r in rows],
            [r["speedup"] for r in rows],
            marker="o",
            label=f"{workload} / {draft}",
        )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup vs plain mlx-lm")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
