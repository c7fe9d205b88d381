"""The decode core: the speculative loop and what it is made of.

- ``decode.py``: :class:`SpeculativeDecoder` (draft, verify, commit) and
  ``speculative_generate_step``, the generator the API wraps;
- ``state.py``: rolling every layer back to the accepted prefix
  (``begin(T)`` / ``commit(n)``);
- ``target.py``: one target forward giving logits and post-norm hidden states;
- ``verify.py`` and ``sampling.py``: greedy acceptance and rejection sampling;
- ``policy.py``: the draft length ``auto`` and the measured verify costs;
- ``stats.py``: speculation counters and phase timing.
"""
