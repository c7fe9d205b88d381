"""Whole generations with one of mlx-spec's speed switches on and off, interleaved.

Switches (``--switch``):

- ``early-start``: each GDN layer's output goes to ``mx.async_eval`` as soon
  as its graph is built (``evaluate_early`` on its caches, see
  ``mlx_spec/models/gdn.py``), so the device computes a verify pass's first
  layers while the host builds the rest;
- ``depth-probes``: ``auto`` drafts one token more now and then while the
  position after its choice is barely tested (``TUNING.depth_evidence`` in
  ``mlx_spec/core/policy_tuning.py``; off: never);
- ``long-profile``: ``auto`` prices passes at long contexts from a profile
  measured after ``LONG_CONTEXT`` tokens (``TUNING.long_profile``; off:
  after ``PREFILLED_LONG_CONTEXT``, as models that must prefill it are).
- ``stall-bound``: ``auto``'s cost fits count a pass as at most
  ``TUNING.stall_bound`` times what they expected (off: every pass in full).
- ``cost-probes``: while drafting, ``auto`` runs a plain pass now and then to
  time one (``TUNING.plain_probe_weight``; off: never).
- ``probe-spacing``: probes at ``k = 0`` back off when rejected and never
  cost more than ``TUNING.probe_budget`` of the plain passes (off: one every
  ``TUNING.probe_every`` plain passes, whatever it cost).
- ``processor-drafts``: with logits processors (``--repetition-penalty``) a
  greedy target gets the head's argmax after them as drafts
  (``make_draft_sampler`` in ``mlx_spec/core/sampling.py``; off: the raw
  argmax; the head's rows are judged in hindsight either way);
- ``processor-hindsight``: those drafts count as greedy, so the head's rows
  are judged in hindsight for ``auto`` (off: as sampled ones, not judged).
- ``copy-agreement``: ``mtp+ngram`` takes a copy of a partial n-gram match
  only where the head's next token agrees with it or the copy has the better
  record (``prefer_copy`` in ``mlx_spec/drafters/combined.py``; off: every
  copy is taken, the head drafting only where there is none).
- ``hindsight-walk``: first drafts (the MTP head's, the n-gram index's) are
  judged in hindsight only at tokens that began a pass, walked as one-draft
  passes would have started (``OneDraftWalk`` in
  ``mlx_spec/drafters/base.py``; off: every token the head runs a row for,
  every token accepted after a match).
- ``shifted-conv``: the GDN layers' causal conv over mlx-spec's caches runs as
  shifted products (``mlx_spec/models/depthwise_conv.py``; off: the layer's
  ``Conv1d``, as mlx-lm runs it).

For each workload, drafter and draft length it alternates generations with
the switch on and off, checks that both give the same tokens, and prints the
median tokens/s of each and the tokens per verify pass of the last of each.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python scripts/bench_switch.py [--switch early-start] [--model DIR]
        [--workload free-main ...] [--draft ngram mtp mtp+ngram]
        [--num-draft-tokens 3 auto] [--repeats 6]
        [--repetition-penalty 1.25 --repetition-context-size 64]
"""

import argparse
import json
import statistics

import mlx_spec
import mlx_spec.core.batch as engine
import mlx_spec.models.gdn as gdn
from mlx_spec.commands.bench import load_workloads, machine_info
from mlx_spec.core.policy_tuning import TUNING, PolicyTuning
from mlx_spec.core.state import GDNSlotCache
from mlx_spec.demo import default_model_path
from mlx_spec.drafters.base import OneDraftWalk
from mlx_spec.drafters.combined import MTPNgramDrafter
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.mlx_lm_compat import make_logits_processors


def _early_start(on: bool):
    GDNSlotCache.evaluate_early = on


def _tuning_switch(field: str, off):
    """A switch that sets ``TUNING.<field>`` to ``off``, or back to its default."""
    default = getattr(PolicyTuning(), field)

    def switch(on: bool):
        setattr(TUNING, field, default if on else off)

    return switch


_depth_probes = _tuning_switch("depth_evidence", 0.0)
_long_profile = _tuning_switch("long_profile", False)
_stall_bound = _tuning_switch("stall_bound", float("inf"))
_cost_probes = _tuning_switch("plain_probe_weight", 0.0)


def _probe_spacing(on: bool):
    _tuning_switch("probe_budget", float("inf"))(on)
    _tuning_switch("max_probe_every", PolicyTuning().probe_every)(on)


def _draft_sampler_switch(adjust):
    """A switch that, off, passes each draft sampler the decode loop makes
    through ``adjust``."""
    made = engine.make_draft_sampler

    def switch(on: bool):
        def adjusted(*args):
            return adjust(made(*args))

        engine.make_draft_sampler = made if on else adjusted

    return switch


def _raw_when_greedy(choose):
    return choose if choose is None or choose.samples else None


def _unjudged(choose):
    if choose is not None:
        choose.samples = True
    return choose


def _copy_agreement(on: bool, default=MTPNgramDrafter.prefer_copy):
    MTPNgramDrafter.prefer_copy = default if on else (lambda self, copy: True)


def _hindsight_walk(
    on: bool,
    see=OneDraftWalk.see,
    accepts=(MTPDrafter.accept, NgramDrafter.accept),
):
    mtp_accept, ngram_accept = accepts

    def see_every(self, hit, start=True):  # no position skipped after a hit
        self.hits += start and bool(hit)
        self.trials += start

    def mtp_every_row(self, emitted, hidden):
        for i in range(len(emitted)):  # each as if it began a pass
            mtp_accept(self, emitted[i : i + 1], hidden[i : i + 1])

    def ngram_every_token(self, tokens, hidden=None):
        for t in tokens:  # each as if it began a pass
            ngram_accept(self, [t])

    OneDraftWalk.see = see if on else see_every
    MTPDrafter.accept = mtp_accept if on else mtp_every_row
    NgramDrafter.accept = ngram_accept if on else ngram_every_token


def _shifted_conv(on: bool, products=gdn.depthwise_conv):
    gdn.depthwise_conv = products if on else (lambda conv, x: conv(x))


SWITCHES = {
    "early-start": _early_start,
    "depth-probes": _depth_probes,
    "long-profile": _long_profile,
    "stall-bound": _stall_bound,
    "cost-probes": _cost_probes,
    "probe-spacing": _probe_spacing,
    "processor-drafts": _draft_sampler_switch(_raw_when_greedy),
    "processor-hindsight": _draft_sampler_switch(_unjudged),
    "copy-agreement": _copy_agreement,
    "hindsight-walk": _hindsight_walk,
    "shifted-conv": _shifted_conv,
}


def generation(model, tok, prompt, draft, k, max_tokens, processors=None):
    """(tokens/s after the prompt, as ``mlx_spec bench`` reports, tokens,
    tokens per verify pass) of one greedy generation (under ``processors``,
    mlx-lm's)."""
    tokens, stats = [], mlx_spec.SpecStats()
    for r in mlx_spec.stream_generate(
        model,
        tok,
        prompt,
        max_tokens,
        draft=draft,
        num_draft_tokens=k,
        logits_processors=processors,
        stats=stats,
    ):
        tokens.append(r.token)
    return r.generation_tps, tokens, stats.tokens_per_pass


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switch", choices=sorted(SWITCHES), default="early-start")
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument(
        "--workload", nargs="+", default=["copy-function", "free-main", "free-class"]
    )
    p.add_argument("--draft", nargs="+", default=["ngram", "mtp", "mtp+ngram"])
    p.add_argument("--num-draft-tokens", nargs="+", default=["3", "auto"])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=0.0,
        help="decode under mlx-lm's repetition penalty (0: none)",
    )
    p.add_argument("--repetition-context-size", type=int, default=20)
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    ks = [k if k == "auto" else int(k) for k in a.num_draft_tokens]
    penalty = dict(
        repetition_penalty=a.repetition_penalty,
        repetition_context_size=a.repetition_context_size,
    )
    model, tok = mlx_spec.load(a.model)
    workloads = {w["name"]: w for w in load_workloads(tokenizer=tok)}
    unknown = [w for w in a.workload if w not in workloads]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; known: {sorted(workloads)}")
    print(json.dumps(machine_info()), flush=True)
    switch = SWITCHES[a.switch]
    print(
        f"{'workload':14} {'draft':10} {'k':>4} {'on':>7} {'off':>7} {'ratio':>6}"
        f" {'tok/pass on':>11} {'off':>5}"
    )
    for name in a.workload:
        prompt = workloads[name]["prompt"]
        for draft in a.draft:
            for k in ks:
                speeds, first = {True: [], False: []}, None
                per_pass = {}
                for r in range(a.repeats + 1):  # the first round warms up
                    order = (True, False) if r % 2 else (False, True)
                    for on in order:
                        switch(on)
                        processors = None
                        if a.repetition_penalty:  # made afresh: no state shared
                            processors = make_logits_processors(**penalty)
                        speed, tokens, per_pass[on] = generation(
                            model, tok, prompt, draft, k, a.max_tokens, processors
                        )
                        first = first or tokens
                        if tokens != first:
                            raise SystemExit(f"{name} {draft} k={k}: tokens differ")
                        if r:
                            speeds[on].append(speed)
                switch(True)
                on, off = (statistics.median(speeds[e]) for e in (True, False))
                print(
                    f"{name:14} {draft:10} {k!s:>4} {on:7.1f} {off:7.1f} "
                    f"{on / off:6.3f} {per_pass[True]:11.2f} {per_pass[False]:5.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
