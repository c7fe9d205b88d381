"""The decode core: the speculative loop and what it is made of.

- ``sequence.py``: :class:`SpeculativeDecoder`, a sequence's history,
  caches, prefill and drafter; ``decode.py``: ``decode_steps``, the loop of
  one sequence decoded alone (sessions open it: :mod:`mlx_spec.session`);
- ``batch.py``: :class:`BatchDecoder`, the one engine (draft, verify, commit);
- ``state.py``: rolling every layer back to the accepted prefix
  (``begin(T)`` / ``commit(n)``);
- ``target.py``: one target forward giving logits and post-norm hidden states;
- ``verify.py`` and ``sampling.py``: greedy acceptance and rejection sampling;
- ``policy.py``: the draft length ``auto`` and the measured verify costs;
- ``stats.py``: speculation counters and phase timing.
"""
