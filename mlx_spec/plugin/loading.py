"""A model mlx-lm's ``load`` returned, made ready for speculation while the
plugin is on: what :func:`mlx_spec.load` adds to mlx-lm's load."""

import warnings
from typing import Optional

from ..errors import one_line
from ..hub.resolve import resolve_model
from ..loading import prepare_model, upcast_experts_on_cpu
from ..models.mtp import attach_mtp_head
from .coverage import model_coverage


def ready_for_speculation(
    model, path_or_hf_repo, revision: Optional[str] = None, lazy: bool = False
) -> None:
    """In place, for a model the plugin covers: the MTP head found with its
    files attached (``model.mtp_head``, which ``draft="auto"`` drafts with),
    the Gated-DeltaNet layers given their verify forward, and on the CPU a
    half-precision MoE cast to float32 (mlx-lm alone cannot run its experts
    there). Nothing changes mlx-lm's tokens. A failure only warns: the model
    mlx-lm loaded is returned to its caller whatever happens here."""
    if not model_coverage(model).covered:
        return
    try:
        attach_mtp_head(model, resolve_model(path_or_hf_repo, revision), lazy=lazy)
        prepare_model(upcast_experts_on_cpu(model))
    except Exception as error:  # the model still decodes (n-gram drafts)
        warnings.warn(
            f"mlx_spec.plugin: {path_or_hf_repo!s:.200} loaded without its MTP "
            f"head ({one_line(error)})",
            stacklevel=3,
        )
