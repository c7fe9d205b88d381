"""A careless model directory or flag is one line naming the file, key or
flag, before anything is loaded."""

import io
import json
import shutil

import pytest

from mlx_spec.commands.cli import main


def _run(argv, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    status = main(argv)
    return status, capsys.readouterr().err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("value", ["abc", -4, 2.5, True])
def test_a_size_that_is_not_an_integer_names_the_file_and_key(
    checkpoint_dirs, family, value, tmp_path, monkeypatch, capsys
):
    model = shutil.copytree(checkpoint_dirs[family], tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    section = config.get("text_config", config)  # where the family keeps it
    section["hidden_size"] = value
    (model / "config.json").write_text(json.dumps(config))
    status, err = _run(
        ["generate", "--model", str(model), "--prompt", "hi"], monkeypatch, capsys
    )
    line = _one_line(err)
    key = "text_config.hidden_size" if "text_config" in config else "hidden_size"
    assert status == 2
    assert str(model / "config.json") in line and f"{key}={value!r}" in line


def test_a_directory_without_tokenizer_files_is_named(
    checkpoint_dirs, tmp_path, monkeypatch, capsys
):
    model = shutil.copytree(checkpoint_dirs["qwen3_5"], tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    status, err = _run(
        ["generate", "--model", str(model), "--prompt", "hi"], monkeypatch, capsys
    )
    assert status == 2 and "has no tokenizer files" in _one_line(err)
    assert str(model) in err


def test_convert_refuses_an_unknown_dtype_by_name(checkpoint_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(
            [
                "convert",
                "--hf-path",
                str(checkpoint_dirs["qwen3_5"]),
                "--mlx-path",
                str(tmp_path / "out"),
                "--dtype",
                "foo",
            ]
        )
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "'foo'" in err
    assert not (tmp_path / "out").exists()


def test_a_missing_local_directory_is_not_sent_to_the_hub(
    tmp_path, monkeypatch, capsys
):
    """A path that does not exist and is no ``namespace/name`` stays a path."""
    for name in (str(tmp_path / "missing"), "missing", "./a/b"):
        status, err = _run(
            ["generate", "--model", name, "--prompt", "hi"], monkeypatch, capsys
        )
        assert status == 2 and "does not exist" in _one_line(err), name
