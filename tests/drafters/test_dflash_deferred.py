"""The dflash drafter defers its context: accepted positions' feature rows are
held and taken in by one extend when the context is read (a draft, a saved
state) or when ``HOLD_POSITIONS`` are held, so plain passes cost no extend
each; the context it then drafts from is the one extended pass by pass."""

import mlx.core as mx
import mlx_lm
import pytest

import mlx_spec
from mlx_spec import DecodeOptions, Session
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.dflash import HOLD_POSITIONS, DFlashDrafter, draft_model_of
from mlx_spec.drafters.dflash_cost import feature_width
from mlx_spec.models.dflash.capture import detach_tap
from mlx_spec.states.snapshot import capture, shared
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.dflash_drafters import write_dflash_checkpoint
from mlx_spec.testing.reference import prompts, reference_tokens, register_twin

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    """(model, tokenizer, drafter model) of one family: a model of this
    module's own (its tap stays off the suite's shared models), its mlx-lm
    twin the reference, no end-of-sequence token, a float32 drafter."""
    root = tmp_path_factory.mktemp("deferred_" + request.param)
    path = write_tiny_checkpoint(root / "target", request.param)
    model, tok = mlx_spec.load(path)
    plain, plain_tok = mlx_lm.load(str(path))
    register_twin(model, plain)
    tok.eos_token_ids, plain_tok.eos_token_ids = set(), set()
    drafter_dir = write_dflash_checkpoint(root / "drafter", request.param)
    mlx_spec.loading.use_draft_model(model, str(drafter_dir))
    make_drafter("dflash", model)  # the tap on the drafter's layers
    yield model, tok, draft_model_of(model)
    detach_tap(model)


class CountingModel:
    """A drafter model whose extends are counted (the positions of each)."""

    def __init__(self, model):
        self.model = model
        self.extends = []

    def extend(self, features, cache):
        self.extends.append(features.shape[1])
        self.model.extend(features, cache)

    def __call__(self, *args):
        return self.model(*args)

    def __getattr__(self, name):
        return getattr(self.model, name)


class WatchedDrafter(DFlashDrafter):
    """A dflash drafter over a :class:`CountingModel`, recording the most
    feature rows it held after any accept."""

    def __init__(self, draft_model, hold=HOLD_POSITIONS):
        super().__init__(CountingModel(draft_model), hold)
        self.most_held = 0

    def accept(self, tokens, hidden):
        super().accept(tokens, hidden)
        rows = sum(r.shape[0] for r in self._held)
        assert rows == self.held_positions
        self.most_held = max(self.most_held, rows)


def test_plain_passes_extend_once_per_hold(setup):
    """Decoding plainly (k = 0) past twice the hold, the drafter's model
    extends once for the prompt and once per ``HOLD_POSITIONS`` accepted
    positions (an extend a pass fails this), never holding that many rows;
    the tokens are mlx-lm's."""
    model, tok, draft_model = setup
    drafter = WatchedDrafter(draft_model)
    session = Session(model, DecodeOptions(drafter, 0))
    prompt, n = prompts("mixed"), 2 * HOLD_POSITIONS + 30
    got = [t for t, _, _ in session.generate(prompt, max_tokens=n)]
    assert got == reference_tokens(model, tok, prompt, n)
    extends = drafter.model.extends
    assert extends[0] == len(prompt) - 1  # the prompt's, taken in at reset
    assert extends[1:] == [HOLD_POSITIONS] * 2, extends
    assert 0 < drafter.most_held < HOLD_POSITIONS
    assert sum(extends) + drafter.held_positions == drafter.context_length
    assert drafter.context_length == len(session.decoder.history) - 1


def random_rows(draft_model, n, seed):
    """n feature rows of the width ``draft_model`` reads (float32)."""
    return mx.random.normal((n, feature_width(draft_model)), key=mx.random.key(seed))


def feed(drafters, prompt, passes, seed):
    """The same prompt and ``passes`` accepts (1-3 tokens each, random rows)
    into every drafter; the history fed."""
    rows = random_rows(drafters[0].model, len(prompt) - 1, seed)
    for d in drafters:
        d.reset(prompt, rows)
    history = list(prompt)
    for i in range(passes):
        tokens = [(seed + 7 * i + j) % 200 for j in range(1 + i % 3)]
        rows = random_rows(drafters[0].model, len(tokens), seed + 1 + i)
        for d in drafters:
            d.accept(tokens, rows)
        history += tokens
    return history


def test_a_draft_after_held_rows_equals_one_extended_every_pass(setup):
    """After a stretch of held rows (and past the hold), the next block's
    logits are those of a drafter extending every pass. The tolerance: one
    extend over n rows and n extends over one row multiply matrices of other
    shapes, whose sums may be ordered differently (float32 rounding)."""
    _, _, draft_model = setup
    deferred = DFlashDrafter(draft_model)
    every_pass = DFlashDrafter(draft_model, hold=1)
    prompt = prompts("mixed", n=9)
    for passes, seed in ((20, 1), (HOLD_POSITIONS, 2)):
        feed([deferred, every_pass], prompt, passes, seed)
        assert deferred.held_positions > 0 and every_pass.held_positions == 0
        assert deferred.context_length == every_pass.context_length
        deferred.propose(3)
        every_pass.propose(3)
        assert deferred.held_positions == 0
        want = every_pass.last_draft_logits
        assert mx.allclose(deferred.last_draft_logits, want, atol=1e-5, rtol=0)


def test_a_state_saved_while_rows_are_held_restores_the_next_block(setup):
    """A drafter's saved arrays, taken while rows are held, hold every
    committed position: restored into a new drafter they give the same next
    block."""
    _, _, draft_model = setup
    drafter = DFlashDrafter(draft_model)
    history = feed([drafter], prompts("mixed", n=9), 12, seed=5)
    assert drafter.held_positions > 0
    arrays = drafter.saved_arrays()
    mx.eval(arrays)
    restored = DFlashDrafter(draft_model)
    restored.check_state(arrays, [])
    restored.restore(history, arrays)
    assert restored.context_length == drafter.context_length == len(history) - 1
    drafter.propose(3)
    restored.propose(3)
    assert mx.array_equal(restored.last_draft_logits, drafter.last_draft_logits)


def test_a_session_captured_while_rows_are_held_continues_as_mlx_lm(setup):
    """A session decoding plainly holds rows when captured; the state
    restored into a drafting session continues with mlx-lm's tokens."""
    model, tok, _ = setup
    first_turn, second_turn = prompts("mixed"), prompts("repetitive", n=7)
    session = Session(model, DecodeOptions("dflash", 0))
    first = [t for t, _, _ in session.generate(first_turn, max_tokens=20)]
    assert session.decoder.drafter.held_positions > 0
    state = capture(session.decoder, copy_caches=True, flush=False)
    again = Session(model, DecodeOptions("dflash", 3), state=shared(state))
    got = [t for t, _, _ in again.generate(second_turn, max_tokens=12)]
    assert got == reference_tokens(model, tok, first_turn + first + second_turn, 12)
    assert again.stats.drafted > 0


def test_the_hold_is_checked():
    with pytest.raises(ValueError, match="hold must be an integer >= 1, got 0"):
        DFlashDrafter(None, hold=0)
