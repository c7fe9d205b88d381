"""mlx-lm's ``generate`` command line as the plugin's tests run it, with and
without the plugin."""

from typing import List

# The tiny checkpoints' greedy continuation of this repeats it: copies to draft.
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


def generate_args(model) -> List[str]:
    """The arguments of ``mlx_lm generate`` over ``model``: 24 greedy tokens
    of :data:`PROMPT`, the text alone on stdout."""
    return [
        "--model",
        str(model),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "24",
        "--verbose",
        "False",
        "--ignore-chat-template",
    ]
