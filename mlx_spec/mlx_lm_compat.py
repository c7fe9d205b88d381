"""Every part of mlx-lm that mlx_spec uses, named in this one module.

mlx_spec extends mlx-lm's models instead of forking them, so it relies on a
few of mlx-lm's internals (model and cache classes, helpers of the generate
loop, the gated-delta functions), which change between releases. Runtime
code imports them from here only; ``pyproject.toml`` declares the mlx-lm
versions this was tested with (``TESTED_MLX_LM``), and importing mlx_spec
with another version warns once, naming it.
"""

import functools
import warnings

import mlx.core as mx
import mlx_lm
from mlx_lm import convert, load
from mlx_lm.chat import setup_arg_parser as chat_arg_parser
from mlx_lm.generate import (
    DEFAULT_QUANTIZED_KV_START,
    BatchGenerator,
    GenerationResponse,
    TextStateMachine,
    generate_step,
    generation_stream,
    make_text_state_machine,
    maybe_quantize_kv_cache,
)
from mlx_lm.generate import setup_arg_parser as generate_arg_parser
from mlx_lm.generate import stream_generate as plain_stream_generate
from mlx_lm.generate import wired_limit
from mlx_lm.models import llama, qwen3_5, qwen3_next  # llama: test checkpoints
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from mlx_lm.models.gated_delta import _gated_delta_step_ops as gated_delta_step_ops
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.models.qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextMLP,
    Qwen3NextSparseMoeBlock,
)
from mlx_lm.models.switch_layers import (
    QuantizedSwitchLinear,
    SwiGLU,
    SwitchGLU,
    SwitchLinear,
)
from mlx_lm.sample_utils import apply_min_p as _apply_min_p
from mlx_lm.sample_utils import apply_top_k as _apply_top_k
from mlx_lm.sample_utils import apply_top_p as _apply_top_p
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.sample_utils import greedy_sampler as _greedy
from mlx_lm.sample_utils import make_sampler as _mlx_lm_make_sampler
from mlx_lm.utils import save_model
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS as DOWNLOAD_PATTERNS
from mlx_lm.utils import _download as download_model
from mlx_lm.utils import dequantize_model


def keeps_random_state(fn):
    """``fn``, which leaves ``mx.random.state`` as it found it when it raises.

    mlx-lm's sampling filters are compiled with the random state as an input
    and an output: while ``mx.compile`` traces one, the state holds a
    placeholder, and a filter that raises then (``apply_top_k`` checks its
    ``top_k`` against the vocabulary while tracing) leaves that placeholder
    in place. Every later random draw in the process then fails ("Attempting
    to eval an array without a primitive"). The state saved before the call
    is put back (``mx.random.seed`` of its two words sets exactly that key).
    """

    @functools.wraps(fn)
    def call(*args, **kwargs):
        saved = mx.random.state[0]
        try:
            return fn(*args, **kwargs)
        except BaseException:
            high, low = saved.tolist()
            mx.random.seed((high << 32) | low)
            raise

    return call


apply_min_p = keeps_random_state(_apply_min_p)
apply_top_k = keeps_random_state(_apply_top_k)
apply_top_p = keeps_random_state(_apply_top_p)


def mlx_lm_make_sampler(*args, **kwargs):
    """mlx-lm's ``make_sampler``; its sampler keeps the random state when it
    raises (see :func:`keeps_random_state`)."""
    sampler = _mlx_lm_make_sampler(*args, **kwargs)
    return sampler if sampler is _greedy else keeps_random_state(sampler)


# make_logits_processors' penalties (the fields mlx_lm.server reads from a
# request): (keyword, its lowest value or None, its context-size keyword).
PENALTIES = (
    ("repetition_penalty", 0, "repetition_context_size"),
    ("presence_penalty", None, "presence_context_size"),
    ("frequency_penalty", None, "frequency_context_size"),
)

# The releases the test suite passed on; pyproject.toml allows this minor series.
TESTED_MLX_LM = ("0.32.0", "0.32.2")
# Those mlx_spec.plugin's tests passed on (it replaces mlx-lm's functions by name).
PLUGIN_TESTED_MLX_LM = ("0.32.2",)
MLX_LM_VERSION = mlx_lm.__version__


def _minor(version: str):
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


if _minor(MLX_LM_VERSION) != _minor(TESTED_MLX_LM[0]):
    warnings.warn(
        f"mlx_spec was tested with mlx-lm {' and '.join(TESTED_MLX_LM)}; "
        f"mlx-lm {MLX_LM_VERSION} is installed and may not work with it",
        stacklevel=2,
    )

__all__ = [
    "ArraysCache",
    "BatchGenerator",
    "DEFAULT_QUANTIZED_KV_START",
    "GenerationResponse",
    "KVCache",
    "MLX_LM_VERSION",
    "PENALTIES",
    "QuantizedSwitchLinear",
    "Qwen3NextAttention",
    "Qwen3NextMLP",
    "Qwen3NextSparseMoeBlock",
    "SwiGLU",
    "SwitchGLU",
    "SwitchLinear",
    "TESTED_MLX_LM",
    "TokenizerWrapper",
    "apply_min_p",
    "apply_top_k",
    "apply_top_p",
    "compute_g",
    "convert",
    "create_attention_mask",
    "dequantize_model",
    "download_model",
    "DOWNLOAD_PATTERNS",
    "gated_delta_step_ops",
    "gated_delta_update",
    "keeps_random_state",
    "generate_step",
    "generation_stream",
    "initialize_rope",
    "load",
    "load_prompt_cache",
    "make_logits_processors",
    "make_prompt_cache",
    "maybe_quantize_kv_cache",
    "mlx_lm_make_sampler",
    "normalize_qk",
    "plain_stream_generate",
    "llama",
    "qwen3_5",
    "qwen3_next",
    "save_model",
    "save_prompt_cache",
    "generate_arg_parser",
    "TextStateMachine",
    "make_text_state_machine",
    "server_message_helpers",
    "gated_delta_update_runs_ops",
    "chat_arg_parser",
    "PLUGIN_MODULES",
    "PLUGIN_TESTED_MLX_LM",
    "PLUGIN_COMMANDS",
    "plugin_modules",
    "server_response_generator",
    "command_main",
    "wired_limit",
    "scaled_dot_product_attention",
]


def gated_delta_update_runs_ops(k) -> bool:
    """Whether ``gated_delta_update`` takes its ops path (one
    ``gated_delta_step_ops`` per token) for keys ``k`` [.., Dk] rather than
    its Metal kernel: mlx-lm 0.32's condition."""
    dk = k.shape[-1]
    on_metal = mx.default_device() == mx.gpu and mx.metal.is_available()
    return not on_metal or dk < 32 or dk % 32 != 0


# The modules of mlx-lm whose ``stream_generate`` the plugin routes: the one
# that defines it and those that import the name from it (the package, the
# chat and server commands). Their ``main`` is each command's entry point.
# ``generate_step`` is routed wherever a loaded mlx-lm module holds it
# (``mlx_lm.generate``; ``mlx_lm.cache_prompt``, for its prefill, once loaded).
PLUGIN_MODULES = ("mlx_lm.generate", "mlx_lm", "mlx_lm.chat", "mlx_lm.server")
PLUGIN_COMMANDS = ("mlx_lm.generate", "mlx_lm.chat", "mlx_lm.server")


def plugin_modules():
    """Every loaded mlx-lm module, after importing those of ``PLUGIN_MODULES``
    (a module imported later by another mlx-lm module, holding the name it
    imported from ``mlx_lm.generate``, is found here too)."""
    import importlib
    import sys

    for name in PLUGIN_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # another mlx-lm's layout: the others are routed
            pass
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None and (name == "mlx_lm" or name.startswith("mlx_lm."))
    ]


def server_response_generator():
    """``mlx_lm.server.ResponseGenerator``, whose ``_is_batchable(args)``
    picks between the batched path (``BatchGenerator``) and
    ``stream_generate``; None where this mlx-lm has no such method."""
    try:
        from mlx_lm import server
    except ImportError:
        return None
    generator = getattr(server, "ResponseGenerator", None)
    return generator if "_is_batchable" in getattr(generator, "__dict__", {}) else None


def command_main(name: str):
    """The ``main`` of the mlx-lm command module ``name`` (one of
    ``PLUGIN_COMMANDS``); ``ValueError`` naming the choices otherwise."""
    import importlib

    if name not in PLUGIN_COMMANDS:
        raise ValueError(
            f"unknown mlx-lm command {name!r}; choose one of {', '.join(PLUGIN_COMMANDS)}"
        )
    return importlib.import_module(name).main


def server_message_helpers():
    """``(convert_chat, process_message_content)`` of ``mlx_lm.server``: the
    prompt of a tokenizer without a chat template, and message content made
    ready for one. Imported on first use (that module is slow to import)."""
    from mlx_lm import server

    return server.convert_chat, server.process_message_content
