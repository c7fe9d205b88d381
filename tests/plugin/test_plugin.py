"""``mlx_spec.plugin``: mlx-lm's own ``stream_generate`` and ``generate``,
called as a user's script calls them, give mlx-lm's greedy tokens with the
plugin on while drafts are accepted; a call the plugin does not cover runs
mlx-lm's own code; ``disable()`` puts mlx-lm's objects back."""

import sys
from types import SimpleNamespace

import mlx.core as mx
import mlx_lm
import mlx_lm.chat  # noqa: F401 (the modules whose names the plugin replaces)
import mlx_lm.server  # noqa: F401
import pytest
from mlx_lm.models import mamba
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import mlx_spec
from mlx_spec import plugin
from mlx_spec.demo import default_model_path
from mlx_spec.mlx_lm_compat import load as plain_load
from mlx_spec.mlx_lm_compat import plain_stream_generate
from mlx_spec.testing.attention_only import write_llama_checkpoint
from mlx_spec.testing.checkpoints import FAMILIES, TOKENIZER_VOCAB_SIZE
from mlx_spec.testing.reference import OracleDrafter, cache_arrays, prompts

MAX_TOKENS = 24
# Prompts that repeat themselves: n-gram copies are drafted and, on a random
# model whose greedy output loops, accepted.
PROMPTS = [prompts("repetitive", n=20, seed=1), prompts("mixed", n=16, seed=2)]


@pytest.fixture(scope="module")
def loaded(checkpoint_dirs):
    """family -> (reference, served): two copies of one checkpoint loaded by
    ``mlx_lm.load``: the reference never meets the plugin, so it runs
    exactly mlx-lm's code, while the plugin speculates on the served one."""
    return {
        f: (mlx_lm.load(str(p)), mlx_lm.load(str(p)))
        for f, p in checkpoint_dirs.items()
    }


def mlx_lm_tokens(model, tok, prompt, **kwargs):
    return [
        r.token
        for r in mlx_lm.stream_generate(
            model, tok, mx.array(prompt), max_tokens=MAX_TOKENS, **kwargs
        )
    ]


def all_mlx_lm_modules():
    return {n: m for n, m in sys.modules.items() if n.split(".")[0] == "mlx_lm"}


def test_enable_replaces_stream_generate_everywhere_mlx_lm_holds_it():
    holders = [
        name
        for name, m in all_mlx_lm_modules().items()
        if getattr(m, "stream_generate", None) is plain_stream_generate
    ]
    plugin.enable()
    assert {"mlx_lm", "mlx_lm.generate", "mlx_lm.chat", "mlx_lm.server"} <= {
        name
        for name, m in all_mlx_lm_modules().items()
        if getattr(m, "stream_generate", None) is plugin.routed_stream_generate
    }
    plugin.disable()
    for name in holders:
        assert sys.modules[name].stream_generate is plain_stream_generate, name


def test_disable_restores_mlx_lms_objects():
    server = sys.modules["mlx_lm.server"]
    batchable = server.ResponseGenerator.__dict__["_is_batchable"]
    plugin.enable(num_draft_tokens=3)
    plugin.enable(draft="ngram")  # enabling twice keeps one set of originals
    assert server.ResponseGenerator.__dict__["_is_batchable"] is not batchable
    assert server.load is plugin.routed_load and mlx_lm.load is plugin.routed_load
    assert sys.modules["mlx_lm.utils"].load is plain_load
    plugin.disable()
    plugin.disable()
    assert not plugin.is_enabled()
    assert server.ResponseGenerator.__dict__["_is_batchable"] is batchable
    generate_module = sys.modules["mlx_lm.generate"]
    for module in (mlx_lm, generate_module, sys.modules["mlx_lm.chat"], server):
        assert module.stream_generate is plain_stream_generate
        assert module.load is plain_load
    # never replaced: convert, fuse and the quantizers import it from there
    assert sys.modules["mlx_lm.utils"].load is plain_load
    assert generate_module.generate_step is mlx_lm_generate_step()


def test_a_module_imported_after_enabling_is_routed_by_enabling_again():
    """An mlx-lm module the plugin had not seen (imported since), holding
    mlx-lm's function, is routed by enabling again, and restored by
    disable()."""
    plugin.enable()
    late = type(sys)("mlx_lm._imported_late")
    late.stream_generate = plain_stream_generate  # imported before enabling
    sys.modules[late.__name__] = late
    try:
        plugin.enable()
        assert late.stream_generate is plugin.routed_stream_generate
        plugin.disable()
        assert late.stream_generate is plain_stream_generate
    finally:
        del sys.modules[late.__name__]


def test_a_routed_function_kept_after_disable_runs_mlx_lms_code(loaded):
    (ref, ref_tok), (model, tok) = loaded["qwen3_next"]
    want = mlx_lm_tokens(ref, ref_tok, PROMPTS[0])
    state = plugin.enable()
    kept = mlx_lm.stream_generate  # as `from mlx_lm import stream_generate`
    plugin.disable()
    tokens = [r.token for r in kept(model, tok, mx.array(PROMPTS[0]), MAX_TOKENS)]
    assert tokens == want and not state.decisions


def mlx_lm_generate_step():
    from mlx_spec.mlx_lm_compat import generate_step

    return generate_step


@pytest.mark.parametrize("k", [3, "auto"])
@pytest.mark.parametrize("family", FAMILIES)
def test_stream_generate_greedy_tokens_are_mlx_lms(loaded, family, k):
    (ref, ref_tok), (model, tok) = loaded[family]
    want = [mlx_lm_tokens(ref, ref_tok, p) for p in PROMPTS]
    state = plugin.enable(num_draft_tokens=k)
    got, drafted = [], 0
    for p in PROMPTS:
        responses = list(
            mlx_lm.stream_generate(model, tok, mx.array(p), max_tokens=MAX_TOKENS)
        )
        got.append([r.token for r in responses])
        # the fields mlx-lm's consumers read, with mlx-lm's meaning
        last = responses[-1]
        assert last.generation_tokens == len(responses)
        assert last.prompt_tokens == len(p)
        assert last.finish_reason in ("length", "stop")
        assert last.stats is state.last_stats
        drafted += state.last_stats.drafted
    assert got == want
    assert state.decisions == {"covered": len(PROMPTS)}
    if k != "auto":  # auto drafts where the measured costs say it pays
        assert drafted > 0  # n-gram copies of the repeated prompt were verified


@pytest.mark.parametrize("family", FAMILIES)
def test_accepted_drafts_keep_mlx_lms_tokens(loaded, family):
    """A drafter that knows the answer and errs a third of the time (a
    random model's output rarely repeats itself, so n-gram copies are seldom
    right): full, partial and no acceptance, mlx-lm's tokens throughout."""
    (ref, ref_tok), (model, tok) = loaded[family]
    prompt = PROMPTS[1]
    want = mlx_lm_tokens(ref, ref_tok, prompt)
    oracle = OracleDrafter(prompt + want, error=0.3, seed=1)
    state = plugin.enable(draft=oracle, num_draft_tokens=4)
    assert mlx_lm_tokens(model, tok, prompt) == want
    stats = state.last_stats
    assert 0 < stats.accepted < stats.drafted
    assert stats.verify_passes < len(want)  # fewer passes than tokens


def test_generate_text_is_mlx_lms_and_prompt_cache_reuse_is_exact(loaded):
    (ref, ref_tok), (model, tok) = loaded["qwen3_next"]
    ref_cache = make_prompt_cache(ref)
    want = [mlx_lm_tokens(ref, ref_tok, p, prompt_cache=ref_cache) for p in PROMPTS]
    want_text = mlx_lm.generate(ref, ref_tok, PROMPTS[0], max_tokens=MAX_TOKENS)

    state = plugin.enable(num_draft_tokens=3)
    cache = make_prompt_cache(model)
    got = [mlx_lm_tokens(model, tok, p, prompt_cache=cache) for p in PROMPTS]
    assert got == want
    ours, theirs = cache_arrays(cache), cache_arrays(ref_cache)
    assert all(mx.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert mlx_lm.generate(model, tok, PROMPTS[0], max_tokens=MAX_TOKENS) == want_text
    assert state.decisions == {"covered": len(PROMPTS) + 1}


def test_a_prompt_cache_goes_on_under_mlx_lm_after_a_speculated_turn(loaded):
    """A conversation's cache, its first turn speculated on and its second
    decoded by mlx-lm (the plugin turned off between them): mlx-lm's
    tokens, and its caches, array for array."""
    (ref, ref_tok), (model, tok) = loaded["qwen3_5_moe"]
    ref_cache = make_prompt_cache(ref)
    want = [mlx_lm_tokens(ref, ref_tok, p, prompt_cache=ref_cache) for p in PROMPTS]
    cache = make_prompt_cache(model)
    plugin.enable(num_draft_tokens=3)
    got = [mlx_lm_tokens(model, tok, PROMPTS[0], prompt_cache=cache)]
    plugin.disable()
    got.append(mlx_lm_tokens(model, tok, PROMPTS[1], prompt_cache=cache))
    assert got == want
    ours, theirs = cache_arrays(cache), cache_arrays(ref_cache)
    assert all(mx.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(
    "options",
    [
        # deterministic samplings whose verification is not the greedy match
        dict(logits_processors=make_logits_processors(repetition_penalty=1.5)),
        dict(sampler=make_sampler(temp=0.7, top_k=1)),
        dict(kv_bits=4, kv_group_size=32, quantized_kv_start=20),
        dict(prefill_step_size=5),
    ],
    ids=["penalty", "top-k-1", "kv-bits", "prefill-step"],
)
def test_mlx_lms_options_are_honoured(loaded, options):
    (ref, ref_tok), (model, tok) = loaded["qwen3_5"]
    prompt = PROMPTS[1]
    want = mlx_lm_tokens(ref, ref_tok, prompt, **options)
    oracle = OracleDrafter(prompt + want, error=0.3, seed=2)
    state = plugin.enable(draft=oracle, num_draft_tokens=3)
    assert mlx_lm_tokens(model, tok, prompt, **options) == want
    stats = state.last_stats
    assert state.decisions == {"covered": 1} and 0 < stats.accepted < stats.drafted


@pytest.mark.slow
def test_demo_model_loaded_by_mlx_lm_drafts_with_its_mtp_head():
    """mlx-lm's own ``load`` under the plugin attaches the head (and, on the
    CPU, casts the bf16 experts to float32, without which mlx-lm cannot run
    them there): ``mlx_lm.generate`` then drafts with it, mlx-lm's text."""
    ref, ref_tok = mlx_spec.load(default_model_path())  # mlx-lm's computation
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    "
    want = mlx_lm.generate(ref, ref_tok, prompt, max_tokens=40)
    # draft="auto": the head, with n-gram copies; a fixed length, so that
    # drafts are made whatever this machine's costs say
    state = plugin.enable(num_draft_tokens=3)
    model, tok = mlx_lm.load(str(default_model_path()))
    assert model.mtp_head is not None
    assert mlx_lm.generate(model, tok, prompt, max_tokens=40) == want
    assert state.decisions == {"covered": 1}
    stats = state.last_stats
    assert stats.accepted > 0 and stats.verify_passes < 40


def test_mlx_lms_load_is_its_own_when_the_plugin_is_off(checkpoint_dirs):
    path = str(checkpoint_dirs["qwen3_next"])
    plugin.enable()
    plugin.disable()
    model, _ = mlx_lm.load(path)
    assert "mtp_head" not in model.__dict__
    plugin.enable()
    model, _, config = mlx_lm.load(path, return_config=True)  # mlx-lm's result
    assert config["model_type"] == "qwen3_next" and "mtp_head" in model.__dict__


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_llama_checkpoint(tmp_path_factory.mktemp("llama"))
    return mlx_lm.load(str(path)), mlx_lm.load(str(path))


def test_attention_only_model_is_covered(llama):
    (ref, ref_tok), (model, tok) = llama
    want = mlx_lm_tokens(ref, ref_tok, PROMPTS[0])
    state = plugin.enable(num_draft_tokens=4)
    assert mlx_lm_tokens(model, tok, PROMPTS[0]) == want
    assert state.decisions == {"covered": 1}


def test_a_draft_model_call_runs_mlx_lms_own_speculation(llama):
    (ref, ref_tok), (model, tok) = llama
    want = [
        (r.token, r.from_draft)
        for r in mlx_lm.stream_generate(
            ref, ref_tok, mx.array(PROMPTS[0]), max_tokens=MAX_TOKENS, draft_model=ref
        )
    ]
    state = plugin.enable()
    got = [
        (r.token, r.from_draft)
        for r in mlx_lm.stream_generate(
            model, tok, mx.array(PROMPTS[0]), max_tokens=MAX_TOKENS, draft_model=model
        )
    ]
    assert got == want and any(from_draft for _, from_draft in got)
    assert list(state.decisions) == ["draft_model: mlx-lm's own speculative decoding"]
    assert state.last_stats is None


def test_uncovered_arguments_run_mlx_lms_code(llama):
    (ref, ref_tok), (model, tok) = llama
    want = mlx_lm_tokens(ref, ref_tok, PROMPTS[0], max_kv_size=8)
    state = plugin.enable()
    assert mlx_lm_tokens(model, tok, PROMPTS[0], max_kv_size=8) == want
    with pytest.raises(TypeError, match="no_such_option"):
        mlx_lm_tokens(model, tok, PROMPTS[0], no_such_option=1)
    assert state.decisions == {
        "argument 'max_kv_size'": 1,
        "argument 'no_such_option'": 1,
    }


@pytest.fixture(scope="module")
def recurrent_model(loaded):
    """A tiny mamba: its recurrent caches cannot be rolled back, so mlx-spec
    cannot speculate on it (the tokenizer is the tiny checkpoints')."""
    mx.random.seed(0)
    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )
    model = mamba.Model(args)
    mx.eval(model.parameters())
    return model, loaded["qwen3_next"][0][1]


def test_an_unsupported_model_type_runs_mlx_lms_code(recurrent_model):
    model, tok = recurrent_model
    want = mlx_lm_tokens(model, tok, PROMPTS[1])
    state = plugin.enable()
    assert mlx_lm_tokens(model, tok, PROMPTS[1]) == want
    (reason,) = state.decisions
    assert reason.startswith("model type 'mamba'") and "rolled back" in reason


def test_the_server_batches_only_what_the_plugin_does_not_cover(
    loaded, recurrent_model
):
    """mlx-lm's batched path never speculates: a covered model's requests
    take its per-request path (stream_generate) while the plugin is on."""
    server = sys.modules["mlx_lm.server"]

    def batchable(model):
        generator = SimpleNamespace(
            model_provider=SimpleNamespace(model=model, is_batchable=True),
            cli_args=SimpleNamespace(kv_bits=None),
        )
        args = SimpleNamespace(seed=None)
        return server.ResponseGenerator._is_batchable(generator, args)

    covered, uncovered = loaded["qwen3_5"][1][0], recurrent_model[0]
    assert batchable(covered) and batchable(uncovered)
    plugin.enable()
    assert not batchable(covered) and batchable(uncovered)
    plugin.disable()
    assert batchable(covered)


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(draft="eagle"), "unknown draft 'eagle'"),
        (dict(num_draft_tokens=99), "got 99"),
        (dict(num_draft_tokens=9), "got 9"),  # "auto" may draft with a head
        (dict(draft="ngram", num_draft_tokens=17), "got 17"),
    ],
)
def test_bad_options_are_refused_when_enabling(options, named):
    with pytest.raises(ValueError, match=named):
        plugin.enable(**options)
    assert not plugin.is_enabled()


def test_an_untested_mlx_lm_is_warned_about_and_still_routed(monkeypatch):
    monkeypatch.setattr(plugin, "MLX_LM_VERSION", "0.99.0")
    monkeypatch.setattr(plugin, "_warned", False)
    with pytest.warns(UserWarning, match="mlx-lm 0.99.0 is installed"):
        plugin.enable()
    assert mlx_lm.stream_generate is plugin.routed_stream_generate


def test_a_server_without_its_batching_test_is_warned_about(monkeypatch):
    """An mlx-lm whose server changed: the functions are still routed, and
    the warning says its batched requests are not speculated on."""
    monkeypatch.setattr(plugin, "server_response_generator", lambda: None)
    with pytest.warns(UserWarning, match="batched requests are not speculated"):
        plugin.enable()
    assert mlx_lm.stream_generate is plugin.routed_stream_generate
    plugin.disable()
    assert mlx_lm.stream_generate is plain_stream_generate
