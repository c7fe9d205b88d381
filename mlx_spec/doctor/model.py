"""The doctor's model part: what was loaded, whether its MTP head is this
model's and works, and the DFlash drafter model ``--draft-model`` names (its
config's target layers and block, its identity), loaded for the target.

Loading goes through the commands' loader (:mod:`mlx_spec.model_files`:
repo ids, every file checked and named); the head's provenance is what discovery recorded on the model
(``model.mtp_info``, :func:`~mlx_spec.models.mtp.mtp_report`). Two checks
of the head go beyond loading: a sidecar's weight signature is compared with
the model's again (the cosine of each signature row is reported), and the
head runs teacher-forced over a built-in text, where its logits must be
finite; how often its guess for token p+2 agrees with the target's own is
reported (a trained head agrees often, a random one almost never).
"""

import json
import warnings
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..core.target import _lm_head
from ..errors import InputError
from ..model_files import load_model
from ..models.fingerprint import (
    SAME_WEIGHTS_COSINE,
    signature_from_text,
    weight_signature,
)
from ..models.identity import draft_model_fingerprint
from ..models.mtp import mtp_report
from ..models.mtp.head import text_args, text_model
from ..models.mtp.weights import SIGNATURE_KEY
from .result import FAIL, PASS, SKIP, Part, one_line

# The text the head is run over, teacher-forced (Python: what the demo
# model was trained on; any text does for the finiteness check).
HEAD_PROBE_TEXT = (
    "def fibonacci(n):\n"
    '    """Return the n-th Fibonacci number."""\n'
    "    a, b = 0, 1\n"
    "    for _ in range(n):\n"
    "        a, b = b, a + b\n"
    "    return a\n"
)


def load_for_doctor(name: Optional[str], revision=None) -> Tuple[Path, object, object]:
    """``(path, model, tokenizer)``; an InputError with one line on failure.
    The warning of a refused head is not printed: the report says it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(name, revision=revision)


def _nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def _layer_kinds(model) -> dict:
    kinds = {}
    for layer in text_model(model).model.layers:
        mixer = "gated_deltanet" if hasattr(layer, "linear_attn") else "attention"
        mlp = "moe" if hasattr(getattr(layer, "mlp", None), "switch_mlp") else "dense"
        key = f"{mixer}+{mlp}"
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


def _quantization(path: Path) -> str:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "unknown (config.json unreadable)"
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, dict) and q.get("bits"):
        return f"{q['bits']}-bit, group size {q.get('group_size', 64)}"
    if isinstance(q, dict) and q.get("quant_method"):
        return str(q["quant_method"])
    return "none"


def describe_model(part: Part, path: Path, model) -> None:
    args = text_args(model)
    embed = text_model(model).model.embed_tokens
    part.facts.update(
        path=str(path),
        model_type=str(getattr(model, "model_type", "")),
        layers=_layer_kinds(model),
        hidden_size=int(args.hidden_size),
        vocab_size=int(args.vocab_size),
        dtype=str(getattr(embed, "weight", mx.zeros(1)).dtype).split(".")[-1],
        quantization=_quantization(path),
        model_memory_gb=round(_nbytes(model) / 1e9, 4),
    )


def signature_cosines(file: str, model) -> Optional[list]:
    """The cosine of each row of ``file``'s recorded weight signature with
    the model's; None when the file records none."""
    _, meta = mx.load(file, return_metadata=True)
    text = (meta or {}).get(SIGNATURE_KEY)
    if text is None:
        return None
    theirs, ours = signature_from_text(text), weight_signature(model)
    if theirs.shape != ours.shape:
        return [0.0, 0.0]
    return [
        float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
        for a, b in zip(theirs, ours)
    ]


def head_agreement(model, head, tokenizer) -> Tuple[bool, float]:
    """(logits finite, agreement): the head run teacher-forced over
    :data:`HEAD_PROBE_TEXT`; agreement is the share of positions p where its
    argmax for token p+2 equals the target's argmax there."""
    tokens = mx.array(tokenizer.encode(HEAD_PROBE_TEXT))[None]
    hidden = text_model(model).model(tokens)  # [1, n, H], no cache
    target = mx.argmax(_lm_head(model)(hidden), axis=-1)[0]  # predicts p+1
    logits, _ = head(tokens[:, 1:], hidden[:, :-1])  # predicts p+2
    finite = bool(mx.all(mx.isfinite(logits)).item())
    guess = mx.argmax(logits, axis=-1)[0]
    agree = (guess[:-1] == target[1:-1]).astype(mx.float32).mean().item()
    return finite, float(agree)


def check_head(part: Part, model, tokenizer) -> None:
    state = getattr(model, "__dict__", {})
    head, info = state.get("mtp_head"), state.get("mtp_info")
    part.facts["mtp"] = (
        mtp_report(model) or "MTP head: not supported for this model type"
    )
    if head is None:
        missing = state.get("mtp_missing") or "this model type has no MTP head"
        # Found but refused (broken, another model's) is a failure; none at all is not.
        status = FAIL if missing.startswith("MTP disabled") else SKIP
        part.check("mtp head", status, f"none: {missing}; n-gram drafting only")
        return
    part.facts["mtp_head"] = {
        "files": list(info.files) if info else [],
        "found_as": info.found_as if info else "",
        "layout": info.layout.prefix if info else "",
        "experts": info.layout.experts if info else "",
        "norm_shift": info.shift.describe() if info else "",
        "bits": info.bits if info else 0,
        "head_memory_gb": round(_nbytes(head) / 1e9, 4),
    }
    part.check("mtp head", PASS, mtp_report(model) or "attached")
    if info is not None and info.signed:
        cosines = signature_cosines(info.files[0], model)
        part.facts["mtp_head"]["signature_cosines"] = cosines
        same = cosines is not None and min(cosines) >= SAME_WEIGHTS_COSINE
        part.check(
            "weight signature",
            PASS if same else FAIL,
            (
                f"the sidecar's recorded rows match this model's (cosines "
                f"{', '.join(f'{c:.3f}' for c in cosines)})"
                if same
                else "the sidecar's recorded rows are another model's"
            ),
        )
    else:
        part.check(
            "weight signature",
            SKIP,
            "the head ships in the model's own files (no signature to compare)",
        )
    finite, agree = head_agreement(model, head, tokenizer)
    part.facts["mtp_head"]["teacher_forced_agreement"] = round(agree, 4)
    if finite:
        part.check(
            "head forward",
            PASS,
            f"finite logits; agrees with the target on {agree:.0%} of a built-in text",
        )
    else:
        part.check(
            "head forward",
            FAIL,
            "the head's logits hold NaN or infinity: its weights are corrupt",
        )


def check_drafter(part: Part, model, name: str, quantize: Optional[int] = None):
    """Load the DFlash drafter ``name`` (a path or repo id) for ``model`` and
    attach it (``dflash`` is then checked and measured with the other
    drafters); one that cannot be loaded or does not fit fails this check on
    one line, and the model stays usable with its other drafters."""
    from ..loading import use_draft_model

    facts = {"requested": str(name), "quantize": quantize}
    part.facts["draft_model"] = facts
    try:
        drafter = use_draft_model(model, name, quantize=quantize)
    except Exception as e:
        if isinstance(e, (InputError, OSError)):  # it names the file or field
            why = " ".join(str(e).split())
        else:
            why = f"{name}: {one_line(e)}"
        part.check("drafter", FAIL, why)
        return
    config = drafter.config
    files = getattr(drafter, "source_files", ())
    facts.update(
        path=str(Path(files[0]).parent) if files else str(name),
        layers=int(config.num_hidden_layers),
        target_layer_ids=[int(i) for i in config.target_layer_ids],
        block_size=int(config.block_size),
        mask_token_id=int(config.mask_token_id),
        identity=draft_model_fingerprint(drafter),
        draft_memory_gb=round(_nbytes(drafter) / 1e9, 4),
    )
    bits = f"{quantize}-bit in memory" if quantize else "as stored"
    part.check(
        "drafter",
        PASS,
        f"DFlash drafter {name}: {facts['layers']} layers reading target layers "
        f"{facts['target_layer_ids']}, block {facts['block_size']}, {bits}, "
        f"identity {facts['identity'][:12]}",
    )


def check_model(
    part: Part,
    name: Optional[str],
    revision=None,
    draft_model: Optional[str] = None,
    draft_quantize: Optional[int] = None,
):
    """Load the model (and ``draft_model``, a DFlash drafter for it) and
    describe it; the (path, model, tokenizer) loaded, or None when the model
    could not be (the part then says why)."""
    part.facts["requested"] = name or "the bundled demo model"
    try:
        path, model, tokenizer = load_for_doctor(name, revision)
    except InputError as e:
        part.check("load", FAIL, str(e))
        part.settle("")
        return None
    part.check("load", PASS, f"loaded {path}")
    # A model that loaded is returned whatever its description gives, so
    # that the parts after this one still run on it.
    steps = [
        ("describe", lambda: describe_model(part, path, model)),
        ("head checks", lambda: check_head(part, model, tokenizer)),
    ]
    if draft_model is not None:
        steps.append(
            ("drafter", lambda: check_drafter(part, model, draft_model, draft_quantize))
        )
    for step, body in steps:
        try:
            body()
        except Exception as e:
            part.check(step, FAIL, f"the check itself failed: {one_line(e)}")
    drafter = part.facts.get("draft_model", {})
    part.settle(
        f"{part.facts.get('model_type', '?')}, "
        f"{sum(part.facts.get('layers', {}).values())} layers, "
        f"{part.facts.get('quantization', '?')}, "
        f"{part.facts.get('model_memory_gb', 0):.3g} GB"
        + (
            f"; DFlash drafter of {drafter['layers']} layers, block "
            f"{drafter['block_size']}"
            if "identity" in drafter
            else ""
        )
    )
    return path, model, tokenizer
