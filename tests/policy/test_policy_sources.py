"""``auto`` per draft source: each its own length, the MTP head judged in
hindsight, the drafter told which sources pay."""

from mlx_spec.testing.one_row import OneRow


def test_each_draft_source_has_its_own_draft_length():
    """Copies always right, head drafts right one time in three: one policy
    per source drafts long copies and switches the head off (bar its probes);
    one policy for both (the negative control) learns a mixed acceptance that
    is too low for the copies to be drafted at all."""
    costs = [1e-3 * (1 + 0.5 * t) for t in range(9)]
    split = OneRow(costs)  # per source
    mixed = OneRow(costs)  # every pass under one source
    chosen = {(p, s): [] for p in ("split", "mixed") for s in ("ngram", "mtp")}
    for i in range(300):
        source = "ngram" if i % 2 else "mtp"
        for name in ("split", "mixed"):
            if name == "split":
                policy, k = split, split.choose(8, 100, source)
            else:
                policy, k = mixed, mixed.choose(8, 100)
            policy.update(k, k if source == "ngram" else min(k, int(i % 6 == 0)))
            chosen[name, source].append(k)
    assert chosen["split", "ngram"].count(8) >= 120  # of 150 copy passes
    assert chosen["split", "mtp"].count(0) >= 130  # of 150 head passes
    assert chosen["mixed", "ngram"].count(8) < 10


def _switched_off(policy, source=None):
    """Drive ``policy`` (its ``source``'s passes) to k = 0."""
    for _ in range(60):
        k = policy.choose(8, 32, source) if source else policy.choose(8)
        policy.update(k, 0)
    return policy


def test_first_drafts_judged_in_hindsight_switch_drafting_back_on():
    costs = [1e-3 * (1 + 0.3 * t) for t in range(9)]
    good, bad = _switched_off(OneRow(costs)), _switched_off(OneRow(costs))
    assert good.best == bad.best == 0
    good.observe_hindsight(60, 64)  # the head would have been right 94% of the time
    bad.observe_hindsight(4, 64)  # control: right 6% of the time
    bad.observe_hindsight(64, 0)  # no trials: no evidence
    assert good.choose(8) > 0 and good.acceptance()[0] > 0.85
    assert bad.choose(8) == 0 and bad.acceptance()[0] < 0.1


def test_first_drafts_judged_in_hindsight_stand_in_for_probes():
    """A source switched off is judged in hindsight every pass (poorly): it
    is never probed, and its next pass is known to be plain. Control: the
    same policy without the judging probes after ``probe_every`` passes."""
    costs = [1e-3 * (1 + 0.3 * t) for t in range(9)]
    judged, control = (_switched_off(OneRow(costs)) for _ in range(2))
    ks = {"judged": [], "control": []}
    plain = []
    for _ in range(3 * control.probe_every):
        judged.observe_hindsight(0, 2)
        plain.append(judged.next_is_plain())
        for name, policy in (("judged", judged), ("control", control)):
            k = policy.choose(8)
            policy.update(k, 0)
            ks[name].append(k)
    assert ks["judged"] == [0] * len(plain) and all(plain)
    assert any(ks["control"])


class _JudgingDrafter:
    """A drafter of two sources that judges its first drafts in hindsight
    (``contract.SelfJudging``)."""

    name, needs_hidden = "judging", False

    def __init__(self, evidence):
        self.evidence, self.paying = evidence, {}

    def hindsight(self):
        evidence, self.evidence = self.evidence, {}
        return evidence

    def draft_source(self, k, look=True):
        return None

    def set_source_paying(self, source, paying):
        self.paying[source] = paying


def test_exchange_learns_hindsight_and_tells_which_sources_pay():
    costs = [1e-3 * (1 + 0.05 * t) for t in range(9)]  # drafts cheap
    sources = _switched_off(OneRow(costs), "mtp")
    sources.choose(8, 32, "ngram")  # a copy source, drafting on its prior
    drafter = _JudgingDrafter({})
    sources.exchange(drafter)
    assert drafter.paying == {"mtp": False, "ngram": True}
    drafter.evidence = {"mtp": (62, 64)}
    sources.exchange(drafter)
    assert sources.choose(8, 32, "mtp") > 0
    sources.exchange(drafter)
    assert drafter.paying["mtp"]


def test_the_heads_drafts_start_from_its_measured_step_cost(models):
    from mlx_spec.core.policy import pass_cost_model
    from mlx_spec.core.verify_profile import head_step_cost

    model, _ = models["qwen3_next"]
    cost = pass_cost_model(model)  # one model prices every source's passes
    assert cost.fitted()["per_head_step"] == head_step_cost(model) > 0
    head, copies = OneRow(cost, source="mtp"), OneRow(cost, source="ngram")
    assert head.shape(3).head_steps == 3 and copies.shape(3).head_steps == 0
    assert head.pass_cost(3) > copies.pass_cost(3)  # a copy takes no head step
