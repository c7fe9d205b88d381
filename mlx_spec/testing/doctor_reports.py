"""What ``mlx_spec doctor``'s tests check a report against: every
documented field with its type, each part's status, and the quick prompts cut
short for tests that need every part to run, not to measure well."""

from mlx_spec.doctor import PARTS, SCHEMA, SCHEMA_VERSION
from mlx_spec.doctor import runner

STATUSES = {"pass", "fail", "skip"}
TOP = {
    "schema": str,
    "schema_version": int,
    "created": str,
    "quick": bool,
    "model": (str, type(None)),
    "draft_model": (str, type(None)),
    "seconds": float,
    "status": str,
    "parts": dict,
    "recommended": (dict, type(None)),
}
PLATFORM_FACTS = {
    "os": str,
    "os_version": str,
    "machine": str,
    "chip": str,
    "cpu_count": int,
    "memory_gb": (float, type(None)),
    "python": str,
    "mlx": str,
    "mlx_lm": str,
    "mlx_spec": str,
    "device": str,
    "metal": bool,
    "gpu": str,
    "blas": str,
    "blas_library": str,
    "ld_preload": str,
}
MODEL_FACTS = {
    "requested": str,
    "path": str,
    "model_type": str,
    "layers": dict,
    "hidden_size": int,
    "vocab_size": int,
    "dtype": str,
    "quantization": str,
    "model_memory_gb": float,
    "mtp": str,
}
HEAD_FACTS = {
    "files": list,
    "found_as": str,
    "layout": str,
    "experts": str,
    "norm_shift": str,
    "bits": int,
    "head_memory_gb": float,
    "teacher_forced_agreement": float,
}
LOSSLESS_ROW = {
    "prompt": str,
    "draft": str,
    "num_draft_tokens": int,
    "tokens": int,
    "first_differing_token": type(None),
}
SPEED_ROW = {
    "prompt": str,
    "kind": str,
    "draft": str,
    "plain_tps": float,
    "tps": float,
    "speedup": float,
    "speedup_range": list,
    "verdict": str,
    "acceptance_per_position": list,
    "drafted_per_position": list,
    "tokens_per_pass": float,
    "first_differing_token": type(None),
}
RECOMMENDED = {
    "draft": str,
    "num_draft_tokens": (str, int),
    "kernels": str,
    "mean_speedup": dict,
    "why": str,
}
DRAFTER_FACTS = {
    "requested": str,
    "quantize": (int, type(None)),
    "path": str,
    "layers": int,
    "target_layer_ids": list,
    "block_size": int,
    "mask_token_id": int,
    "identity": str,
    "draft_memory_gb": float,
}


def cut_quick_prompts(monkeypatch, max_tokens: int = 8):
    """Make the doctor's quick prompts generate ``max_tokens`` new tokens."""
    quick = runner.doctor_prompts(True)
    monkeypatch.setattr(
        runner,
        "doctor_prompts",
        lambda _quick: [dict(w, max_tokens=max_tokens) for w in quick],
    )


def has_types(d: dict, spec: dict, where: str):
    for key, typ in spec.items():
        assert key in d, f"{where}: no {key}"
        assert isinstance(d[key], typ), f"{where}.{key}: {type(d[key]).__name__}"


def check_schema(report: dict):
    """Every documented field of a full report, with its type."""
    has_types(report, TOP, "report")
    assert report["schema"] == SCHEMA and report["schema_version"] == SCHEMA_VERSION
    assert list(report["parts"]) == list(PARTS)
    for name, part in report["parts"].items():
        assert part["name"] == name and part["status"] in STATUSES
        assert isinstance(part["reason"], str) and part["reason"]
        assert "\n" not in part["reason"]
        for c in part["checks"]:
            assert set(c) == {"name", "status", "reason"} and c["status"] in STATUSES
    parts = report["parts"]
    has_types(parts["platform"]["facts"], PLATFORM_FACTS, "platform")
    model = parts["model"]["facts"]
    has_types(model, MODEL_FACTS, "model")
    has_types(model["mtp_head"], HEAD_FACTS, "model.mtp_head")
    kernels = parts["kernels"]["facts"]
    assert isinstance(kernels["metal"], bool) and kernels["cases"]
    for row in kernels["cases"]:
        has_types(row, {"kernel": str, "shape": str, "reference_error": float}, "case")
    for row in parts["lossless"]["facts"]["runs"]:
        has_types(row, LOSSLESS_ROW, "lossless run")
    speed = parts["speed"]["facts"]
    assert len(speed["verify_cost_ms"]) == 9
    assert all(isinstance(c, float) and c > 0 for c in speed["verify_cost_ms"])
    for row in speed["runs"]:
        has_types(row, SPEED_ROW, "speed run")
    has_types(report["recommended"], RECOMMENDED, "recommended")


def statuses(report: dict) -> dict:
    return {name: part["status"] for name, part in report["parts"].items()}
