"""The DFlash block drafter's model: config, module, context cache, weights
(see docs/dflash.md)."""
