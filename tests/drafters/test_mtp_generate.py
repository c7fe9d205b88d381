"""MTP drafting in the decode loop: lossless greedy, acceptance, cache rollback."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

import mlx_spec
from mlx_spec.core.stats import SpecStats
from mlx_spec.drafters import draft_names, make_drafter
from mlx_spec.drafters.combined import MTPNgramDrafter
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.generate import stream_generate
from mlx_spec.session import DecodeOptions, Session
from mlx_spec.models.mtp import MTPKVCache, MTPUnavailableError
from mlx_spec.testing.checkpoints import FAMILIES
from mlx_spec.testing.mtp_heads import (
    cycle_order,
    write_cycle_checkpoint,
    write_predictive_checkpoint,
)
from mlx_spec.testing.reference import walked

PROMPT = "def push(self, value: int) -> None:\n"
COPY_PROMPT = "x = a + b\ny = a + b\nz = a + b\nw = a + b\nv = a"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """family -> a raw checkpoint whose MTP head predicts its target well."""
    root = tmp_path_factory.mktemp("mtp_gen")
    return {f: write_predictive_checkpoint(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def models(paths):
    return {f: mlx_spec.load(p) for f, p in paths.items()}


def reference(model, tok, prompt, max_tokens=MAX_TOKENS):
    return [
        r.token
        for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=max_tokens)
    ]


def spec(model, tok, prompt, drafter, k, max_tokens=MAX_TOKENS, stats=None):
    out = stream_generate(
        model,
        tok,
        prompt,
        max_tokens=max_tokens,
        draft=drafter,
        num_draft_tokens=k,
        stats=stats,
    )
    return [r.token for r in out]


def run_loop(model, prompt_ids, drafter, k, max_tokens=MAX_TOKENS):
    stats = SpecStats()
    session = Session(model, DecodeOptions(drafter, num_draft_tokens=k), stats=stats)
    gen = session.generate(prompt_ids, max_tokens=max_tokens)
    return [t for t, _, _ in gen], stats


def test_registered():
    assert "mtp" in draft_names() and "mtp+ngram" in draft_names()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft", ["mtp", "mtp+ngram"])
@pytest.mark.slow
def test_lossless_greedy_all_draft_lengths(models, family, draft):
    model, tok = models[family]
    accepted = 0
    for prompt in (PROMPT, COPY_PROMPT):
        ref = reference(model, tok, prompt)
        for k in range(1, 9):
            stats = SpecStats()
            assert spec(model, tok, prompt, draft, k, stats=stats) == ref, (prompt, k)
            accepted += stats.accepted
            # Acceptance statistics per draft position are filled.
            assert len(stats.drafted_at) == k and stats.drafted_at[0] > 0
            assert all(0.0 <= a <= 1.0 for a in stats.acceptance_per_position)
    assert accepted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_greedy_auto(models, family):
    """``auto`` (draft lengths chosen per pass from acceptance and what
    passes took, probes included) changes which passes run, never a token."""
    model, tok = models[family]
    for prompt in (PROMPT, COPY_PROMPT):
        stats = SpecStats()
        out = spec(model, tok, prompt, "mtp+ngram", "auto", stats=stats)
        assert out == reference(model, tok, prompt), prompt
        assert stats.verify_passes > 0


def test_acceptance_statistics_decay_is_reported(models):
    model, tok = models["qwen3_5_moe"]
    stats = SpecStats()
    spec(model, tok, PROMPT, "mtp", 4, max_tokens=40, stats=stats)
    per_pos = stats.acceptance_per_position
    assert len(per_pos) == 4 and per_pos[0] > 0
    assert stats.accepted_at[0] >= stats.accepted_at[-1]
    assert "Acceptance per draft position" in stats.summary()


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_cache_matches_fresh_recompute(models, family):
    """After partial accepts the head's cache equals a prefill of the whole text."""
    model, tok = models[family]
    prompt = tok.encode(PROMPT)
    drafter = MTPDrafter(model.mtp_head)
    out, stats = run_loop(model, prompt, drafter, 3, max_tokens=24)
    assert 0 < stats.accepted < stats.drafted  # some rollback happened
    full = prompt + out
    P = len(full) - 1  # the last token is pending
    assert drafter.rows.offset == drafter.rows.verified == P
    hidden = model.model(mx.array(full[:-1])[None])  # [1, P, H]
    cache = model.mtp_head.make_cache()
    hm = model.mtp_head.head_hidden(mx.array(full[1:])[None], hidden, cache)
    keys, values = drafter.rows.cache[0].keys, drafter.rows.cache[0].values
    assert mx.allclose(keys[..., :P, :], cache[0].keys[..., :P, :], atol=5e-3).item()
    assert mx.allclose(
        values[..., :P, :], cache[0].values[..., :P, :], atol=5e-3
    ).item()
    fresh = model.mtp_head.logits(hm[:, -1:])[0, 0]
    assert mx.allclose(drafter.rows.logits, fresh, rtol=1e-3, atol=1e-3).item()


def test_cache_stores_float16_only_where_the_kernel_reads_it(models, monkeypatch):
    model, tok = models["qwen3_next"]
    drafter = MTPDrafter(model.mtp_head)
    run_loop(model, tok.encode(PROMPT), drafter, 2, max_tokens=4)
    assert isinstance(drafter.rows.cache[0], MTPKVCache)
    # no Metal here: rows kept in the compute dtype, never upcast per step
    assert drafter.rows.cache[0].keys.dtype == model.mtp_head.fc.weight.dtype
    monkeypatch.setattr(mlx_spec.kernels.switch, "kernels_wanted", lambda: True)
    assert [c.dtype for c in model.mtp_head.make_cache()] == [mx.float16]


def test_one_token_prompt_drafts_nothing_first(models):
    model, tok = models["qwen3_5"]
    prompt = tok.encode(PROMPT)[:1]
    drafter = MTPDrafter(model.mtp_head)
    drafter.reset(prompt, None)
    assert drafter.draft(3) == [] and drafter.last_draft_logits is None
    out, stats = run_loop(model, prompt, MTPDrafter(model.mtp_head), 3)
    ref = reference(model, tok, prompt)
    assert out[: len(ref)] == ref and stats.drafted > 0


def test_last_draft_logits(models):
    model, tok = models["qwen3_5_moe"]
    ids = tok.encode(PROMPT)
    drafter = MTPDrafter(model.mtp_head)
    drafter.reset(ids, model.model(mx.array(ids[:-1])[None])[0])
    d = drafter.draft(5)
    assert drafter.last_draft_logits.shape == (5, model.mtp_head.vocab_size)
    assert mx.argmax(drafter.last_draft_logits, axis=-1).tolist() == d
    assert drafter.rows.offset == len(ids) - 1 + 4  # 4 draft-time rows until accept


@pytest.mark.parametrize("k", [0, 9, 16])
def test_draft_length_out_of_range(models, k):
    model, tok = models["qwen3_next"]
    for drafter in (MTPDrafter(model.mtp_head), MTPNgramDrafter(model.mtp_head)):
        drafter.reset([1, 2, 3], model.model(mx.array([1, 2])[None])[0])
        with pytest.raises(ValueError, match="1..8"):
            drafter.draft(k)
    if k > 8:
        with pytest.raises(ValueError, match="1..8"):
            spec(model, tok, PROMPT, "mtp", k)


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory):
    """A target that copies a stretch of its token cycle; a mediocre head."""
    path = tmp_path_factory.mktemp("cycle") / "c"
    return mlx_spec.load(write_cycle_checkpoint(path, "qwen3_next", mtp_noise=2.0))


def test_combined_uses_both_and_keeps_mtp_cache(cycle_model):
    model, _ = cycle_model
    order = cycle_order(0)
    ids = order[100:130] + order[100:104]  # copies 26 tokens, then novel text
    drafter = MTPNgramDrafter(model.mtp_head, max_ngram=3)
    out, stats = run_loop(model, ids, drafter, 4, max_tokens=48)
    ref = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=48)]
    assert out[:48] == ref
    assert (
        drafter.mtp.rows.offset == drafter.mtp.rows.verified == len(ids) + len(out) - 1
    )
    assert drafter.steps["ngram"] > 0 and drafter.steps["mtp"] > 0
    assert stats.accepted > 0
    only_mtp, mtp_stats = run_loop(model, ids, MTPDrafter(model.mtp_head), 4, 48)
    assert only_mtp[:48] == ref
    assert stats.tokens_per_pass > mtp_stats.tokens_per_pass  # copying pays here


def _fixed_rule_drafter(head):
    """The benchmark's ``mtp+ngram`` variant without the score: the rule the
    runtime falls back to while sampling (scripts/ is no package: the script
    is loaded from its file)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_mtp_ngram.py"
    spec = importlib.util.spec_from_file_location("bench_mtp_ngram", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FixedRuleDrafter(head, 3, "agree_or_long")


@pytest.mark.parametrize(
    "make, scores",
    [(MTPNgramDrafter, True), (_fixed_rule_drafter, False)],
    ids=["scored", "fixed_rule"],
)
def test_combined_lossless(models, make, scores):
    """The scored choice, and the fixed rule it falls back to while sampling
    (which keeps no score: the prompt has a disagreement to score)."""
    model, tok = models["qwen3_5_moe"]
    ids = tok.encode(COPY_PROMPT)
    drafter = make(model.mtp_head)
    out, _ = run_loop(model, ids, drafter, 5)
    ref = reference(model, tok, COPY_PROMPT)
    assert out[: len(ref)] == ref
    assert (sum(drafter.score.values()) > 0) == scores


def test_head_is_not_part_of_the_target(models):
    model, _ = models["qwen3_5_moe"]
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert not any("mtp" in n for n in names)
    head_names = [k for k, _ in tree_flatten(model.mtp_head.parameters())]
    assert not any("embed_tokens" in n or "lm_head" in n for n in head_names)
    assert len(head_names) == len(set(head_names)) > 0


def test_model_without_head_says_what_to_run(tmp_path):
    path = write_predictive_checkpoint(tmp_path / "raw", "qwen3_5")
    model, tok = mlx_lm.load(str(path))  # plain mlx-lm: no head attached
    with pytest.raises(MTPUnavailableError, match="mlx_spec convert --mtp-from"):
        make_drafter("mtp", model)
    with pytest.raises(MTPUnavailableError, match="mlx_spec convert --mtp-from"):
        spec(model, tok, PROMPT, "mtp+ngram", 2)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_target_with_float_head(paths, bits):
    """nn.quantize after loading: the head uses the target's new quantised modules."""
    model, tok = mlx_spec.load(paths["qwen3_5_moe"])
    nn.quantize(
        model,
        group_size=32,
        bits=bits,
        class_predicate=lambda p, m: hasattr(m, "to_quantized")
        and m.weight.shape[-1] % 32 == 0,
    )
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert not isinstance(model.mtp_head.fc, nn.QuantizedLinear)
    ref = reference(model, tok, PROMPT)
    stats = SpecStats()
    assert spec(model, tok, PROMPT, "mtp", 3, stats=stats) == ref
    assert stats.accepted > 0


def _judged_plain_run(model, ids, max_tokens):
    """Decode without drafting, the head judging its first drafts; returns
    what it judged and the rows it was given (reset's, then accept's)."""
    drafter = MTPDrafter(model.mtp_head)
    assert drafter.hindsight() == {}  # nothing yet; asking turns judging on
    rows = []
    reset, accept = drafter.reset, drafter.accept
    drafter.reset = lambda t, h: rows.append((list(t[1:]), h)) or reset(t, h)
    drafter.accept = lambda t, h: rows.append((list(t), h)) or accept(t, h)
    run_loop(model, ids, drafter, 0, max_tokens=max_tokens)
    return drafter, rows


@pytest.mark.parametrize("noise", [0.0, 2.0])
def test_rows_run_without_drafting_judge_the_first_draft(tmp_path, noise):
    """Each row of a batch the head runs is judged: the d_1 it would have
    drafted against the token of the next row (the target's choice), and for
    the prompt's rows against the target's greedy choice, counted where
    passes drafting one token would have started. The counts equal a
    recomputation over the same rows; a head that predicts the cycle well is
    judged right far more often than a noisy one."""
    path = write_cycle_checkpoint(tmp_path / "c", "qwen3_next", mtp_noise=noise)
    model, _ = mlx_spec.load(path)
    ids = cycle_order(0)[100:110]
    drafter, rows = _judged_plain_run(model, ids, max_tokens=70)
    head, cache = model.mtp_head, model.mtp_head.make_cache()

    def judged(tokens, hidden, chosen):
        hm = head.head_hidden(mx.array([tokens]), hidden[None], cache)
        guesses = mx.argmax(head.logits(hm[:, :-1]), axis=-1)[0].tolist()
        return walked([g == t for g, t in zip(guesses, chosen)])

    (prompt, prompt_hidden), accepted = rows[0], rows[1:]
    greedy = mx.argmax(head.logits(prompt_hidden[1:]), axis=-1).tolist()
    hits, trials = judged(prompt, prompt_hidden, greedy)
    tokens = sum((t for t, _ in accepted[:64]), [])  # the first batch of rows
    hidden = mx.concatenate([h for _, h in accepted[:64]])
    more_hits, more_trials = judged(tokens, hidden, tokens[1:])
    assert drafter.hindsight() == {"mtp": (hits + more_hits, trials + more_trials)}
    assert drafter.hindsight() == {}  # taken
    rate = (hits + more_hits) / (trials + more_trials)
    assert rate >= 0.9 if noise == 0.0 else rate <= 0.8


def test_a_drafting_pass_own_tokens_are_not_judged(tmp_path, monkeypatch):
    """Tokens the head drafted, and the target's token after them, were
    reached through accepted drafts: no sample of a pass's first draft. Every
    pass drafting, nothing is judged; the same text decoded without drafts
    is (the control)."""
    import mlx_spec.drafters.mtp_rows as mtp

    monkeypatch.setattr(mtp, "JUDGED_PROMPT_ROWS", 0)  # the accepted rows only
    path = write_cycle_checkpoint(tmp_path / "c", "qwen3_next", mtp_noise=2.0)
    model, _ = mlx_spec.load(path)
    ids = cycle_order(0)[100:110]
    for k, judged in [(3, False), (0, True)]:
        drafter = MTPDrafter(model.mtp_head)
        drafter.hindsight()  # turns judging on
        drafter.rows.pending_limit = 8  # rows deferred at k = 0 run in batches
        tokens, stats = run_loop(model, ids, drafter, k, max_tokens=40)
        assert stats.accepted > 0 if k else stats.drafted == 0
        assert bool(drafter.hindsight()) == judged


def test_a_prompt_of_two_tokens_has_no_row_to_judge(models):
    """One prompt row is followed by none: nothing to judge (no empty argmax)."""
    model, tok = models["qwen3_next"]
    drafter, _ = _judged_plain_run(model, tok.encode(PROMPT)[:2], max_tokens=3)
    assert drafter.hindsight() == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_drafts_follow_the_logits_processors(models, family, monkeypatch):
    """Greedy under logits processors: the head drafts its argmax after them.
    A processor that forces the successor of the last token makes every such
    draft right and the raw argmax's wrong (drafting that way is the
    control); both are lossless."""
    import mlx_spec.core.batch as engine

    def successor(tokens, logits):  # [1, V]: the last token + 1, always
        forced = (tokens[-1].astype(mx.int32) + 1) % logits.shape[-1]
        return mx.where(mx.arange(logits.shape[-1]) == forced, 100.0, logits)

    model, tok = models[family]
    procs = [successor]
    kw = dict(max_tokens=24, logits_processors=procs)
    want = [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, **kw)]

    def run():
        stats = SpecStats()
        out = stream_generate(
            model, tok, PROMPT, draft="mtp", num_draft_tokens=3, stats=stats, **kw
        )
        assert [r.token for r in out] == want
        return stats

    processed = run()
    assert processed.accepted == processed.drafted > 0
    monkeypatch.setattr(engine, "make_draft_sampler", lambda *_: None)
    raw = run()
    assert raw.accepted < raw.drafted / 4


@pytest.mark.parametrize("temp, judged", [(0.0, True), (0.8, False)])
def test_greedy_rows_under_processors_are_judged_in_hindsight(models, temp, judged):
    """Greedy under a logits processor the head's rows are still judged (its
    raw argmax stands for the processed one, an estimate ``auto`` learns
    from); sampling, a draft is judged only when verified."""
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_spec.core.sampling import make_sampler

    model, tok = models["qwen3_next"]
    drafter = MTPDrafter(model.mtp_head)
    assert drafter.hindsight() == {}  # asking turns judging on
    steps = Session(model, DecodeOptions(drafter, num_draft_tokens=0)).generate(
        tok.encode(COPY_PROMPT),
        max_tokens=8,
        sampler=make_sampler(temp),
        logits_processors=make_logits_processors(repetition_penalty=1.5),
    )
    list(steps)
    assert bool(drafter.hindsight()) == judged
