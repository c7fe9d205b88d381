"""What mlx-spec adds to mlx-lm's Qwen3-Next / Qwen3.5 models.

- ``gdn.py``: GDN layers that capture what rollback needs during a verify pass;
- ``fast_layers.py``: the wiring of the custom kernels into one model's layers;
- ``mtp/``: the MTP head, its weights and attaching it on load;
- ``dflash/``: the DFlash block drafter's model, its config and weights;
- ``fingerprint.py``: identities of a model (config hash, shared-weight
  signature) for sidecars, sessions and cached profiles.
"""
