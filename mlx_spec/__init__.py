"""mlx-spec: lossless speculative decoding for MLX language models."""

from .core.stats import SpecStats
from .generate import generate, stream_generate
from .loading import load
from .session import DecodeOptions, KVQuantization, Session

__version__ = "0.1.0"
__all__ = [
    "load",
    "generate",
    "stream_generate",
    "Session",
    "DecodeOptions",
    "KVQuantization",
    "SpecStats",
]
