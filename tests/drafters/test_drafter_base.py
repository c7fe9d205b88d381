"""The drafter contract: named drafters implement it, foreign objects are adapted."""

import pytest

from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters import calls, contract
from mlx_spec.drafters.base import HostDrafter, OneDraftWalk, as_drafter
from mlx_spec.testing.reference import (
    OracleDrafter,
    prompts,
    reference_tokens,
    spec_tokens,
    walked,
)


@pytest.mark.parametrize("name", ["ngram", "mtp", "mtp+ngram"])
def test_named_drafters_are_drafters(models, name):
    """Each implements the core contract, and the optional ones it has the
    parts of (the MTP head's deferred rows and arrays: not ngram's)."""
    drafter = make_drafter(name, models["qwen3_next"][0])
    assert as_drafter(drafter) is drafter and callable(drafter.propose)
    assert drafter.needs_hidden == (name != "ngram")
    assert isinstance(drafter, contract.SelfJudging)
    head = name != "ngram"
    for optional in (contract.DefersWork, contract.KeepsArrays, contract.HeadBased):
        assert isinstance(drafter, optional) == head
    assert isinstance(drafter, contract.SamplesDrafts) == head


def test_foreign_object_gets_the_defaults(models):
    """An object with only reset/draft/accept drives the loop unchanged."""
    model, tok = models["qwen3_5"]
    prompt = prompts("mixed")
    ref = reference_tokens(model, tok, prompt, 24)
    oracle = OracleDrafter(prompt + ref, error=0.3)
    decoder = SpeculativeDecoder(model, oracle)
    assert isinstance(decoder.drafter, HostDrafter) and decoder.drafter.inner is oracle
    assert decoder.drafter.name == "OracleDrafter" and not decoder.drafter.needs_hidden
    out = spec_tokens(model, tok, prompt, 24, draft=oracle, num_draft_tokens=4)
    assert out == ref


def test_not_a_drafter_is_refused_with_its_name():
    class Half:
        def draft(self, k):
            return []

    with pytest.raises(ValueError, match="Half.*reset, draft and accept"):
        as_drafter(Half())


def test_subclass_must_implement_the_required_methods():
    """A host drafter implements the core contract and nothing optional: the
    engine's defaults stand in (no deferred work, nothing to save but its
    history, from which it is rebuilt)."""

    class Lazy(HostDrafter):
        pass

    with pytest.raises(NotImplementedError):
        Lazy().propose(2)
    lazy = Lazy()
    assert calls.saved_arrays(lazy) == [] and calls.take_deferred(lazy) == []
    assert calls.judged(lazy) == {} and calls.can_draft(lazy)
    with pytest.raises(NotImplementedError):  # rebuilt by reset: not implemented
        calls.restore(lazy, [1, 2], [])
    with pytest.raises(ValueError, match="'custom' keeps no arrays"):
        calls.check_state(lazy, [object()], [])


@pytest.mark.parametrize(
    "hits, starts, judged",
    [
        ([1, 1, 1, 1, 1], None, (3, 3)),  # each hit's pass emits the next token
        ([1, 0, 1, 0, 1, 0], None, (3, 3)),  # the passes land on every hit
        ([0, 1, 0, 1, 0, 1], None, (3, 4)),
        ([0, 0, 0], None, (0, 3)),  # a miss: the next position starts a pass
        ([0, 1, 0], [True, False, True], (0, 2)),  # not a pass's first token
        ([1, 1, 0], [False, True, True], (1, 1)),
        ([], None, (0, 0)),
    ],
)
def test_the_walk_counts_where_one_draft_passes_start(hits, starts, judged):
    assert walked([bool(h) for h in hits], starts) == judged


def test_the_walk_goes_on_across_takes():
    """Counts are taken between passes; a hit at a pass's last position
    still skips the next pass's first."""
    walk = OneDraftWalk()
    walk.see(True)
    assert walk.take() == (1, 1) and walk.take() == (0, 0)
    walk.see(True)  # the bonus token of the pass that drafted the last one
    walk.see(False)
    assert walk.take() == (0, 1)


def test_the_walk_differs_from_every_position_where_hits_alternate():
    """Control: every position says 0.5 here; passes drafting one token at a
    time, once a draft is accepted, land on every hit."""
    hits = [True, False] * 10
    assert sum(hits) / len(hits) == 0.5
    assert walked(hits[1:]) == (9, 10)  # from a miss: then every hit
    assert walked([False, False] + hits) == (10, 12)
