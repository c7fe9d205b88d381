"""The benchmark scripts' shared helpers (scripts/bench_helpers.py)."""

import importlib.util
import threading
from pathlib import Path

import pytest


def _load_helpers():
    """scripts/ is no package: load its helpers module from its file."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_helpers.py"
    spec = importlib.util.spec_from_file_location("bench_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


helpers = _load_helpers()


def test_rounds_reverse_the_order_each_time():
    """Every setting once a round, the order reversed each round, so that a
    busy spell falls on all settings alike."""
    got = list(helpers.interleaved(["a", "b", "c"], 3))
    assert got == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")] + [
        (2, "a"),
        (2, "b"),
        (2, "c"),
    ]
    assert list(helpers.interleaved(["a"], 0)) == []


def test_the_median_run_is_a_whole_run():
    runs = [{"tps": 3.0, "n": 1}, {"tps": 1.0, "n": 2}, {"tps": 2.0, "n": 3}]
    assert helpers.median_run(runs, "tps") == {"tps": 2.0, "n": 3}
    assert helpers.median_run(runs[:2], "tps")["tps"] == 3.0  # even: the upper one


def test_every_client_sends_every_prompt_from_its_own_offset():
    sent, lock = [], threading.Lock()

    def request(prompt):
        # by thread name: an ident is reused once its thread has ended
        with lock:
            sent.append((threading.current_thread().name, prompt))
        return prompt.upper()

    results, wall = helpers.concurrent_clients(request, ["a", "b", "c"], 2)
    assert sorted(results) == ["A", "A", "B", "B", "C", "C"] and wall >= 0
    by_client = {}
    for name, prompt in sent:
        by_client.setdefault(name, []).append(prompt)
    assert sorted(by_client.values()) == [["a", "b", "c"], ["b", "c", "a"]]


def test_a_failed_request_is_raised_once_every_client_is_done():
    done = []

    def request(prompt):
        if prompt == "bad":
            raise ValueError("bad prompt")
        done.append(prompt)
        return prompt

    with pytest.raises(
        RuntimeError, match=r"1 requests failed: ValueError\('bad prompt'\)"
    ):
        helpers.concurrent_clients(request, ["ok", "bad"], 1)
    assert done == ["ok"]
