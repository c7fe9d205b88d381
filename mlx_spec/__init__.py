"""mlx-spec: lossless speculative decoding for MLX language models."""

from .core.stats import SpecStats
from .generate import generate, stream_generate
from .loading import load

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate", "SpecStats"]
