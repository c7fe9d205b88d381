"""A drafter a user writes, through the public contract only: the core
protocol (``reset``, ``propose``, ``accept``) and ``drafters.register``. It
decodes losslessly alone, in a batch and through the server, on every
family, and nothing in ``core/`` knows its name."""

import mlx_lm
import pytest

import mlx_spec
from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.drafters import make_drafter, register, unregister
from mlx_spec.drafters.contract import Proposal, host_proposal
from mlx_spec.server.engine import Engine
from mlx_spec.server.http import make_app
from mlx_spec.testing.http_client import post_json
from mlx_spec.testing.reference import (
    fed_decoder,
    prompts,
    reference_tokens,
    run_batch,
    spec_tokens,
)
from mlx_spec.testing.server import serving, request_context

NAME = "last-tokens-again"


class LastTokensAgain:
    """Proposes the last ``k`` tokens of its history again (right wherever
    the text repeats with that period, as the repetitive prompts do)."""

    name = NAME
    needs_hidden = False

    def __init__(self):
        self.history = []

    def reset(self, prompt, hidden):
        self.history = list(prompt)

    def propose(self, k: int) -> Proposal:
        return host_proposal(self.history[-k:])

    def accept(self, tokens, hidden):
        self.history += list(tokens)


@pytest.fixture
def registered():
    register(NAME, lambda model, options: LastTokensAgain())
    yield NAME
    unregister(NAME)


def test_it_is_made_by_name_and_refused_once_gone(registered, models):
    model, _ = models["qwen3_5"]
    assert isinstance(make_drafter(NAME, model), LastTokensAgain)
    with pytest.raises(ValueError, match="registered already"):
        register(NAME, lambda model, options: LastTokensAgain())
    unregister(NAME)
    with pytest.raises(ValueError, match=f"unknown draft '{NAME}'"):
        make_drafter(NAME, model)
    register(NAME, lambda model, options: LastTokensAgain())  # for the fixture


@pytest.mark.parametrize("k", [3, "auto"])
def test_alone_it_decodes_exactly(registered, models, family, k):
    model, tok = models[family]
    prompt = prompts("repetitive")
    stats = mlx_spec.SpecStats()
    got = spec_tokens(
        model, tok, prompt, 40, draft=NAME, num_draft_tokens=k, stats=stats
    )
    assert got == reference_tokens(model, tok, prompt, 40)
    if k == 3:
        assert stats.drafted > 0


def test_in_a_batch_each_row_decodes_exactly(registered, models, family):
    """Three rows of it beside a row of the n-gram drafter and a plain one."""
    model, tok = models[family]
    batch = BatchDecoder(model, n_slots=5, max_draft=4)
    rows, want = {}, {}
    specs = [(NAME, 3), (NAME, "auto"), (NAME, 2), ("ngram", 3), ("none", 0)]
    for seed, (draft, k) in enumerate(specs):
        prompt = prompts("repetitive" if seed % 2 else "mixed", seed=seed)
        drafter = make_drafter(draft, model)
        b = batch.add(fed_decoder(model, prompt, drafter, 4), RowOptions(24, None, k))
        rows[b], want[b] = [], reference_tokens(model, tok, prompt, 24)
    run_batch(batch, rows)
    assert rows == want
    assert sum(r.decoder.stats.drafted for r in batch.rows) > 0


def test_through_the_server_it_answers_exactly(registered, checkpoint_dirs, family):
    """A request naming it (``"draft"``), beside requests of the built-in
    drafters: each answer is mlx-lm's, and the response says it drafted."""
    path = checkpoint_dirs[family]
    model, tok = mlx_spec.load(path)
    plain, plain_tok = mlx_lm.load(str(path))
    engine = Engine(model, tok, "ngram", num_draft_tokens=3)
    app = make_app(engine, request_context(tok, "tiny", max_tokens=24))
    prompt = "ab ab ab ab ab ab ab ab ab ab ab ab"
    want = mlx_lm.generate(plain, plain_tok, prompt, max_tokens=24)
    try:
        with serving(app) as port:
            for draft in (NAME, "ngram", "none"):
                body = {"prompt": prompt, "max_tokens": 24, "draft": draft}
                status, r = post_json(port, "/v1/completions", body)
                assert status == 200, r
                assert r["choices"][0]["text"] == want
                assert r["speculation"]["draft"] == draft
                if draft == NAME:
                    assert r["speculation"]["drafted"] > 0
    finally:
        engine.close()
