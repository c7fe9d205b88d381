"""Test support: tiny checkpoints of every supported family, built by code.

Public so that other projects (and this one's tests and scripts) can build
models without a model hub. No runtime module of mlx_spec imports it.

- ``checkpoints.py``: :func:`write_tiny_checkpoint`, raw Hugging Face layout
  with ``mtp.*`` tensors, deterministic from a seed;
- ``tokenizer.py``: the tiny byte-level BPE tokenizer they ship;
- ``mtp_heads.py``: checkpoints whose MTP head predicts well;
- ``dflash_drafters.py``: tiny random DFlash drafters for each tiny target,
  and one built to propose a cycle target's next token;
- ``dflash_reference.py``: z-lab's own DFlash draft model and decode loop
  (the optional ``dflash`` package) run on our checkpoints;
- ``reference.py``: prompts, mlx-lm reference decoding, an oracle drafter.
- ``agent_checkpoint.py``: a checkpoint with a chat template that thinks and
  calls a tool (agent clients' round trips);
- ``server.py``, ``http_client.py``, ``sdk_clients.py``: server processes,
  plain HTTP requests, the ``openai`` and ``anthropic`` SDKs as clients.
- ``doctor_reports.py``: a doctor report's documented fields and types, its
  quick prompts cut short.
"""
