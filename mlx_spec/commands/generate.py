"""``mlx_spec generate``: the flags of ``mlx_lm.generate`` plus drafting flags."""

import sys

import mlx.core as mx

from ..generate import generate
from ..mlx_lm_compat import generate_arg_parser
from .common import (
    add_speculation_flags,
    bad_input,
    command,
    load_model,
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
    # The demo model was trained on Python code.
    parser.set_defaults(prompt="import os\nimport sys\n\n\ndef main(argv):\n    ")
    return parser


@command("mlx_spec generate")
def main(argv=None):
    args = setup_parser().parse_args(argv)
    refuse_unsupported(args, _UNSUPPORTED)
    if args.seed is not None:
        mx.random.seed(args.seed)
    _, model, tokenizer = load_model(args.model, mtp_path=args.mtp_path)
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
    with bad_input():
        text = generate(
            model,
            tokenizer,
            prompt,
            max_tokens=args.max_tokens,
            verbose=args.verbose,
            sampler=sampler,
            draft=args.draft,
            num_draft_tokens=args.num_draft_tokens,
            max_ngram=args.max_ngram,
            rollback=args.rollback,
            max_kv_size=args.max_kv_size,
            prefill_step_size=args.prefill_step_size,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start,
        )
    if not args.verbose:
        print(text)
    return 0
