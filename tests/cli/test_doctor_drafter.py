"""``mlx_spec doctor --draft-model``: a DFlash drafter named, checked and
measured; quantised in memory, another identity; one that does not load
failing the model part alone in one line; a lossless control."""

import json

import pytest

from mlx_spec.commands import doctor as doctor_command
from mlx_spec.doctor import lossless as lossless_part
from mlx_spec.doctor import run_doctor
from mlx_spec.testing.dflash_drafters import write_dflash_checkpoint
from mlx_spec.testing.doctor_reports import (
    DRAFTER_FACTS,
    check_schema,
    cut_quick_prompts,
    has_types,
    statuses,
)


@pytest.fixture(autouse=True)
def short_prompts(monkeypatch):
    """The quick prompts cut to 8 new tokens: these tests need every part to
    run on their model, not to measure well."""
    cut_quick_prompts(monkeypatch)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A tiny random DFlash drafter for the qwen3_5 tiny target (block 4:
    at most 3 drafts)."""
    return write_dflash_checkpoint(tmp_path_factory.mktemp("doctor_dflash"), "qwen3_5")


def test_a_drafter_model_is_named_checked_and_measured(
    checkpoint_dirs, drafter_dir, tmp_path, capsys
):
    """``--draft-model``: the model part names the drafter (layers read,
    block, identity: the one kept states key on), the lossless part runs
    dflash against plain decoding at a draft inside its block, and the speed
    part measures dflash at auto; the report is whole and passes."""
    import mlx_spec
    from mlx_spec.models.identity import draft_model_fingerprint

    out = tmp_path / "doctor.json"
    model_dir = checkpoint_dirs["qwen3_5"]
    argv = ["--quick", "--model", str(model_dir), "--draft-model", str(drafter_dir)]
    assert doctor_command.main(argv + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    check_schema(report)
    assert report["draft_model"] == str(drafter_dir)
    assert report["status"] == "pass", statuses(report)
    model = report["parts"]["model"]
    drafter = model["facts"]["draft_model"]
    has_types(drafter, DRAFTER_FACTS, "model.draft_model")
    assert drafter["target_layer_ids"] == [0, 1] and drafter["block_size"] == 4
    assert drafter["path"] == str(drafter_dir) and drafter["quantize"] is None
    target, _ = mlx_spec.load(model_dir)
    loaded = mlx_spec.load_drafter(drafter_dir, target)
    assert drafter["identity"] == draft_model_fingerprint(loaded)
    assert "DFlash drafter of 2 layers, block 4" in model["reason"]
    lossless = report["parts"]["lossless"]["facts"]
    assert lossless["drafters"] == ["ngram", "mtp", "mtp+ngram", "dflash"]
    dflash = [r for r in lossless["runs"] if r["draft"] == "dflash"]
    assert dflash and {r["num_draft_tokens"] for r in dflash} == {3}  # 4 cut to 3
    assert all(r["first_differing_token"] is None for r in dflash)
    speed = [r for r in report["parts"]["speed"]["facts"]["runs"]]
    assert {r["draft"] for r in speed} == {"ngram", "mtp", "mtp+ngram", "dflash"}
    block = text[text.index("```markdown") :]
    assert f"- drafter: {drafter_dir} (DFlash, target layers [0, 1], block 4" in block
    assert "| dflash |" in block


def test_a_quantised_drafter_is_another_identity(checkpoint_dirs, drafter_dir):
    """``--draft-quantize 8``: the drafter is quantised in memory, said in
    its check, and its identity is not the stored drafter's."""
    model_dir = str(checkpoint_dirs["qwen3_5"])
    stored, eight = (
        run_doctor(
            model_dir, quick=True, draft_model=str(drafter_dir), draft_quantize=q
        )
        for q in (None, 8)
    )
    facts = [r["parts"]["model"]["facts"]["draft_model"] for r in (stored, eight)]
    assert facts[1]["quantize"] == 8 and facts[0]["identity"] != facts[1]["identity"]
    check = next(c for c in eight["parts"]["model"]["checks"] if c["name"] == "drafter")
    assert check["status"] == "pass" and "8-bit in memory" in check["reason"]
    assert eight["parts"]["lossless"]["status"] == "pass"


@pytest.mark.parametrize("broken", ["missing", "mask_token_id"])
def test_a_drafter_that_does_not_load_fails_alone_in_one_line(
    checkpoint_dirs, tmp_path, broken
):
    """A drafter path that does not exist, or one that does not fit the
    target: the model part fails naming it on one line, and the model is
    still checked and measured with its other drafters."""
    if broken == "missing":
        path, named = tmp_path / "no-drafter", str(tmp_path / "no-drafter")
    else:
        path = write_dflash_checkpoint(tmp_path / "d", "qwen3_5", mask_token_id=None)
        named = "mask_token_id"
    report = run_doctor(
        str(checkpoint_dirs["qwen3_5"]), quick=True, draft_model=str(path)
    )
    model = report["parts"]["model"]
    assert model["status"] == "fail" and model["reason"].startswith("drafter: ")
    assert named in model["reason"] and "\n" not in model["reason"]
    assert "identity" not in model["facts"]["draft_model"]
    assert report["parts"]["lossless"]["status"] == "pass"
    assert report["parts"]["lossless"]["facts"]["drafters"] == [
        "ngram",
        "mtp",
        "mtp+ngram",
    ]
    assert report["parts"]["speed"]["status"] == "pass"


def test_dflash_tokens_leaving_plain_decoding_fail_losslessness(
    checkpoint_dirs, drafter_dir, monkeypatch
):
    """The control: dflash's run made to differ from plain decoding at one
    token fails the lossless part, naming dflash; the other drafters pass."""
    real = lossless_part.run_spec

    def dflash_off(model, tok, prompt, max_tokens, draft, k):
        run = real(model, tok, prompt, max_tokens, draft, k)
        if draft == "dflash":
            run["tokens"][2] = (run["tokens"][2] + 1) % 400
        return run

    monkeypatch.setattr(lossless_part, "run_spec", dflash_off)
    report = run_doctor(
        str(checkpoint_dirs["qwen3_5"]), quick=True, draft_model=str(drafter_dir)
    )
    part = report["parts"]["lossless"]
    assert part["status"] == "fail" and "/ dflash / k=3" in part["reason"]
    failed = {
        c["name"].split(" / ")[1] for c in part["checks"] if c["status"] == "fail"
    }
    assert failed == {"dflash"}


def test_draft_quantize_without_a_drafter_is_one_line(capsys):
    assert doctor_command.main(["--draft-quantize", "4"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "mlx_spec doctor: --draft-quantize needs --draft-model"
