"""mlx-spec: lossless speculative decoding for MLX language models."""

from .generate import generate, stream_generate
from .loading import load
from .stats import SpecStats

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate", "SpecStats"]
