"""``mlx_spec doctor``: the report's schema, each failure path reported as
one line while the other parts still run, ``--quick`` on the demo model and
on tiny checkpoints of every family, and negative controls (a broken kernel
reference, a corrupted head, tokens that leave plain decoding's) reported as
failing. The speed part's judgement: test_doctor_speed.py; a DFlash drafter:
test_doctor_drafter.py."""

import json
import shutil

import mlx.core as mx
import pytest
from safetensors.numpy import load_file, save_file

from mlx_spec.commands import doctor as doctor_command
from mlx_spec.commands.cli import main as cli_main
from mlx_spec.doctor import PARTS, run_doctor
from mlx_spec.doctor import lossless as lossless_part
from mlx_spec.doctor import runner
from mlx_spec.doctor.platform import blas_in_use
from mlx_spec.kernels import attention as attn
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.doctor_reports import check_schema, cut_quick_prompts, statuses

REAL_QUICK = {"test_quick_on_the_demo_model"}


@pytest.fixture(autouse=True)
def short_prompts(request, monkeypatch):
    """The quick prompts cut to 8 new tokens, except in :data:`REAL_QUICK`
    (``--quick`` exactly as users run it): the other tests need every part
    to run on their model, not to measure well."""
    if request.node.originalname not in REAL_QUICK:
        cut_quick_prompts(monkeypatch)


def test_quick_on_the_demo_model(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert doctor_command.main(["--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    check_schema(report)
    assert report["quick"] and report["model"] is None
    expect_kernels = "pass" if mx.metal.is_available() else "skip"
    assert statuses(report) == {
        "platform": "pass",
        "model": "pass",
        "kernels": expect_kernels,
        "lossless": "pass",
        "speed": "pass",
        "report": "pass",
    }
    runs = report["parts"]["lossless"]["facts"]["runs"]
    assert {r["draft"] for r in runs} == {"ngram", "mtp", "mtp+ngram"}
    # the demo model's trained head predicts its target: far above chance
    head = report["parts"]["model"]["facts"]["mtp_head"]
    assert head["teacher_forced_agreement"] > 0.3
    if not mx.metal.is_available():
        assert "skipped: no Metal" in report["parts"]["kernels"]["reason"]
        assert "gated_delta_steps_reference" in report["parts"]["kernels"]["reason"]
    # every part on the terminal, then the Markdown block last
    for name in PARTS:
        assert f"] {name}: " in text
    assert text.rstrip().endswith("```")
    block = text[text.index("```markdown") :]
    assert "| lossless | pass |" in block and "recommended: --draft" in block


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_quick_on_tiny_checkpoints(checkpoint_dirs, family):
    report = run_doctor(str(checkpoint_dirs[family]), quick=True)
    check_schema(report)
    got = statuses(report)
    assert got["platform"] == got["model"] == got["lossless"] == "pass", got
    assert got["speed"] == "pass" and got["report"] == "skip"
    assert got["kernels"] == ("pass" if mx.metal.is_available() else "skip")
    kinds = {c["kernel"] for c in report["parts"]["kernels"]["facts"]["cases"]}
    moe = family != "qwen3_5"
    assert kinds == {"gdn", "attention", "mtp_attention"} | ({"moe"} if moe else set())
    assert report["parts"]["model"]["facts"]["model_type"] == family


def test_missing_model_is_one_line_and_the_rest_still_runs(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    missing = tmp_path / "no-such-model"
    # through the command line's entry point: the command is registered
    assert cli_main(["doctor", "--model", str(missing), "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    model = report["parts"]["model"]
    assert model["status"] == "fail" and str(missing) in model["reason"]
    assert statuses(report) == {
        "platform": "pass",
        "model": "fail",
        "kernels": "skip",
        "lossless": "skip",
        "speed": "skip",
        "report": "pass",
    }
    assert "no model loaded" in report["parts"]["speed"]["reason"]
    assert f"[FAIL] model: load: model directory '{missing}' does not exist" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("damage", ["broken_config", "truncated_weights"])
def test_broken_model_files_are_named_in_one_line(checkpoint_dirs, tmp_path, damage):
    path = shutil.copytree(checkpoint_dirs["qwen3_next"], tmp_path / damage)
    if damage == "broken_config":
        named = path / "config.json"
        named.write_text('{"model_type": ')
    else:
        named = path / "model.safetensors"
        named.write_bytes(named.read_bytes()[:1000])
    report = run_doctor(str(path), quick=True)
    model = report["parts"]["model"]
    assert model["status"] == "fail" and str(named) in model["reason"]
    assert "\n" not in model["reason"]
    assert report["parts"]["platform"]["status"] == "pass"
    assert report["parts"]["speed"]["status"] == "skip"


def test_unwritable_json_path_is_reported_and_the_parts_still_run(
    checkpoint_dirs, tmp_path, capsys
):
    bad = tmp_path / "missing-dir" / "doctor.json"
    argv = ["--quick", "--model", str(checkpoint_dirs["qwen3_5"]), "--json", str(bad)]
    assert doctor_command.main(argv) == 1
    text = capsys.readouterr().out
    assert f"[FAIL] report: --json '{bad}' cannot be written" in text
    assert "[PASS] lossless:" in text and "[PASS] speed:" in text
    assert "| report | fail |" in text
    assert not bad.exists()


def test_model_without_a_head_drafts_ngram_only(
    checkpoint_dirs, tmp_path, save_mlx_dir
):
    mlx_dir = save_mlx_dir(checkpoint_dirs["qwen3_5"], tmp_path / "mlx")
    report = run_doctor(str(mlx_dir), quick=True)
    model = report["parts"]["model"]
    assert model["status"] == "pass"  # a model without a head is no failure
    head = next(c for c in model["checks"] if c["name"] == "mtp head")
    assert head["status"] == "skip" and "n-gram drafting only" in head["reason"]
    assert "mlx_spec convert --mtp-from" in head["reason"]  # what to run
    assert report["parts"]["lossless"]["facts"]["drafters"] == ["ngram"]
    assert report["parts"]["speed"]["status"] == "pass"


def test_head_of_another_model_fails_the_model_part(
    converted_dirs, tmp_path, save_mlx_dir
):
    _, donor = converted_dirs["qwen3_next"]
    raw = write_tiny_checkpoint(tmp_path / "raw", "qwen3_5_moe")
    mlx_dir = save_mlx_dir(raw, tmp_path / "mlx")
    shutil.copy(donor / "mtp.safetensors", mlx_dir / "mtp.safetensors")
    report = run_doctor(str(mlx_dir), quick=True)
    model = report["parts"]["model"]
    assert model["status"] == "fail"
    assert "belongs to another model" in model["reason"]
    assert str(mlx_dir / "mtp.safetensors") in model["reason"]
    # the model itself loaded: n-gram drafting is still checked and measured
    assert report["parts"]["lossless"]["status"] == "pass"
    assert report["parts"]["lossless"]["facts"]["drafters"] == ["ngram"]
    assert report["status"] == "fail"


def test_own_sidecar_passes_the_signature_check(converted_dirs):
    _, mlx_dir = converted_dirs["qwen3_5"]
    report = run_doctor(str(mlx_dir), quick=True)
    checks = {c["name"]: c for c in report["parts"]["model"]["checks"]}
    assert checks["weight signature"]["status"] == "pass"
    cosines = report["parts"]["model"]["facts"]["mtp_head"]["signature_cosines"]
    assert min(cosines) > 0.99


def test_corrupted_head_is_reported_failing(tmp_path):
    """Weights that load (right names and shapes) but hold NaN."""
    path = write_tiny_checkpoint(tmp_path / "nan", "qwen3_next")
    weights = load_file(str(path / "model.safetensors"))
    weights["mtp.fc.weight"][0, :] = float("nan")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    report = run_doctor(str(path), quick=True)
    checks = {c["name"]: c for c in report["parts"]["model"]["checks"]}
    assert checks["head forward"]["status"] == "fail"
    assert "NaN" in checks["head forward"]["reason"]
    assert report["parts"]["model"]["status"] == "fail"


def test_broken_kernel_reference_is_reported_failing(checkpoint_dirs, monkeypatch):
    def off_by_a_little(queries, keys, values, scale, mask=None):
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale * 1.05, mask=mask
        )

    monkeypatch.setattr(attn, "attention_reference", off_by_a_little)
    report = run_doctor(str(checkpoint_dirs["qwen3_next"]), quick=True)
    kernels = report["parts"]["kernels"]
    assert kernels["status"] == "fail"
    assert kernels["reason"].startswith("attention reference")
    failed = {c["name"].split()[0] for c in kernels["checks"] if c["status"] == "fail"}
    assert failed == {"attention"}  # the other references still pass


def test_tokens_leaving_plain_decoding_fail_losslessness(checkpoint_dirs, monkeypatch):
    real = lossless_part.run_spec

    def one_token_off(*args, **kwargs):
        run = real(*args, **kwargs)
        run["tokens"][3] = (run["tokens"][3] + 1) % 400
        return run

    monkeypatch.setattr(lossless_part, "run_spec", one_token_off)
    report = run_doctor(str(checkpoint_dirs["qwen3_5"]), quick=True)
    part = report["parts"]["lossless"]
    assert part["status"] == "fail"
    assert "differs from plain from token 3" in part["reason"]
    assert {r["first_differing_token"] for r in part["facts"]["runs"]} == {3}


def test_a_part_that_raises_fails_alone(checkpoint_dirs, monkeypatch):
    def broken(part, model, quick):
        raise RuntimeError("boom")

    monkeypatch.setattr(runner, "check_kernels", broken)
    report = run_doctor(str(checkpoint_dirs["qwen3_5"]), quick=True)
    assert report["parts"]["kernels"]["status"] == "fail"
    assert "RuntimeError: boom" in report["parts"]["kernels"]["reason"]
    assert report["parts"]["lossless"]["status"] == "pass"
    assert report["parts"]["speed"]["status"] == "pass"


def test_blas_in_use_reads_the_mapped_libraries():
    mlx_blas = "/venv/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
    numpy_blas = "/venv/site-packages/numpy.libs/libscipy_openblas64_-32a4.so"
    openblas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
    if blas_in_use([], "")["name"] == "Accelerate":
        pytest.skip("macOS: MLX uses Accelerate")
    found = blas_in_use([numpy_blas, mlx_blas], "")
    assert found["name"] == "reference BLAS" and found["library"] == mlx_blas
    assert "LD_PRELOAD" in found["advice"]  # advice to preload OpenBLAS
    found = blas_in_use([numpy_blas, mlx_blas, openblas], openblas)
    assert found == {"name": "OpenBLAS", "library": openblas, "advice": ""}
    assert blas_in_use([numpy_blas], "")["name"] == "unknown"  # numpy's is not MLX's


def test_kernel_branch_judges_each_kernel(tmp_path, monkeypatch):
    """The Metal half of the kernels part, run on a CPU with stand-in
    kernels: one equal to its reference (passes, bitwise, timed), one off by
    5% (fails: the negative control), one that raises (fails alone), and one
    that does not apply to the shapes (skipped)."""
    from mlx_spec.doctor import kernels as part_module
    from mlx_spec.doctor.model import load_for_doctor
    from mlx_spec.doctor.result import Part
    from mlx_spec.kernels import gated_delta as gdn
    from mlx_spec.kernels import moe

    def equal(q, k, v, scale):
        mask = "causal" if q.shape[2] > 1 else None
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def raises(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(part_module, "metal_available", lambda: True)
    monkeypatch.setattr(attn, "attention_kernel", equal)
    monkeypatch.setattr(gdn, "gated_delta_steps_kernel", raises)
    monkeypatch.setattr(moe, "kernel_plan", lambda *a: None)
    # head_dim 64: a size the attention kernel takes
    path = write_tiny_checkpoint(tmp_path / "d64", "qwen3_next", head_dim=64)
    _, model, _ = load_for_doctor(str(path))
    part, helps = part_module.check_kernels(Part("kernels"), model, quick=True)
    by_name = {c["kernel"]: c for c in part.facts["cases"]}
    assert by_name["attention"]["bitwise"] and by_name["mtp_attention"]["bitwise"]
    assert by_name["attention"]["auto_choice"] in ("kernel", "reference")
    assert by_name["moe"]["kernel_applies"] is False
    verdicts = {
        c.name.split(" ")[0] + " " + c.name.split(" ")[1]: c.status for c in part.checks
    }
    assert verdicts["attention kernel"] == "pass"
    assert verdicts["moe kernel"] == "skip"
    assert "no such kernel" in part.reason and part.status == "fail"

    def off(q, k, v, scale):
        return 1.05 * equal(q, k, v, scale)

    monkeypatch.setattr(attn, "attention_kernel", off)
    monkeypatch.setattr(gdn, "gated_delta_steps_kernel", raises)
    part, _ = part_module.check_kernels(Part("kernels"), model, quick=True)
    failed = {c.name.split(" ")[0] for c in part.checks if c.status == "fail"}
    assert {"attention", "mtp_attention", "gdn"} <= failed


def test_attention_only_model_skips_the_kernels(tmp_path):
    """A llama: no GDN layer, no MTP head, nothing the kernels serve."""
    from mlx_spec.testing.attention_only import write_llama_checkpoint

    report = run_doctor(str(write_llama_checkpoint(tmp_path / "llama")), quick=True)
    got = statuses(report)
    assert got["model"] == got["lossless"] == got["speed"] == "pass", got
    assert got["kernels"] == "skip"
    assert "no layer of this model (llama)" in report["parts"]["kernels"]["reason"]
    assert report["parts"]["lossless"]["facts"]["drafters"] == ["ngram"]


def test_truncated_sidecar_is_reported_failing(converted_dirs, tmp_path):
    """A sidecar cut short: the head is refused at load, and the report
    says so (the model itself still drafts by n-gram)."""
    _, mlx_dir = converted_dirs["qwen3_next"]
    path = shutil.copytree(mlx_dir, tmp_path / "cut")
    sidecar = path / "mtp.safetensors"
    sidecar.write_bytes(sidecar.read_bytes()[:2000])
    report = run_doctor(str(path), quick=True)
    model = report["parts"]["model"]
    assert model["status"] == "fail" and str(sidecar) in model["reason"]
    assert report["parts"]["lossless"]["facts"]["drafters"] == ["ngram"]


def test_a_failing_head_check_leaves_the_model_to_the_other_parts(
    checkpoint_dirs, monkeypatch
):
    from mlx_spec.doctor import model as model_part

    def broken(*args):
        raise ValueError("cannot\nrun")

    monkeypatch.setattr(model_part, "head_agreement", broken)
    report = run_doctor(str(checkpoint_dirs["qwen3_5"]), quick=True)
    model = report["parts"]["model"]
    assert model["status"] == "fail"
    assert (
        model["reason"]
        == "head checks: the check itself failed: ValueError: cannot run"
    )
    assert report["parts"]["lossless"]["status"] == "pass"
    assert report["parts"]["lossless"]["facts"]["drafters"][-1] == "mtp+ngram"
