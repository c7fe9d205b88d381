"""Whole generations with one of mlx-spec's speed mechanisms on and off, interleaved.

Each switch builds two variants of a generation, through the public API
only: a :class:`~mlx_spec.core.policy_tuning.PolicyTuning` value passed as
``tuning=``, or a drafter object passed as ``draft=``. Nothing of the
runtime is patched. Switches (``--switch``):

- ``depth-probes``: ``auto`` drafts one token more now and then while the
  position after its choice is barely tested (``depth_evidence``; off:
  never);
- ``long-profile``: ``auto`` prices passes at long contexts from a profile
  measured after ``LONG_CONTEXT`` tokens (``long_profile``; off: after
  ``PREFILLED_LONG_CONTEXT``, as models that must prefill it are);
- ``stall-bound``: ``auto``'s cost fits count a pass as at most
  ``stall_bound`` times what they expected (off: every pass in full);
- ``cost-probes``: while drafting, ``auto`` runs a plain pass now and then to
  time one (``plain_probe_weight``; off: never);
- ``probe-spacing``: probes at ``k = 0`` back off when rejected and never
  cost more than ``probe_budget`` of the plain passes (off: one every
  ``probe_every`` plain passes, whatever it cost);
- ``copy-agreement``: ``mtp+ngram`` takes a copy of a partial n-gram match
  only where the head's next token agrees with it or the copy has the better
  record (off: a drafter whose ``prefer_copy`` takes every copy, the head
  drafting only where there is none; ``--draft mtp+ngram`` only).

Mechanisms that no value of the API turns off (evaluating GDN layers early,
the shifted-product conv, drafting under logits processors, judging first
drafts where a pass began) were A/B'd by earlier versions of this script;
their results are in ``docs/measurements.md``.

For each workload, drafter and draft length it alternates generations with
the switch on and off, checks that both give the same tokens, and prints the
median tokens/s of each and the tokens per verify pass of the last of each.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python scripts/bench_switch.py [--switch depth-probes] [--model DIR]
        [--workload free-main ...] [--draft ngram mtp mtp+ngram]
        [--num-draft-tokens 3 auto] [--repeats 6]
        [--repetition-penalty 1.25 --repetition-context-size 64]
"""

import argparse
import json
import statistics
from dataclasses import replace

import mlx_spec
from mlx_spec.timed_runs import load_workloads, machine_info
from mlx_spec.core.policy_tuning import DEFAULT_TUNING
from mlx_spec.demo import default_model_path
from mlx_spec.drafters.combined import MTPNgramDrafter
from mlx_spec.mlx_lm_compat import make_logits_processors


class EveryCopy(MTPNgramDrafter):
    """``mtp+ngram`` taking every copy it finds (the head drafts only where
    there is none)."""

    def prefer_copy(self, copy) -> bool:
        return True


def _tuning(**off):
    """A switch whose off variant is the default tuning with ``off``."""
    variant = replace(DEFAULT_TUNING, **off)
    return lambda on, model, draft: (
        {"tuning": DEFAULT_TUNING if on else variant, "draft": draft}
    )


def _copy_agreement(on: bool, model, draft):
    if draft != "mtp+ngram":
        raise SystemExit("--switch copy-agreement compares mtp+ngram drafters")
    return {"draft": draft if on else EveryCopy(model.mtp_head)}


SWITCHES = {
    "depth-probes": _tuning(depth_evidence=0.0),
    "long-profile": _tuning(long_profile=False),
    "stall-bound": _tuning(stall_bound=float("inf")),
    "cost-probes": _tuning(plain_probe_weight=0.0),
    "probe-spacing": _tuning(
        probe_budget=float("inf"), max_probe_every=DEFAULT_TUNING.probe_every
    ),
    "copy-agreement": _copy_agreement,
}


def generation(model, tok, prompt, variant, k, max_tokens, processors=None):
    """(tokens/s after the prompt, as ``mlx_spec bench`` reports, tokens,
    tokens per verify pass) of one greedy generation with ``variant``'s
    arguments (under ``processors``, mlx-lm's)."""
    tokens, stats = [], mlx_spec.SpecStats()
    for r in mlx_spec.stream_generate(
        model,
        tok,
        prompt,
        max_tokens,
        num_draft_tokens=k,
        logits_processors=processors,
        stats=stats,
        **variant,
    ):
        tokens.append(r.token)
    return r.generation_tps, tokens, stats.tokens_per_pass


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switch", choices=sorted(SWITCHES), default="depth-probes")
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
                        variant = switch(on, model, draft)
                        processors = None
                        if a.repetition_penalty:  # made afresh: no state shared
                            processors = make_logits_processors(**penalty)
                        speed, tokens, per_pass[on] = generation(
                            model, tok, prompt, variant, k, a.max_tokens, processors
                        )
                        first = first or tokens
                        if tokens != first:
                            raise SystemExit(f"{name} {draft} k={k}: tokens differ")
                        if r:
                            speeds[on].append(speed)
                on, off = (statistics.median(speeds[e]) for e in (True, False))
                print(
                    f"{name:14} {draft:10} {k!s:>4} {on:7.1f} {off:7.1f} "
                    f"{on / off:6.3f} {per_pass[True]:11.2f} {per_pass[False]:5.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
