"""The ``mlx_spec`` commands: one module each, ``cli.py`` dispatches.

``common.py`` holds what they share (loading, sampler flags, one-line errors);
``session.py`` is the file format of ``chat --prompt-cache-file``.
"""
