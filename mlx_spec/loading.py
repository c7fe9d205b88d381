"""Loading models for speculative decoding."""

from pathlib import Path
from typing import Any, Optional, Tuple, Union

import mlx_lm

from .gdn import make_verifiable


def prepare_model(model):
    """Give the model's GDN layers the verify forward (idempotent, in place)."""
    for layer in model.layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None:
            make_verifiable(gdn)
    return model


def load(
    path_or_hf_repo: Union[str, Path],
    tokenizer_config: Optional[dict] = None,
    **kwargs: Any,
) -> Tuple[Any, Any]:
    """Load ``(model, tokenizer)`` like ``mlx_lm.load``, ready for speculation."""
    path = Path(path_or_hf_repo)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    model, tokenizer = mlx_lm.load(
        str(path), tokenizer_config=tokenizer_config, **kwargs
    )
    return prepare_model(model), tokenizer
