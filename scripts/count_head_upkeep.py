"""Count what the MTP head's upkeep runs under ``auto``, with and without
suspension (``PolicyTuning.suspend_after``): head forwards, rows run through
the head, the most accepted rows held unrun, passes and drafts; and check each
output equals plain decoding's. Counts only, no timings (the choices ``auto``
makes depend on this machine's speed, so counts vary between runs).

    python scripts/count_head_upkeep.py [--workload free-main ...] [--tokens 400]
"""

import argparse
from dataclasses import replace

import mlx_spec
from mlx_spec import DecodeOptions, Session
from mlx_spec.core.policy_tuning import DEFAULT_TUNING
from mlx_spec.demo import default_model_path
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.mlx_lm_compat import plain_stream_generate
from mlx_spec.timed_runs import load_workloads


class CountedHead:
    """The head, its forwards, the rows they run and the rows it takes
    logits of (a vocabulary-wide product each) counted."""

    def __init__(self, head):
        self._head, self.forwards, self.rows, self.logit_rows = head, 0, 0, 0

    def __getattr__(self, name):
        return getattr(self._head, name)

    def head_hidden(self, tokens, *args, **kwargs):
        self.forwards += 1
        self.rows += tokens.size
        return self._head.head_hidden(tokens, *args, **kwargs)

    def logits(self, hm):
        self.logit_rows += hm.size // hm.shape[-1]
        return self._head.logits(hm)


def run(model, prompt, tokens, tuning):
    head = CountedHead(model.mtp_head)
    drafter = MTPDrafter(head)
    session = Session(model, DecodeOptions(drafter, "auto", tuning=tuning))
    out, held, suspended = [], 0, 0
    for token, _, _ in session.generate(prompt, max_tokens=tokens):
        out.append(token)
        held = max(held, drafter.rows.pending_rows)
        suspended += drafter.rows.suspended
    stats = session.stats
    return out, dict(
        head_forwards=head.forwards,
        head_rows=head.rows,
        logit_rows=head.logit_rows,
        most_rows_held=held,
        tokens_while_suspended=suspended,
        passes=stats.verify_passes,
        drafted=stats.drafted,
        accepted=stats.accepted,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["free-main", "free-class"])
    parser.add_argument("--tokens", type=int, default=400)
    args = parser.parse_args()
    model, tok = mlx_spec.load(default_model_path())
    workloads = {w["name"]: w for w in load_workloads(tokenizer=tok)}
    variants = {
        "suspending": DEFAULT_TUNING,
        "never suspending": replace(DEFAULT_TUNING, suspend_after=10**9),
    }
    for name in args.workload:
        prompt = tok.encode(workloads[name]["prompt"])
        plain = [
            r.token
            for r in plain_stream_generate(model, tok, prompt, max_tokens=args.tokens)
        ]
        for variant, tuning in variants.items():
            out, counts = run(model, prompt, args.tokens, tuning)
            equal = out == plain[: len(out)] and len(out) == len(plain)
            print(name, variant, "equal" if equal else "DIFFERENT", counts)


if __name__ == "__main__":
    main()
