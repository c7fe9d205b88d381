"""Bad input to the commands: one line naming the file or value, exit status 2."""

import io
import shutil

import mlx.core as mx
import pytest

from mlx_spec.commands.cli import main
from mlx_spec.commands.convert import convert

CASES = (
    "another_models_sidecar",
    "sidecar_with_wrong_shapes",
    "model_weights_as_sidecar",
    "text_file_as_sidecar",
    "broken_config",
    "truncated_weights",
    "negative_temp",
    "negative_repetition_penalty",
    "infinite_presence_penalty",
    "empty_penalty_context",
    "missing_model",
)


def _sidecar(raw_dir, work_dir):
    """The sidecar ``mlx_spec convert`` writes for the checkpoint in ``raw_dir``."""
    shutil.copytree(raw_dir, work_dir)
    return convert(work_dir, work_dir, progress=False)


@pytest.fixture(scope="module")
def bad_input(checkpoint_dirs, tmp_path_factory):
    """case -> (flags, what the error line must name)."""
    root = tmp_path_factory.mktemp("bad")
    good = checkpoint_dirs["qwen3_next"]
    other = _sidecar(checkpoint_dirs["qwen3_5"], root / "other")
    weights, meta = mx.load(str(_sidecar(good, root / "own")), return_metadata=True)
    weights["mtp.fc.weight"] = weights["mtp.fc.weight"][:, :-1]
    wrong_shapes = root / "wrong_shapes.safetensors"
    mx.save_safetensors(str(wrong_shapes), weights, metadata=meta)
    text = root / "notes.txt"
    text.write_text("not weights\n")
    broken = shutil.copytree(good, root / "broken_config")
    (broken / "config.json").write_text('{"model_type": ')
    truncated = shutil.copytree(good, root / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    model = ["--model", str(good)]
    mtp_weights = checkpoint_dirs["qwen3_5"] / "model.safetensors"
    return {
        "another_models_sidecar": (model + ["--mtp-path", str(other)], str(other)),
        "sidecar_with_wrong_shapes": (
            model + ["--mtp-path", str(wrong_shapes)],
            str(wrong_shapes),
        ),
        "model_weights_as_sidecar": (
            model + ["--mtp-path", str(mtp_weights)],
            str(mtp_weights),
        ),
        "text_file_as_sidecar": (model + ["--mtp-path", str(text)], str(text)),
        "broken_config": (["--model", str(broken)], str(broken / "config.json")),
        "truncated_weights": (
            ["--model", str(truncated)],
            str(truncated / "model.safetensors"),
        ),
        "negative_temp": (model + ["--temp", "-1"], "--temp must be >= 0, got -1.0"),
        "negative_repetition_penalty": (
            model + ["--repetition-penalty", "-0.5"],
            "--repetition-penalty must be a number >= 0, got -0.5",
        ),
        "infinite_presence_penalty": (
            model + ["--presence-penalty", "inf"],
            "--presence-penalty must be a number, got inf",
        ),
        "empty_penalty_context": (
            model + ["--frequency-penalty", "1", "--frequency-context-size", "0"],
            "--frequency-context-size must be >= 1, got 0",
        ),
        "missing_model": (["--model", str(root / "missing")], str(root / "missing")),
    }


def run(argv, monkeypatch, capsys):
    """``mlx_spec ARGV`` in this process (stdin empty): (status, stdout, stderr)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_naming(err, command, named):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"mlx_spec {command}: ") and named in lines[0], err


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_model_input_is_one_line_and_status_2(
    command, case, bad_input, monkeypatch, capsys
):
    flags, named = bad_input[case]
    status, _, err = run([command, *flags, "--max-tokens", "4"], monkeypatch, capsys)
    assert status == 2
    assert_one_line_naming(err, command, named)


@pytest.mark.parametrize("case", ["broken_config", "truncated_weights"])
def test_bench_loads_through_the_same_checks(case, bad_input, monkeypatch, capsys):
    flags, named = bad_input[case]
    status, _, err = run(["bench", *flags], monkeypatch, capsys)
    assert status == 2
    assert_one_line_naming(err, "bench", named)


@pytest.mark.parametrize("case", ["broken_config", "truncated_weights"])
def test_convert_names_the_broken_file(case, bad_input, tmp_path, capsys):
    flags, named = bad_input[case]
    status = main(["convert", "--hf-path", flags[1], "--mlx-path", str(tmp_path / "o")])
    assert status == 2
    assert_one_line_naming(capsys.readouterr().err, "convert", named)
