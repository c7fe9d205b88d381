"""The MTP heads of a batch's rows drafted together: every row drafts what its
own MTPDrafter drafts alone, and leaves with its own head cache again."""

import random

import mlx.core as mx
import pytest

import mlx_spec
from mlx_spec.core import batch_mtp
from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.drafters.contract import DraftSite
from mlx_spec.core.batch_mtp import MTPBatch
from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.testing.memory import PER_TOKEN_LIMIT, growth_per_token
from mlx_spec.testing.mtp_heads import cycle_order, write_cycle_checkpoint
from mlx_spec.testing.reference import cache_nbytes
from mlx_spec.testing.reference import decode_alone

# Context lengths: no head row yet (one token), short, longer than a pass.
CONTEXTS = (1, 6, 40, 130)


def _twins(head, rng):
    """Two identical drafters per context: one stays alone, one joins."""
    H = head.hidden_size
    pairs = []
    for n in CONTEXTS:
        prompt = [rng.randrange(256) for _ in range(n)]
        hidden = mx.random.normal((n - 1, H)) if n > 1 else None
        pair = (MTPDrafter(head), MTPDrafter(head))
        for d in pair:
            d.reset(prompt, hidden)
        pairs.append(pair)
    return pairs


def _equal(a, b) -> bool:
    return a.shape == b.shape and mx.array_equal(a, b).item()


@pytest.mark.parametrize("window", [None, 16])  # 16: shorter than most contexts
def test_each_row_drafts_what_it_drafts_alone(models, family, window, monkeypatch):
    model, _ = models[family]
    head, rng = model.mtp_head, random.Random(0)
    monkeypatch.setattr(head, "attention_window", window)
    mx.random.seed(0)
    pairs = _twins(head, rng)
    batch = MTPBatch(head)
    for _, member in pairs:  # the first one joins with an empty cache
        batch.join(member)
    for _ in range(8):
        ks = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in pairs]
        drafting = [m for (_, m), k in zip(pairs, ks) if k]
        batch.catch_up(drafting)
        wants = {
            i: k for i, k in enumerate(ks) if k and pairs[i][1].drafts_with_head(k)
        }
        if wants:
            batch.draft(wants)
        for i, ((alone, member), k) in enumerate(zip(pairs, ks)):
            if k:
                alone.catch_up()
                draft = alone.draft(k)
                got = member.propose(k)  # the batch's draft stays lazy
                assert (got.site is DraftSite.DEVICE) == (i in wants)
                assert got.tokens.tolist() == draft
                if draft:
                    assert _equal(member.last_draft_logits, alone.last_draft_logits)
            # both are told the same verify outcome (k = 0: a plain step)
            emitted = draft[: rng.randint(0, len(draft))] if k else []
            emitted += [rng.randrange(256)]
            hidden = mx.random.normal((len(emitted), head.hidden_size))
            alone.accept(emitted, hidden)
            member.accept(emitted, hidden)
    for alone, member in pairs:  # each leaves with its own rows, and goes on alone
        batch.leave(member)
        assert member.rows.offset == alone.rows.offset
        assert all(map(_equal, member.saved_arrays(), alone.saved_arrays()))
        assert member.draft(4) == alone.draft(4)
    assert batch.members == [] and all(c.keys is None for c in batch.caches)


def test_a_member_runs_its_deferred_rows_only_at_the_bound(models, monkeypatch):
    """A member not drafting keeps its accepted rows deferred until it holds
    ``DEFERRED_ROWS`` of them; then the batch runs them anyway (what it holds
    stays bounded), and a member drafting runs its own whatever it holds."""
    monkeypatch.setattr(batch_mtp, "DEFERRED_ROWS", 6)
    model, _ = models["qwen3_next"]
    head = model.mtp_head
    mx.random.seed(0)
    members = [pair[1] for pair in _twins(head, random.Random(1))[1:3]]
    batch = MTPBatch(head)
    for m in members:
        batch.join(m)
    H = head.hidden_size
    for emitted in ([1, 2], [3]):
        for m in members:
            m.accept(emitted, mx.random.normal((len(emitted), H)))
    members[0].accept([7], mx.random.normal((1, H)))
    assert [m.rows.pending_rows for m in members] == [4, 3]
    assert batch.catch_up([]) == 0  # below the bound: nothing runs
    # a member about to draft runs its own (and members with no more rows)
    assert batch.catch_up([members[1]]) > 0
    assert [m.rows.pending_rows for m in members] == [4, 0]
    for m in members:
        m.accept([4, 5], mx.random.normal((2, H)))
    assert batch.catch_up([]) > 0  # the first member reached the bound
    assert [m.rows.pending_rows for m in members] == [0, 0]


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cycle")
    return mlx_spec.load(write_cycle_checkpoint(path, "qwen3_next"))[0]


def _alone(model, prompt, draft, k, max_tokens):
    """The tokens and counters of ``prompt`` decoded alone, as a batch row
    with draft length ``k`` decodes it."""
    d = SpeculativeDecoder(model, make_drafter(draft, model), max_draft=k)
    d.feed(prompt)
    out = decode_alone(d, k, max_tokens)
    return out, (d.stats.drafted, d.stats.accepted, d.stats.verify_passes)


def test_batched_heads_draft_each_row_as_alone(cycle_model):
    """Rows of both MTP drafters, of different contexts and draft lengths:
    each row's tokens, drafts proposed and accepted equal its run alone."""
    order = cycle_order()
    specs = [  # prompt, drafter, k
        (order[5:6], "mtp", 3),
        (order[:40] + order[100:110], "mtp+ngram", 5),
        (order[200:230], "mtp", 2),
        (order[300:320] + order[300:310], "mtp+ngram", 4),
    ]
    batch = BatchDecoder(cycle_model, n_slots=4, max_draft=5)
    ids, got = [], {}
    for prompt, draft, k in specs:
        d = SpeculativeDecoder(cycle_model, make_drafter(draft, cycle_model), 5)
        d.feed(prompt)
        ids.append(batch.add(d, RowOptions(40, num_draft_tokens=k)))
        got[ids[-1]] = []
    while batch.active:
        for id, (tokens, _) in batch.step().items():
            got[id] += tokens
    assert len(batch.heads.members) == 4
    for id, (prompt, draft, k) in zip(ids, specs):
        stats = batch.take(id).stats
        want, counters = _alone(cycle_model, prompt, draft, k, 40)
        assert got[id] == want
        assert (stats.drafted, stats.accepted, stats.verify_passes) == counters
        assert stats.accepted > 0
    assert batch.heads.members == []


def test_a_full_ngram_match_is_copied_without_running_the_head(models):
    """mtp+ngram takes a full max_ngram match as is: it needs no head state,
    so the accepted rows stay deferred (a batch does not catch that row up)."""
    model, _ = models["qwen3_next"]
    drafter = make_drafter("mtp+ngram", model)
    prompt = [5, 6, 7, 8, 9] * 4
    hidden = mx.random.normal((len(prompt) - 1, model.mtp_head.hidden_size))
    drafter.reset(prompt, hidden)
    drafter.accept([5], mx.random.normal((1, model.mtp_head.hidden_size)))
    assert drafter.mtp.rows.pending_rows == 1 and not drafter.needs_head_state(3)
    assert drafter.draft(3) == [6, 7, 8] and drafter.mtp.rows.pending_rows == 1
    drafter.accept([6, 2], mx.random.normal((2, model.mtp_head.hidden_size)))
    assert drafter.needs_head_state(3)  # no match for (6, 2): the head drafts


@pytest.mark.slow
def test_memory_flat_while_rows_draft_with_the_head(cycle_model):
    """Two rows draft with the batch's MTP head (lazily, into the verify
    pass) for 1,200 mostly accepted tokens each: MLX's active memory, less
    the caches' buffers (which grow by design), read every 100 tokens from
    400 on, grows by less than ``PER_TOKEN_LIMIT`` bytes per token."""
    order = cycle_order()
    batch = BatchDecoder(cycle_model, n_slots=2, max_draft=4)
    ids = []
    for i in range(2):
        d = SpeculativeDecoder(cycle_model, make_drafter("mtp", cycle_model), 4)
        d.feed(order[100 * i : 100 * i + 30])
        ids.append(batch.add(d, RowOptions(1300, num_draft_tokens=4)))
    produced, marks, readings = 0, list(range(400, 1201, 100)), []
    at = []
    for _ in range(1300):  # passes: at least one token each
        produced += len(batch.step()[ids[0]][0])
        if produced >= marks[0]:
            at.append(produced)
            marks.pop(0)
            caches = batch.caches + batch.heads.caches
            kv = [getattr(c, "keys", None) for c in caches]
            kv += [getattr(c, "values", None) for c in caches]
            mx.eval([x for x in kv if x is not None])  # lazy rows hold no memory
            readings.append(mx.get_active_memory() - cache_nbytes(caches))
        if not marks:
            break
    stats = batch.take(ids[0]).stats
    assert stats.accepted > 0.8 * stats.drafted
    assert growth_per_token(at, readings) < PER_TOKEN_LIMIT, readings


def test_a_lone_row_never_runs_the_head_the_batch_holds(models, monkeypatch):
    """One ``mtp+ngram`` row in a batch that could hold more, with a partial
    copy and deferred head rows: its head's cache is the batch's, so naming
    the draft's source must not run the head on the row's own (moved-out)
    cache, which would lose the deferred rows from the batch's cache."""
    from mlx_spec.drafters.mtp_rows import HeadRows
    from mlx_spec.testing.reference import fed_decoder

    model, _ = models["qwen3_next"]
    run = HeadRows.run

    def checked_run(rows, *args, **kwargs):
        assert rows.cache is not None, "the head ran without its cache"
        return run(rows, *args, **kwargs)

    batch = BatchDecoder(model, n_slots=4, max_draft=8)
    drafter = make_drafter("mtp+ngram", model)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3]
    batch.add(fed_decoder(model, prompt, drafter, 8), RowOptions(16))
    hidden = mx.random.normal((1, model.mtp_head.hidden_size))
    drafter.accept([4], hidden)  # a pass's row, deferred; [3, 4]: a partial match
    assert drafter.ngram.draft(3) and drafter.mtp.rows.pending_rows > 0
    assert drafter.ngram.match_length() < drafter.ngram.max_ngram
    monkeypatch.setattr(HeadRows, "run", checked_run)
    batch.scheduler._lengths(batch.rows, [0], batch.heads)
    assert drafter.mtp.rows.pending_rows > 0  # left for the batch's catch-up
