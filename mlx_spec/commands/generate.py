"""``mlx_spec generate``: the flags of ``mlx_lm.generate`` plus drafting flags."""

import argparse
import json
import sys
import warnings
from contextlib import contextmanager

from ..errors import one_line
from ..generate import generate, vocab_size
from ..mlx_lm_compat import generate_arg_parser
from ..models.mtp import MTPDisabledWarning, mtp_report
from ..session import DecodeOptions, Session
from ..model_files import load_model
from .common import (
    CommandError,
    add_extra_eos_tokens,
    add_penalty_flags,
    add_draft_model_flags,
    add_pipeline_flag,
    add_speculation_flags,
    attach_draft_model,
    bad_input,
    check_run_flags,
    command,
    join_pipeline,
    logits_processors_from_flags,
    read_text,
    refuse_unsupported,
    sampler_from_flags,
)

# mlx_lm.generate flags that speculative decoding here does not implement;
# those not in mlx_spec's help are refused by name all the same.
_UNSUPPORTED = {
    "image": "--image",
    "prompt_cache_file": "--prompt-cache-file",
    "use_default_chat_template": "--use-default-chat-template",
}
# An mlx-lm prompt cache holds no drafter state; tokenizers carry no default
# chat template any more (mlx_lm.generate ignores that flag).
_HIDDEN = ("prompt_cache_file", "use_default_chat_template")


def setup_parser():
    parser = add_speculation_flags(
        generate_arg_parser(),
        "mlx_spec generate",
        "Speculative generation with drafts from the model's MTP head or n-gram lookup.",
    )
    add_penalty_flags(parser)
    add_draft_model_flags(parser)
    add_pipeline_flag(parser, "prints")
    for action in parser._actions:
        if action.dest in _HIDDEN:
            action.help = argparse.SUPPRESS
    # The demo model was trained on Python code.
    parser.set_defaults(prompt="import os\nimport sys\n\n\ndef main(argv):\n    ")
    return parser


@contextmanager
def _pipeline_errors(group):
    """A lost peer of a pipeline is one line naming this rank, not a traceback."""
    try:
        yield
    except RuntimeError as e:
        if group is None:
            raise
        raise CommandError(
            f"pipeline rank {group.rank()} of {group.size()}: {one_line(e)}"
        ) from None


def _template_config(text):
    """``--chat-template-config``: a JSON object of chat template arguments."""
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except ValueError as e:
        raise CommandError(f"--chat-template-config is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise CommandError(
            f"--chat-template-config must be a JSON object, got {text!r:.60}"
        )
    return config


@command("mlx_spec generate")
def main(argv=None):
    args = setup_parser().parse_args(argv)
    refuse_unsupported(args, _UNSUPPORTED)
    check_run_flags(args)
    template_kwargs = _template_config(args.chat_template_config)
    processors = logits_processors_from_flags(args)
    group = join_pipeline(args)
    extra_load = {}
    if args.quantize_activations:
        extra_load["model_config"] = {"quantize_activations": True}
    with warnings.catch_warnings():  # the report below says it in one line
        warnings.simplefilter("ignore", MTPDisabledWarning)
        _, model, tokenizer = load_model(
            args.model,
            mtp_path=args.mtp_path,
            revision=args.revision,
            pipeline_group=group,
            tokenizer_config={"trust_remote_code": args.trust_remote_code},
            adapter_path=args.adapter_path,
            **extra_load,
        )
    quiet = group is not None and group.rank() != 0
    add_extra_eos_tokens(tokenizer, args.extra_eos_token, vocab_size(model))

    args.draft = attach_draft_model(args, model)
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = read_text(sys.stdin, "the prompt on standard input")
    chat = not args.ignore_chat_template and tokenizer.has_chat_template
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if args.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": args.system_prompt})
        prefill = args.prefill_response is not None
        if prefill:  # the reply continues this text, as in mlx_lm.generate
            messages.append({"role": "assistant", "content": args.prefill_response})
        with bad_input(Exception):  # a template's own error (jinja)
            prompt = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                continue_final_message=prefill,
                add_generation_prompt=not prefill,
                **template_kwargs,
            )
    prompt = tokenizer.encode(prompt, add_special_tokens=not chat)
    sampler = sampler_from_flags(args, tokenizer)
    extra = {}
    if group is not None and (args.draft == "none" or args.num_draft_tokens == 0):
        # mlx-lm's own loop computes a step ahead, which a pipeline cannot
        # leave cleanly: plain decoding is our loop with no drafts instead.
        extra["session"] = Session(model, DecodeOptions("none", num_draft_tokens=0))
        args.num_draft_tokens = 0
    report = mtp_report(model)  # which file and layout the head came from
    asks_mtp = args.draft is not None and args.draft.startswith("mtp")
    if report and args.verbose and not quiet and (model.mtp_head or not asks_mtp):
        # On standard output, before the text's first rule, like the rest of
        # the verbose report (a missing head asked for: the error says).
        print(report, flush=True)
    with bad_input(), _pipeline_errors(group):
        text = generate(
            model,
            tokenizer,
            prompt,
            max_tokens=args.max_tokens,
            verbose=args.verbose and not quiet,
            sampler=sampler,
            logits_processors=processors,
            draft=args.draft,
            num_draft_tokens=args.num_draft_tokens,
            max_ngram=args.max_ngram,
            rollback=args.rollback,
            max_kv_size=args.max_kv_size,
            prefill_step_size=args.prefill_step_size,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start,
            **extra,
        )
    if not args.verbose and not quiet:
        print(text)
    return 0
