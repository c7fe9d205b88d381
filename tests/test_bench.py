"""``mlx_spec bench``: runs, prints a table and writes the documented JSON."""

import json

import pytest

import mlx_spec.commands.bench as bench

ROW_KEYS = {
    "workload": str,
    "kind": str,
    "draft": str,
    "plain_tps": float,
    "tps": float,
    "speedup": float,
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
}


def test_bench_json_schema(checkpoint_dirs, tmp_path, capsys):
    workloads = tmp_path / "w.jsonl"
    workloads.write_text(
        json.dumps(
            {"name": "rep", "kind": "copy", "prompt": "a = 1\n" * 6, "max_tokens": 10}
        )
        + "\n"
    )
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
            str(workloads),
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
        assert row["host_cpu_ms_per_pass"] > 0 and row["plain_host_cpu_ms_per_step"] > 0


def test_bundled_workloads_cover_every_kind(models):
    _, tok = models["qwen3_next"]
    rows = bench.load_workloads(tokenizer=tok)
    assert {r["kind"] for r in rows} == set(bench.KINDS)
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


def test_rounds_reverse_the_order_each_time():
    """Every setting once a round, the order reversed each round, so that a
    busy spell falls on all settings alike."""
    got = list(bench.interleaved(["a", "b", "c"], 3))
    assert got == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")] + [
        (2, "a"),
        (2, "b"),
        (2, "c"),
    ]
    assert list(bench.interleaved(["a"], 0)) == []


def test_the_median_run_is_a_whole_run():
    runs = [{"tps": 3.0, "n": 1}, {"tps": 1.0, "n": 2}, {"tps": 2.0, "n": 3}]
    assert bench.median_run(runs, "tps") == {"tps": 2.0, "n": 3}
    assert bench.median_run(runs[:2], "tps")["tps"] == 3.0  # even: the upper one
