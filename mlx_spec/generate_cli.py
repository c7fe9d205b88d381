"""``mlx_spec generate``: the flags of ``mlx_lm.generate`` plus drafting flags."""

import sys

import mlx.core as mx

from .mlx_lm_compat import setup_arg_parser
from .cli_common import CommandError, bad_input, command, load_model, sampler_from_flags
from .decode import MAX_DRAFT_TOKENS
from .drafters import DRAFTS
from .generate import generate

# mlx_lm.generate flags that speculative decoding here does not implement.
_UNSUPPORTED = {"draft_model": "--draft-model", "image": "--image"}


def draft_length(value: str):
    """``--num-draft-tokens`` value: 'auto' or an integer (range checked later)."""
    return value if value == "auto" else int(value)


def setup_parser():
    parser = setup_arg_parser()
    parser.prog = "mlx_spec generate"
    parser.description = (
        "Speculative generation with drafts from the model's MTP head or n-gram lookup."
    )
    parser.add_argument(
        "--draft",
        choices=DRAFTS,
        default=None,
        help="Drafter: 'mtp' the model's own multi-token-prediction head, "
        "'ngram' a lookup of the context for a continuation, 'mtp+ngram' both, "
        "'none' plain decoding (default: mtp+ngram when the model has an MTP "
        "head, else ngram).",
    )
    parser.add_argument(
        "--mtp-path",
        help="MTP head sidecar (mtp.safetensors written by 'mlx_spec convert') "
        "for a model directory without one.",
    )
    parser.add_argument(
        "--max-ngram",
        type=int,
        default=3,
        help="Longest n-gram the lookup drafter matches (>= 2).",
    )
    parser.add_argument(
        "--rollback",
        choices=("store", "replay"),
        default="store",
        help="How Gated-DeltaNet layers are rolled back after a verify pass.",
    )
    # The demo model was trained on Python code.
    parser.set_defaults(prompt="import os\nimport sys\n\n\ndef main(argv):\n    ")
    for action in parser._actions:
        if action.dest == "model":
            action.help = "Model directory (default: the bundled demo model)."
        if action.dest == "num_draft_tokens":
            action.type, action.default = draft_length, "auto"
            action.help = (
                f"Tokens drafted per verify pass (0..{MAX_DRAFT_TOKENS}), or 'auto' "
                "(default): chosen each pass from the measured verify cost and the "
                "acceptance so far, 0 while speculation does not pay."
            )
    return parser


@command("mlx_spec generate")
def main(argv=None):
    args = setup_parser().parse_args(argv)
    for dest, flag in _UNSUPPORTED.items():
        if getattr(args, dest, None):
            raise CommandError(f"{flag} is not supported")
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
