"""Every tuning constant of ``--num-draft-tokens auto``, with why it is what it is.

A :class:`PolicyTuning` is a value: a decoding session is given one (the
default, :data:`DEFAULT_TUNING`, unless an experiment such as
``scripts/bench_switch.py`` builds a variant with ``dataclasses.replace``),
and passes it to everything that prices passes and chooses draft lengths.
Evidence for each mechanism (an A/B where there is one) is in
``docs/auto_policy.md``.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyTuning:
    # -- acceptance per draft position (one sequence's policy) --
    # Acceptance before any evidence: low enough that a first draft is tried
    # only where a probe or a judgement finds it accepted.
    prior_acceptance: float = 0.3
    # ... worth this many passes, so two passes of evidence outweigh it.
    prior_weight: float = 2.0
    # Forgetting per pass: acceptance drifts with the content generated.
    acceptance_decay: float = 0.97

    # -- the fitted pass-cost model (pass_cost.PassCost) --
    # Forgetting per pass of the fit: the machine's load drifts too.
    cost_decay: float = 0.95
    # A pass counts as at most this many times what the fit expected, once a
    # pass of its shape was counted: two stalled 85-100 ms passes among 20 ms
    # ones once made drafts look free (8 drafted); a lasting slowdown raises
    # the bound with the fit.
    stall_bound: float = 1.5
    # Pull of the forward's scale towards the profile, in passes' worth: a
    # run of one shape moves the constant, not how forwards grow with T.
    scale_prior_weight: float = 0.1
    # Pull of the per-head-step cost towards the profiled head step: one or
    # two draft lengths cannot tell it from the fixed cost of drafting.
    slope_prior_weight: float = 0.5
    # Far weaker pull of that fixed cost (per drafting row) towards 0, so a
    # first draft's extra cost is taken as fixed and a longer draft still
    # gets tried and timed.
    fixed_prior_weight: float = 0.05
    # Pulls of the cost per row beyond the first and per catch-up position
    # towards 0: a batch of constant size cannot tell the first from the
    # constant, nor steady drafting the second from the fixed cost; a probe
    # after a long stretch without drafts catches up many rows.
    row_prior_weight: float = 0.1
    catch_up_prior_weight: float = 0.1
    # Pull of a drafter's own draft forward (per drafting row, and its growth
    # with context) towards what the drafter measured: a row drafting every
    # pass cannot tell it from the fixed cost of drafting, as a head step.
    draft_forward_prior_weight: float = 0.5
    # Pull of the cost of an edge of the plain passes' queue towards 0: until
    # passes ending and restarting the queue are timed beside queued ones, a
    # draft is not charged for breaking it.
    queue_edge_prior_weight: float = 0.1
    # While drafting, a plain pass is run once the last one's decayed weight
    # falls below this (about every 28 passes): the cost line is anchored at
    # k = 0 rather than extrapolated to it.
    plain_probe_weight: float = 0.25

    # -- exploration: probes at k = 0, depth probes while drafting --
    # Plain passes before a one-draft probe: a drafter that became useful is
    # noticed within a few dozen tokens.
    probe_every: int = 16
    # Each rejected probe doubles the wait up to this: a probe of the MTP head
    # costs its catch-up over every deferred row.
    max_probe_every: int = 128
    # An accepted probe is followed by another at once while the first
    # position has less than this decayed evidence (re-learn in a few passes).
    probe_streak_evidence: float = 4.0
    # Probes never cost more than this share of the plain passes between them
    # (a head probe at 4k context costs about two plain passes: one in ~70).
    probe_budget: float = 0.03
    # A group that has drafted nothing for this many choices (and is not
    # about to probe) suspends its drafter's upkeep (the MTP head's forwards
    # and judging: 11% of a plain pass measured); fewer would restart the
    # head's window on every short stretch of text that does not pay.
    suspend_after: int = 32
    # A depth probe (one draft more than the best) while the next position
    # has fewer decayed trials than this ...
    depth_evidence: float = 4.0
    # ... is reached with at least this probability ...
    depth_reach: float = 0.5
    # ... and its expected speed is within this share of the best's: an old
    # failure otherwise keeps drafts a token shorter than pays.
    depth_margin: float = 0.1

    # -- the cost profile healing itself from timed passes --
    # Passes of one length compared with the profile before it is corrected
    # (0: never corrected); their fastest is what the length is set to.
    heal_window: int = 8
    # Lower a length's cost when even its fastest recent pass beat it by more
    # than this share (a pass is its forward and more, so it is never cheaper
    # than the forward but for a few per cent of graph building it overlaps);
    # a busy profile was 2x too dear at T = 1, 2.7x at T = 9.
    heal_down: float = 0.1
    # A stored profile where a forward over T >= 3 tokens costs more than
    # this times the cheapest two shorter forwards covering its tokens (one
    # forward does their work in fewer steps) was measured on a busy machine:
    # it is measured again once, since ``auto`` never tries the lengths it
    # overprices, so passes cannot heal them (inf: never).
    implausible_ratio: float = 1.2

    # Measure the long profile after LONG_CONTEXT tokens where the caches can
    # be written without a prefill (False: after PREFILLED_LONG_CONTEXT, where
    # a 4-token pass at 16k was priced at 30 ms and took 46).
    long_profile: bool = True


DEFAULT_TUNING = PolicyTuning()
