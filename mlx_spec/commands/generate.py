"""``mlx_spec generate``: the flags of ``mlx_lm.generate`` plus drafting flags."""

import sys
from contextlib import contextmanager


from ..core.decode import SpeculativeDecoder
from ..generate import generate
from ..mlx_lm_compat import generate_arg_parser
from .common import (
    CommandError,
    add_penalty_flags,
    add_pipeline_flag,
    add_speculation_flags,
    bad_input,
    command,
    join_pipeline,
    load_model,
    logits_processors_from_flags,
    one_line,
    refuse_unsupported,
    sampler_from_flags,
)

# mlx_lm.generate flags that speculative decoding here does not implement.
_UNSUPPORTED = {"draft_model": "--draft-model", "image": "--image"}


def setup_parser():
    parser = add_speculation_flags(
        generate_arg_parser(),
        "mlx_spec generate",
        "Speculative generation with drafts from the model's MTP head or n-gram lookup.",
    )
    add_penalty_flags(parser)
    add_pipeline_flag(parser, "prints")
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


@command("mlx_spec generate")
def main(argv=None):
    args = setup_parser().parse_args(argv)
    refuse_unsupported(args, _UNSUPPORTED)
    processors = logits_processors_from_flags(args)
    group = join_pipeline(args)
    _, model, tokenizer = load_model(
        args.model,
        mtp_path=args.mtp_path,
        revision=args.revision,
        pipeline_group=group,
    )
    quiet = group is not None and group.rank() != 0
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)

    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    chat = not args.ignore_chat_template and tokenizer.has_chat_template
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if args.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": args.system_prompt})
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    prompt = tokenizer.encode(prompt, add_special_tokens=not chat)
    sampler = sampler_from_flags(args, tokenizer)
    extra = {}
    if group is not None and (args.draft == "none" or args.num_draft_tokens == 0):
        # mlx-lm's own loop computes a step ahead, which a pipeline cannot
        # leave cleanly: plain decoding is our loop with no drafts instead.
        extra["decoder"] = SpeculativeDecoder(model, None, max_draft=1)
        args.num_draft_tokens = 0
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
