"""mlx-spec: lossless speculative decoding for MLX language models."""

__version__ = "0.1.0"
