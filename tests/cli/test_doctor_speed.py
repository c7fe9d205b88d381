"""``mlx_spec doctor``'s speed part judged from its runs: acceptance
pooled over the runs, each cell judged by its spread over the rounds (each
round set against its own plain run), and the settings recommended."""

import pytest


def test_acceptance_is_pooled_over_the_runs():
    from mlx_spec.core.stats import SpecStats
    from mlx_spec.doctor.speed import pooled_acceptance

    one, two = SpecStats(), SpecStats()
    one.record(2, 2, 3)  # both drafts accepted
    two.record(3, 1, 2)  # the first of three accepted
    two.record(0, 0, 1)
    acceptance, drafted, per_pass = pooled_acceptance([{"stats": one}, {"stats": two}])
    assert drafted == [2, 2, 1]
    assert acceptance == [1.0, 0.5, 0.0]
    assert per_pass == 6 / 3


def _cell(draft, ratios, drafts=10, prompt="p"):
    """A speed cell from its rounds' ratios against plain decoding (plain at
    100 tok/s every round)."""
    from mlx_spec.core.stats import SpecStats
    from mlx_spec.doctor.speed import _row

    def run(tps, made):
        stats = SpecStats()
        stats.record(made, made, made + 1)
        return {"tps": tps, "tokens": [1, 2, 3], "stats": stats}

    plain = [run(100.0, 0) for _ in ratios]
    spec = [run(100.0 * r, drafts) for r in ratios]
    return _row({"name": prompt, "kind": "free"}, draft, plain, spec)


def test_a_cell_is_judged_by_its_spread_over_the_rounds():
    from mlx_spec.doctor.speed import Verdict

    within = _cell("mtp", [0.69, 1.02, 1.08])
    assert within["speedup"] == pytest.approx(1.02)  # the median ratio
    assert within["speedup_range"] == pytest.approx([0.69, 1.08])
    assert within["verdict"] == Verdict.WITHIN
    assert _cell("mtp", [1.2, 1.3, 1.1])["verdict"] == Verdict.FASTER
    assert _cell("mtp", [0.8, 0.9, 0.85])["verdict"] == Verdict.SLOWER
    # a drafter that made no draft decoded plainly: its ratio is noise alone
    assert _cell("ngram", [0.69, 0.7, 0.72], drafts=0)["verdict"] == Verdict.NO_DRAFTS


def test_a_cell_is_widened_by_plain_against_plain():
    """A second plain run each round read 0.92x of the first once: the noise
    of a ratio of two runs here. A drafter at 0.95-0.97x is within it (a
    cell with no drafts cannot read slower than plain beyond its spread);
    one at 0.80-0.85x is slower still, and one at 1.15-1.2x faster."""
    from mlx_spec.core.stats import SpecStats
    from mlx_spec.doctor.speed import Verdict, _row

    def run(tps, made=2):
        stats = SpecStats()
        stats.record(made, made, made + 1)
        return {"tps": tps, "tokens": [1], "stats": stats}

    plain = [run(100.0, 0) for _ in range(3)]
    control = [run(100.0, 0), run(92.0, 0), run(101.0, 0)]

    def cell(*tps):
        return _row(
            {"name": "p", "kind": "free"}, "mtp", plain, [run(t) for t in tps], control
        )

    near = cell(95.0, 96.0, 97.0)
    assert near["plain_against_plain"] == pytest.approx(100 / 92)
    assert near["speedup"] == pytest.approx(0.96)  # the median is not widened
    assert near["speedup_range"] == pytest.approx([0.95 * 0.92, 0.97 * 100 / 92])
    assert near["verdict"] == Verdict.WITHIN
    assert (
        _row({"name": "p", "kind": "free"}, "mtp", plain, [run(95.0)] * 3)["verdict"]
        == Verdict.SLOWER
    )  # the control: without plain against plain
    assert cell(80.0, 85.0, 82.0)["verdict"] == Verdict.SLOWER
    assert cell(115.0, 120.0, 118.0)["verdict"] == Verdict.FASTER


def test_a_round_is_set_against_its_own_plain_run():
    """A busy spell slows both runs of its round: their ratio stays."""
    from mlx_spec.core.stats import SpecStats
    from mlx_spec.doctor.speed import _row

    def run(tps):
        stats = SpecStats()
        stats.record(2, 2, 3)
        return {"tps": tps, "tokens": [1], "stats": stats}

    plain = [run(100.0), run(50.0), run(100.0)]  # round 2 ran while busy
    spec = [run(120.0), run(60.0), run(120.0)]
    row = _row({"name": "p", "kind": "free"}, "ngram", plain, spec)
    assert row["speedup_range"] == pytest.approx([1.2, 1.2])


def test_recommendations_follow_the_spread():
    from mlx_spec.doctor.speed import recommend

    def settings(*cells):
        rec = recommend(list(cells), None, "mtp+ngram")
        return rec["draft"], rec["num_draft_tokens"]

    fast = [_cell("ngram", [1.8, 2.0, 2.1], prompt=p) for p in "ab"]
    noisy = [_cell("mtp", [0.69, 1.0, 1.1], prompt=p) for p in "ab"]
    slow = [_cell("mtp", [0.7, 0.8, 0.9], prompt=p) for p in "ab"]
    assert settings(*fast, *noisy) == ("ngram", "auto")
    # nothing beyond the spread either way: the default, never a flip to plain
    assert settings(*noisy) == ("mtp+ngram", "auto")
    assert settings(_cell("ngram", [0.69, 0.7, 0.72], drafts=0), *noisy) == (
        "mtp+ngram",
        "auto",
    )
    # slower beyond the spread everywhere: plain decoding (its control)
    assert settings(*slow) == ("none", 0)
    # a small gain at the low end is not worth a setting
    assert settings(_cell("ngram", [1.01, 1.1, 1.2])) == ("mtp+ngram", "auto")
