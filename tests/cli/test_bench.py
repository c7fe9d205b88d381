"""``mlx_spec bench``: runs, prints a table and writes the documented JSON."""

import json

import mlx.core as mx
import pytest

import mlx_spec.commands.bench as bench
import mlx_spec.timed_runs as timed_runs

ROW_KEYS = {
    "workload": str,
    "kind": str,
    "draft": str,
    "plain_tps": float,
    "tps": float,
    "speedup": float,
    "plain_prompt_tps": float,
    "prompt_tps": float,
    "acceptance_per_position": list,
    "tokens_per_pass": float,
    "phase_ms_per_pass": dict,
    "host_overhead_ms_per_pass": float,
    "host_overhead_fraction_of_1_token_forward": float,
    "host_work_ms_per_pass": float,
    "host_work_fraction_of_1_token_forward": float,
    "host_cpu_ms_per_pass": float,
    "plain_host_cpu_ms_per_step": float,
    "host_cpu_overhead_fraction_of_1_token_forward": float,
    "ideal_speedup": float,
    "achieved_over_ideal": float,
    "peak_memory_gb": float,
    "first_token_differing_from_plain": type(None),  # lossless: none differs
}


def _one_workload(tmp_path) -> str:
    workloads = tmp_path / "w.jsonl"
    row = {"name": "rep", "kind": "copy", "prompt": "a = 1\n" * 6, "max_tokens": 10}
    workloads.write_text(json.dumps(row) + "\n")
    return str(workloads)


def test_bench_json_schema(checkpoint_dirs, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(
        [
            "--model",
            str(checkpoint_dirs["qwen3_next"]),
            "--draft",
            "ngram",
            "--num-draft-tokens",
            "2",
            "auto",
            "--workloads-file",
            _one_workload(tmp_path),
            "--repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "speedup" in table and "rep" in table
    data = json.loads(out.read_text())
    for key in ("platform", "mlx", "device", "blas", "python"):
        assert key in data["machine"]
    assert len(data["verify_cost_profile_s"]) == 9
    assert [r["num_draft_tokens"] for r in data["results"]] == [2, "auto"]
    for row in data["results"]:
        for key, typ in ROW_KEYS.items():
            assert isinstance(row[key], typ), key
        assert set(row["phase_ms_per_pass"]) >= {
            "draft",
            "verify",
            "sampling",
            "commit",
        }
        assert row["tps"] > 0 and row["plain_tps"] > 0
        assert row["prompt_tps"] > 0 and row["plain_prompt_tps"] > 0
        assert row["host_cpu_ms_per_pass"] > 0 and row["plain_host_cpu_ms_per_step"] > 0


def test_bench_fails_when_speculation_changes_a_token(
    checkpoint_dirs, tmp_path, capsys, monkeypatch
):
    """The negative control of the lossless column: a speculative stream
    whose third token is changed is reported, and the command fails."""
    real = timed_runs.stream_generate

    def one_token_off(*args, **kwargs):
        for i, r in enumerate(real(*args, **kwargs)):
            if i == 2:
                r.token = r.token + 1
            yield r

    monkeypatch.setattr(timed_runs, "stream_generate", one_token_off)
    model = str(checkpoint_dirs["qwen3_next"])
    argv = ["--model", model, "--draft", "ngram", "--num-draft-tokens", "2"]
    argv += ["--workloads-file", _one_workload(tmp_path), "--repeats", "1"]
    rc = bench.main(argv)
    out, err = capsys.readouterr()
    assert rc == 1
    assert "DIFF@2" in out
    assert "rep / ngram / 2" in err and "from token 2" in err


def test_first_difference():
    plain = [{"tokens": [1, 2, 3]}] * 2
    assert timed_runs.first_difference(plain, [{"tokens": [1, 2, 3]}]) is None
    assert timed_runs.first_difference(plain, [{"tokens": [1, 5, 3]}]) == 1
    assert (
        timed_runs.first_difference(plain, [{"tokens": [1, 2]}]) == 2
    )  # stopped early
    unsteady = [{"tokens": [1, 2, 3]}, {"tokens": [1, 2, 4]}]
    assert timed_runs.first_difference(unsteady, [{"tokens": [1, 2, 3]}]) == -1


def test_bundled_workloads_cover_every_kind(models):
    _, tok = models["qwen3_next"]
    rows = timed_runs.load_workloads(tokenizer=tok)
    assert {r["kind"] for r in rows} == set(timed_runs.KINDS)
    long = [r for r in rows if r["kind"] == "long"]
    assert all(len(tok.encode(r["prompt"])) >= 2048 for r in long)


def test_bad_repeats(capsys):
    assert bench.main(["--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"kind": "copy", "prompt": "x"}\n{not json\n', "line 2"),
        ('{"prompt": "x"}\n', "line 1: needs a 'kind'"),
        ('["a list"]\n', "line 1"),
        (None, "cannot read workloads file"),
    ],
)
def test_bad_workloads_file_is_one_line(
    checkpoint_dirs, tmp_path, capsys, content, message
):
    path = tmp_path / "w.jsonl"
    if content is not None:
        path.write_text(content)
    model = str(checkpoint_dirs["qwen3_5"])
    assert bench.main(["--model", model, "--workloads-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and str(path) in err and len(err.splitlines()) == 1


@pytest.mark.skipif(
    not timed_runs.blas_in_use().startswith("reference BLAS"),
    reason="a preloaded BLAS may round a row differently with the row count",
)
def test_reference_blas_rows_do_not_depend_on_the_row_count():
    """What the bit-for-bit lossless tests rest on: with the wheel's BLAS a
    verify pass's matmul over T rows gives each row plain decoding's bits."""
    mx.random.seed(0)
    w = mx.random.normal((1280, 256))
    x = mx.random.normal((64, 256))
    one_at_a_time = mx.concatenate([x[i : i + 1] @ w.T for i in range(64)])
    for rows in (2, 4, 9, 64):
        assert mx.array_equal(x[:rows] @ w.T, one_at_a_time[:rows])
