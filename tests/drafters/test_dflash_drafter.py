"""The dflash drafter in the decode loop: greedy output equal to mlx-lm's on
every hybrid family and an attention-only target, alone (fixed and auto draft lengths) and batched beside
other drafters' rows; drafts accepted and rejected with the context following
the committed positions; the tap emptied after every forward."""

import gc
from dataclasses import replace

import mlx.core as mx
import mlx_lm
import pytest

import mlx_spec
from mlx_spec import DecodeOptions, Session, SpecStats
from mlx_spec.core import target as core_target
from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.core.sequence import SpeculativeDecoder
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.contract import Proposal
from mlx_spec.drafters.dflash import DFlashDrafter, draft_model_of
from mlx_spec.errors import InputError
from mlx_spec.models.dflash.capture import detach_tap, tap_of
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import GenerationParams, Job, Started
from mlx_spec.states.snapshot import capture, shared
from mlx_spec.testing.attention_only import write_llama_checkpoint
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.mtp_heads import write_predictive_checkpoint
from mlx_spec.testing.dflash_drafters import write_dflash_checkpoint
from mlx_spec.testing.reference import (
    cache_nbytes,
    fed_decoder,
    prompts,
    register_twin,
    reference_tokens,
    run_batch,
    spec_tokens,
    tokens_of,
)
from mlx_spec.testing.server import job_events

# the three hybrid families, and an attention-only target
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "llama")
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    """(model, tokenizer, drafter directory) of one family: a model of this
    module's own (the tap it gets stays off the suite's shared models), its
    mlx-lm twin the reference, no end-of-sequence token."""
    root = tmp_path_factory.mktemp("dflash_" + request.param)
    if request.param == "llama":
        path = write_llama_checkpoint(root / "target")
    else:
        path = write_tiny_checkpoint(root / "target", request.param)
    model, tok = mlx_spec.load(path)
    plain, plain_tok = mlx_lm.load(str(path))
    register_twin(model, plain)
    tok.eos_token_ids, plain_tok.eos_token_ids = set(), set()
    drafter_dir = write_dflash_checkpoint(root / "drafter", request.param)
    yield model, tok, drafter_dir
    detach_tap(model)


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_equals_mlx_lm(setup, k):
    model, tok, drafter_dir = setup
    for prompt in (prompts("mixed"), prompts("repetitive", n=9), [7]):
        want = reference_tokens(model, tok, prompt, MAX_TOKENS)
        stats = SpecStats()
        got = spec_tokens(
            model,
            tok,
            prompt,
            MAX_TOKENS,
            draft_model=str(drafter_dir),
            num_draft_tokens=k,
            stats=stats,
        )
        assert got == want, (prompt, k)
    if k != "auto":  # auto may find no draft paying on a random drafter
        assert stats.drafted > 0


class AgreeingDrafter(DFlashDrafter):
    """Runs the real block forward over its context, then swaps in the
    target's own continuation with every third draft position wrong: drafts
    are accepted, partly, and the target rolls back past the wrong ones.
    Records (context positions, committed positions before the pending
    token) and the length asked at every draft."""

    wrong = 3  # every wrong-th draft position is wrong (0: none)

    def __init__(self, draft_model, continuation):
        super().__init__(draft_model)
        self.continuation = list(continuation)
        self.seen = []  # (context length, positions committed before pending)
        self.asked = []  # the k of every draft

    def reset(self, prompt, hidden):
        super().reset(prompt, hidden)
        self.committed = len(prompt) - 1
        self.prompt_length = len(prompt)

    def accept(self, tokens, hidden):
        super().accept(tokens, hidden)
        self.committed += len(tokens)

    def propose(self, k):
        real = super().propose(k)
        self.seen.append((self.context_length, self.committed))
        self.asked.append(k)
        if not len(real):
            return real
        start = self.committed + 1 - self.prompt_length  # emitted so far
        own = self.continuation[start : start + len(real)]
        w = self.wrong
        tokens = [
            (t + 1) % 256 if w and (start + i) % w == w - 1 else t
            for i, t in enumerate(own)
        ]
        # keep the real draft in the graph: its forward runs with the pass
        lazy = mx.array(tokens, mx.uint32) + 0 * real.tokens[: len(tokens)]
        return Proposal(lazy, None, real.site)


def test_accepted_drafts_roll_back_exactly_and_the_context_follows(setup):
    model, tok, drafter_dir = setup
    prompt = prompts("mixed", seed=3)
    want = reference_tokens(model, tok, prompt, MAX_TOKENS)
    mlx_spec.loading.use_draft_model(model, str(drafter_dir))
    make_drafter("dflash", model)  # the tap on the drafter's layers
    drafter = AgreeingDrafter(draft_model_of(model), want)
    stats = SpecStats()
    session = Session(model, DecodeOptions(drafter, 3), stats=stats)
    got = [t for t, _, _ in session.generate(prompt, max_tokens=MAX_TOKENS)]
    assert got == want
    assert 0 < stats.accepted < stats.drafted, (stats.accepted, stats.drafted)
    # every committed position, and only those, is in the drafter's context
    assert drafter.seen and all(c == n for c, n in drafter.seen), drafter.seen


class RightDrafter(AgreeingDrafter):
    """Every draft position right (the real block forward still runs)."""

    wrong = 0


@pytest.fixture(scope="module")
def deep_block(tmp_path_factory):
    """(model, tokenizer, drafter directory): a qwen3_5 target of its own and
    a drafter of 16-token blocks."""
    root = tmp_path_factory.mktemp("dflash_deep")
    path = write_tiny_checkpoint(root / "target", "qwen3_5")
    model, tok = mlx_spec.load(path)
    plain, plain_tok = mlx_lm.load(str(path))
    register_twin(model, plain)
    tok.eos_token_ids, plain_tok.eos_token_ids = set(), set()
    drafter_dir = write_dflash_checkpoint(root / "drafter", "qwen3_5", block_size=16)
    yield model, tok, drafter_dir
    detach_tap(model)


def test_auto_drafts_past_eight_when_the_whole_block_is_right(deep_block):
    """A dflash row under ``auto`` whose drafts are all accepted, priced by a
    flat verify profile over T = 1..16: ``auto`` asks more than 8 drafts (up
    to the block's 15; the default ceiling would stop at 8), and the tokens
    are mlx-lm's. A session with ``auto`` sizes its decoder for the block."""
    model, tok, drafter_dir = deep_block
    prompt = prompts("mixed", seed=4)
    want = reference_tokens(model, tok, prompt, 160)
    mlx_spec.loading.use_draft_model(model, str(drafter_dir))
    make_drafter("dflash", model)  # the tap on the drafter's layers
    drafter = RightDrafter(draft_model_of(model), want)
    most = drafter.max_auto_draft
    assert most == drafter.block_size - 1 > 8
    batch = BatchDecoder(model, n_slots=1, max_draft=most)
    decoder = fed_decoder(model, prompt, drafter, most)
    b = batch.add(decoder, RowOptions(160, verify_costs=[0.02] * (most + 1)))
    rows = {b: []}
    run_batch(batch, rows)
    assert rows[b] == want
    assert 8 < max(drafter.asked) <= most, drafter.asked
    options = DecodeOptions("dflash", "auto")
    session = Session(model, options, draft_model=str(drafter_dir))
    assert session.decoder.max_draft == most


def test_rows_of_a_batch_equal_their_decoding_alone(setup):
    """dflash rows beside n-gram and plain rows in one verify pass: each
    row's tokens are mlx-lm's for its prompt."""
    model, tok, drafter_dir = setup
    mlx_spec.loading.use_draft_model(model, str(drafter_dir))
    specs = [
        (prompts("mixed"), 20, 3, "dflash"),
        (prompts("repetitive", n=9), 14, 2, "ngram"),
        (prompts("random", n=7, seed=5), 17, 3, "dflash"),
        ([9], 12, 0, "none"),
    ]
    batch = BatchDecoder(model, n_slots=4, max_draft=3)
    rows, want, decoders = {}, {}, []
    for prompt, max_tokens, k, kind in specs:
        ref = reference_tokens(model, tok, prompt, max_tokens)
        decoder = fed_decoder(model, prompt, make_drafter(kind, model), 3)
        b = batch.add(decoder, RowOptions(max_tokens, num_draft_tokens=k))
        rows[b], want[b] = [], ref
        decoders.append(decoder)
    run_batch(batch, rows)
    assert rows == want
    assert decoders[0].stats.drafted > 0 and decoders[2].stats.drafted > 0


def test_the_tap_is_emptied_by_every_forward(setup):
    """Over a long run the tap holds nothing between passes, and the active
    memory grows by what the caches hold and little more; the control keeps
    every recording (a leak) and the same measurement sees it. Forwards
    outside the decoder record nothing."""
    model, tok, drafter_dir = setup
    mlx_spec.loading.use_draft_model(model, str(drafter_dir))
    kept = []

    def held(max_tokens):
        """Active memory beyond the caches after a run of ``max_tokens``,
        and whether the tap held anything between passes."""
        kept.clear()
        session = Session(model, DecodeOptions("dflash", 3))
        left = False
        for _ in session.generate(prompts("mixed"), max_tokens=max_tokens):
            left = left or bool(tap_of(model)._outputs[0])
        gc.collect()  # an earlier session's arrays, freed now
        caches = cache_nbytes(session.decoder.cache.caches)
        context = sum(c.nbytes for c in session.decoder.drafter.cache)
        return mx.get_active_memory() - caches - context, left

    short, left_short = held(64)
    long, left_long = held(192)
    assert not left_short and not left_long
    # a forward outside the decoder (mlx-lm's own loop) records nothing
    spec_tokens(model, tok, prompts("mixed"), 8, draft="none")
    model(mx.array([[1, 2, 3]]))
    assert not tap_of(model)._outputs[0]
    per_token = (long - short) / 128
    tap = tap_of(model)
    real_record = type(tap).record

    def leaking(self, slot, output):
        kept.append(output)
        real_record(self, slot, output)

    type(tap).record = leaking
    try:
        leak_short, _ = held(64)
        leak_long, _ = held(192)
    finally:
        type(tap).record = real_record
    leak_per_token = (leak_long - leak_short) / 128
    # A recording costs the tapped layers' outputs, len(layers) * H floats a
    # token; everything else a run keeps is in the caches.
    H = draft_model_of(model).config.hidden_size
    recorded = 2 * H * 4
    assert per_token < recorded / 4, (per_token, recorded)
    assert leak_per_token > recorded / 2, (leak_per_token, recorded)


def test_without_a_drafter_model_dflash_is_refused_on_one_line(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "t", "qwen3_5")
    model = mlx_spec.load(path)[0]
    with pytest.raises(InputError, match="draft_model") as e:
        make_drafter("dflash", model)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="DFlash drafter"):
        mlx_spec.loading.use_draft_model(model, object())


def test_a_fixed_draft_beyond_the_block_is_refused(setup):
    model, tok, drafter_dir = setup
    mlx_spec.loading.use_draft_model(model, str(drafter_dir))
    with pytest.raises(ValueError, match="1..3 tokens per pass, got 4"):
        Session(model, DecodeOptions("dflash", 4))


@pytest.fixture(scope="module")
def head_and_drafter(tmp_path_factory):
    """A qwen3_next whose MTP head predicts it well, with a dflash drafter
    attached too: (model, tokenizer, the same checkpoint without a
    drafter)."""
    root = tmp_path_factory.mktemp("dflash_beside_mtp")
    path = write_predictive_checkpoint(root / "target", "qwen3_next")
    model, tok = mlx_spec.load(path)
    register_twin(model, mlx_lm.load(str(path))[0])
    tok.eos_token_ids = set()
    drafter_dir = write_dflash_checkpoint(root / "drafter", "qwen3_next")
    mlx_spec.loading.use_draft_model(model, str(drafter_dir))
    alone, alone_tok = mlx_spec.load(path)
    alone_tok.eos_token_ids = set()
    yield model, tok, (alone, alone_tok)
    detach_tap(model)


def test_the_head_and_dflash_share_a_model(head_and_drafter):
    """With the tap attached, the target hands the post-norm state and the
    tap's features side by side; the head reads the one, dflash the other.
    Alone and as rows of one batch, each is mlx-lm's, and the head accepts
    exactly the drafts it accepts on a model without a drafter (it reads
    the same rows)."""
    model, tok, (alone, alone_tok) = head_and_drafter
    assert core_target.feature_tap(model) is tap_of(model)
    prompt = prompts("mixed")
    want = reference_tokens(model, tok, prompt, MAX_TOKENS)
    for draft in ("mtp", "mtp+ngram", "dflash"):
        stats = SpecStats()
        got = spec_tokens(
            model, tok, prompt, MAX_TOKENS, draft=draft, num_draft_tokens=3, stats=stats
        )
        assert got == want, draft
        if draft.startswith("mtp"):
            untapped = SpecStats()
            spec_tokens(
                alone,
                alone_tok,
                prompt,
                MAX_TOKENS,
                draft=draft,
                num_draft_tokens=3,
                stats=untapped,
            )
            assert stats.accepted > 0
            assert stats.accepted_at == untapped.accepted_at, draft
    specs = [(prompt, "mtp"), (prompts("repetitive", n=9), "dflash"), ([7], "mtp")]
    batch = BatchDecoder(model, n_slots=3, max_draft=3)
    rows, wanted, decoders = {}, {}, []
    for p, kind in specs:
        decoder = fed_decoder(model, p, make_drafter(kind, model), 3)
        b = batch.add(decoder, RowOptions(16, num_draft_tokens=3))
        rows[b], wanted[b] = [], reference_tokens(model, tok, p, 16)
        decoders.append(decoder)
    run_batch(batch, rows)
    assert rows == wanted
    assert decoders[0].stats.accepted > 0 and decoders[1].stats.drafted > 0


def block_logits(drafter):
    """The logits of the drafter's next block, its state unchanged (held
    rows taken in first: the context is every committed position)."""
    drafter.take_in_held()
    block = drafter.model.block(mx.array([drafter._pending], mx.uint32))
    return drafter.model(block, None, drafter.cache)


def test_a_kept_state_is_restored_exactly(setup):
    """A state captured after a turn (flushed, and with its last token
    pending), restored into new sessions twice, continues exactly as the
    session it was taken from; a damaged one is refused before use."""
    model, tok, drafter_dir = setup
    mlx_spec.loading.use_draft_model(model, str(drafter_dir))
    options = DecodeOptions("dflash", 3)
    first_turn, second_turn = prompts("mixed"), prompts("repetitive", n=7)
    for flush in (False, True):
        session = Session(model, options)
        first = [t for t, _, _ in session.generate(first_turn, max_tokens=12)]
        state = capture(session.decoder, copy_caches=True, flush=flush)
        drafts = block_logits(session.decoder.drafter)
        want = [t for t, _, _ in session.generate(second_turn, max_tokens=12)]
        assert want == reference_tokens(
            model, tok, first_turn + first + second_turn, 12
        )
        for _ in range(2):
            again = Session(model, options, state=shared(state))
            # the same context: the same next block
            assert mx.allclose(block_logits(again.decoder.drafter), drafts)
            got = [t for t, _, _ in again.generate(second_turn, max_tokens=12)]
            assert got == want, flush
    arrays = list(state.drafter_arrays)
    arrays[0] = arrays[0][:, :, :-1]
    with pytest.raises(ValueError, match="draft layer 0"):
        Session(model, options, state=replace(state, drafter_arrays=arrays))


def test_a_chunked_prompt_enters_the_context_chunk_by_chunk(setup):
    """A prompt fed in chunks (as the server prefills one): each chunk's
    features enter the drafter's context as the chunk is fed, none held to
    the last chunk, and the context is then one feed's: the same next block."""
    model, _, drafter_dir = setup
    mlx_spec.loading.use_draft_model(model, str(drafter_dir))
    prompt = prompts("random", n=70, seed=3)

    def decoder():
        return SpeculativeDecoder(
            model, make_drafter("dflash", model), prefill_step_size=16
        )

    whole = decoder()
    whole.feed(prompt)
    chunked = decoder()
    for start in range(0, len(prompt), 20):
        chunk = prompt[start : start + 20]
        chunked.feed(chunk, more=start + 20 < len(prompt))
        assert not chunked._held
        # every committed position: all fed but the pending last token
        assert chunked.drafter.context_length == start + len(chunk) - 1
    assert chunked.drafter.context_length == whole.drafter.context_length
    want = block_logits(whole.drafter)
    assert mx.allclose(block_logits(chunked.drafter), want, atol=1e-5)


def test_server_rows_share_passes_and_each_equals_mlx_lm(setup):
    """Through the server's engine: dflash requests beside an n-gram one,
    all waiting, join the same passes; each gets mlx-lm's tokens, and a
    second turn continues a kept dflash state exactly."""
    model, tok, drafter_dir = setup
    mlx_spec.loading.use_draft_model(model, str(drafter_dir))
    engine = Engine(model, tok, "dflash", num_draft_tokens=3, batch_size=3, start=False)
    try:
        specs = [
            (prompts("mixed"), 12, None),
            (prompts("repetitive"), 16, "ngram"),
            (prompts("random", n=9, seed=4), 10, "dflash"),
        ]
        jobs = [
            engine.submit(Job(p, GenerationParams(n, draft=d))) for p, n, d in specs
        ]
        engine.start()
        replies = []
        for job, (prompt, n, _) in zip(jobs, specs):
            replies.append(tokens_of(job_events(job)))
            assert replies[-1] == reference_tokens(model, tok, prompt, n)
        assert engine.peak_decoding == 3
        second = specs[0][0] + replies[0] + [5, 6, 7]
        events = job_events(engine.submit(Job(second, GenerationParams(9))))
        started = next(e for e in events if isinstance(e, Started))
        assert started.cached_tokens == len(second) - 4  # the kept state
        assert tokens_of(events) == reference_tokens(model, tok, second, 9)
    finally:
        engine.close()
