"""The drafter contract: named drafters implement it, foreign objects are adapted."""

import pytest

from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.base import Drafter, as_drafter
from mlx_spec.testing.reference import (
    OracleDrafter,
    prompts,
    reference_tokens,
    spec_tokens,
)


@pytest.mark.parametrize("name", ["ngram", "mtp", "mtp+ngram"])
def test_named_drafters_are_drafters(models, name):
    drafter = make_drafter(name, models["qwen3_next"][0])
    assert isinstance(drafter, Drafter) and as_drafter(drafter) is drafter
    assert drafter.needs_hidden == (name != "ngram")


def test_foreign_object_gets_the_defaults(models):
    """An object with only reset/draft/accept drives the loop unchanged."""
    model, tok = models["qwen3_5"]
    prompt = prompts("mixed")
    ref = reference_tokens(model, tok, prompt, 24)
    oracle = OracleDrafter(prompt + ref, error=0.3)
    decoder = SpeculativeDecoder(model, oracle)
    assert isinstance(decoder.drafter, Drafter) and decoder.drafter.inner is oracle
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
    class Lazy(Drafter):
        pass

    with pytest.raises(NotImplementedError):
        Lazy().draft(2)
    with pytest.raises(NotImplementedError, match="'custom' cannot restore"):
        Lazy().restore([1, 2], [])
    assert Lazy().state == [] and Lazy().draft_probs is None
