"""mlx-spec: lossless speculative decoding for MLX language models."""

from .core.stats import SpecStats
from .generate import generate, stream_generate
from .loading import load, load_drafter
from .session import DecodeOptions, KVQuantization, Session

__version__ = "0.1.0"
__all__ = [
    "load",
    "load_drafter",
    "generate",
    "stream_generate",
    "Session",
    "DecodeOptions",
    "KVQuantization",
    "SpecStats",
]
