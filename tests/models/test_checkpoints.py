"""Tests for mlx_spec.testing.checkpoints: raw-HF tiny Qwen3-Next / Qwen3.5 checkpoints."""

import json
import re

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from safetensors.numpy import load_file

from mlx_spec.models.mtp import MTP_NORMS  # the seven norms the loader shifts
from mlx_spec.testing.checkpoints import (
    EOS_TOKEN,
    EOS_TOKEN_ID,
    FAMILIES,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer,
    eos_token_id,
    tensor_shapes,
    write_tiny_checkpoint,
)

# Default dims, spelled out independently of the module.
H, NQ, NKV, HD = 64, 4, 2, 32
NK, NV, DK, DV, K = 2, 4, 32, 32, 4
E, MOE_I, SHARED_I, DENSE_I, VOCAB = 8, 32, 32, 128, 512
KEY_DIM, VALUE_DIM = NK * DK, NV * DV
CONV_DIM = 2 * KEY_DIM + VALUE_DIM

PREFIX = {
    "qwen3_next": "model.",
    "qwen3_5": "model.language_model.",
    "qwen3_5_moe": "model.language_model.",
}
ZERO_CENTRED = re.compile(
    r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|pre_fc_norm_\w+)"
    r"\.weight$|(^|\.)norm\.weight$"
)


def _swiglu(p, inter):
    return {
        f"{p}gate_proj.weight": (inter, H),
        f"{p}up_proj.weight": (inter, H),
        f"{p}down_proj.weight": (H, inter),
    }


def expected_mtp(family):
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * NQ * HD, H),
        "mtp.layers.0.self_attn.k_proj.weight": (NKV * HD, H),
        "mtp.layers.0.self_attn.v_proj.weight": (NKV * HD, H),
        "mtp.layers.0.self_attn.o_proj.weight": (H, NQ * HD),
        "mtp.layers.0.self_attn.q_norm.weight": (HD,),
        "mtp.layers.0.self_attn.k_norm.weight": (HD,),
    }
    shapes.update({n: (H,) for n in MTP_NORMS if "self_attn" not in n})
    p = "mtp.layers.0.mlp."
    if family == "qwen3_5":
        shapes.update(_swiglu(p, DENSE_I))
        return shapes
    shapes[f"{p}gate.weight"] = (E, H)
    shapes[f"{p}shared_expert_gate.weight"] = (1, H)
    shapes.update(_swiglu(f"{p}shared_expert.", SHARED_I))
    if family == "qwen3_next":
        for e in range(E):
            shapes.update(_swiglu(f"{p}experts.{e}.", MOE_I))
    else:
        shapes[f"{p}experts.gate_up_proj"] = (E, 2 * MOE_I, H)
        shapes[f"{p}experts.down_proj"] = (E, H, MOE_I)
    return shapes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """family -> (path, file tensors, model, tokenizer), written and loaded once."""
    cache = {}

    def get(family):
        if family not in cache:
            path = write_tiny_checkpoint(tmp_path_factory.mktemp(family), family)
            model, tok = mlx_lm.load(str(path))
            cache[family] = (
                path,
                load_file(str(path / "model.safetensors")),
                model,
                tok,
            )
        return cache[family]

    return get


def _greedy(model, tok, n=24, prompt="def main(argv):\n    return"):
    ids = mx.array(tok.encode(prompt))
    return [int(t) for (t, _), _ in zip(generate_step(ids, model), range(n))]


@pytest.mark.parametrize("family", FAMILIES)
def test_load_and_greedy_generation_is_varied(ckpt, family):
    _, _, model, tok = ckpt(family)
    tokens = _greedy(model, tok)
    assert len(tokens) == 24
    assert len(set(tokens)) >= 6, tokens
    text = mlx_lm.generate(model, tok, "import os\n", max_tokens=8)
    assert isinstance(text, str)


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_tensors(ckpt, family):
    _, tensors, _, _ = ckpt(family)
    mtp = {k: v.shape for k, v in tensors.items() if k.startswith("mtp.")}
    assert mtp == expected_mtp(family)
    assert not any("mtp." in k and not k.startswith("mtp.") for k in tensors)
    assert all(v.dtype == np.float32 for v in tensors.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_backbone_layout(ckpt, family):
    path, tensors, _, _ = ckpt(family)
    p = PREFIX[family]
    assert all(
        k.startswith(p) or k.startswith("mtp.") or k == "lm_head.weight"
        for k in tensors
    )
    assert tensors[f"{p}embed_tokens.weight"].shape == (VOCAB, H)
    assert ("lm_head.weight" in tensors) == (family != "qwen3_5")
    assert tensor_shapes(family) == {k: v.shape for k, v in tensors.items()}
    # layers 0-2 are GDN, layer 3 is gated attention
    for i in range(3):
        la = f"{p}layers.{i}.linear_attn."
        assert tensors[la + "conv1d.weight"].shape == (CONV_DIM, 1, K)
        assert tensors[la + "A_log"].shape == (NV,)
        assert tensors[la + "dt_bias"].shape == (NV,)
        assert tensors[la + "out_proj.weight"].shape == (H, VALUE_DIM)
        a = np.exp(tensors[la + "A_log"])
        assert np.all((a >= 1) & (a <= 16))
        if family == "qwen3_next":
            assert tensors[la + "in_proj_qkvz.weight"].shape == (
                2 * KEY_DIM + 2 * VALUE_DIM,
                H,
            )
            assert tensors[la + "in_proj_ba.weight"].shape == (2 * NV, H)
        else:
            assert tensors[la + "in_proj_qkv.weight"].shape == (CONV_DIM, H)
            assert tensors[la + "in_proj_z.weight"].shape == (VALUE_DIM, H)
            assert tensors[la + "in_proj_b.weight"].shape == (NV, H)
            assert tensors[la + "in_proj_a.weight"].shape == (NV, H)
    assert not any(k.startswith(f"{p}layers.3.linear_attn") for k in tensors)
    assert tensors[f"{p}layers.3.self_attn.q_proj.weight"].shape == (2 * NQ * HD, H)
    mlp = f"{p}layers.1.mlp."
    if family == "qwen3_next":
        assert tensors[mlp + "experts.7.down_proj.weight"].shape == (H, MOE_I)
        assert tensors[mlp + "shared_expert_gate.weight"].shape == (1, H)
    elif family == "qwen3_5_moe":
        assert tensors[mlp + "experts.gate_up_proj"].shape == (E, 2 * MOE_I, H)
        assert tensors[mlp + "experts.down_proj"].shape == (E, H, MOE_I)
    else:
        assert tensors[mlp + "gate_proj.weight"].shape == (DENSE_I, H)
        assert not any(".experts." in k for k in tensors)


def test_configs(tmp_path):
    nxt = json.loads(
        (
            write_tiny_checkpoint(tmp_path / "n", "qwen3_next") / "config.json"
        ).read_text()
    )
    assert nxt["model_type"] == "qwen3_next"
    assert nxt["architectures"] == ["Qwen3NextForCausalLM"]
    assert nxt["decoder_sparse_step"] == 1 and nxt["mlp_only_layers"] == []
    assert (
        nxt["num_experts"] == E and nxt["shared_expert_intermediate_size"] == SHARED_I
    )
    assert nxt["tie_word_embeddings"] is False and "text_config" not in nxt
    for family in ("qwen3_5", "qwen3_5_moe"):
        cfg = json.loads(
            (
                write_tiny_checkpoint(tmp_path / family, family) / "config.json"
            ).read_text()
        )
        text = cfg["text_config"]
        assert cfg["model_type"] == family and text["model_type"] == f"{family}_text"
        assert text["mtp_num_hidden_layers"] == 1
        assert text["mtp_use_dedicated_embeddings"] is False
        rope = text["rope_parameters"]
        assert rope["rope_type"] == "default" and rope["partial_rotary_factor"] == 0.25
        assert "rope_theta" in rope and sum(rope["mrope_section"]) == HD // 8
        assert cfg["tie_word_embeddings"] == text["tie_word_embeddings"]
        assert cfg["tie_word_embeddings"] == (family == "qwen3_5")
        assert text["full_attention_interval"] == 4 and text["num_hidden_layers"] == 4
        assert cfg["eos_token_id"] == EOS_TOKEN_ID == eos_token_id(tmp_path / family)
    assert text["norm_topk_prob"] is True and text["num_experts_per_tok"] == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_zero_centred_and_shifted_once_by_mlx_lm(ckpt, family):
    _, tensors, model, _ = ckpt(family)
    norms = {
        k: v
        for k, v in tensors.items()
        if ZERO_CENTRED.search(k) and ".linear_attn." not in k
    }
    assert set(MTP_NORMS) <= set(norms)
    assert len(norms) == 2 * 4 + 2 + 1 + len(MTP_NORMS)  # 4 layers, 1 attn, final
    for name, w in norms.items():
        assert np.mean(np.abs(w)) < 0.4, name
        assert np.std(w) > 0.05, name
    for name, w in tensors.items():
        if name.endswith("linear_attn.norm.weight"):
            assert abs(float(np.mean(w)) - 1.0) < 0.1, name
    loaded = dict(tree_flatten(model.parameters()))
    checked = 0
    for name, w in norms.items():
        if name.startswith("mtp."):
            continue
        key = name.replace("model.language_model.", "language_model.model.")
        np.testing.assert_allclose(np.array(loaded[key]), w + 1.0, rtol=0, atol=1e-6)
        checked += 1
    assert checked == len(norms) - len(MTP_NORMS)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer(ckpt, family):
    path, _, _, tok = ckpt(family)
    assert tok.eos_token_ids == {EOS_TOKEN_ID}
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == EOS_TOKEN_ID
    assert tok.pad_token_id == EOS_TOKEN_ID
    assert len(tok.get_vocab()) == TOKENIZER_VOCAB_SIZE
    raw = build_tokenizer()
    assert raw.get_vocab_size() == TOKENIZER_VOCAB_SIZE
    for s in [
        "def fibonacci(n: int) -> int:\n    return n\n",
        "  x = {'a': [1, 2.5]}\t# comment\r\n\n",
        "héllo wörld, 日本語 🙂 ß",
        f"a{EOS_TOKEN}b",
        "",
    ]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert ids == raw.encode(s).ids
    assert tok.encode(EOS_TOKEN) == [EOS_TOKEN_ID]
    assert len(tok.encode("def main(argv):")) < len("def main(argv):")  # merges apply
    assert json.loads((path / "tokenizer_config.json").read_text())[
        "tokenizer_class"
    ] == ("PreTrainedTokenizerFast")


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", "qwen3_5_moe", seed=3)
    b = write_tiny_checkpoint(tmp_path / "b", "qwen3_5_moe", seed=3)
    c = write_tiny_checkpoint(tmp_path / "c", "qwen3_5_moe", seed=4)
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    ta = load_file(str(a / "model.safetensors"))
    tc = load_file(str(c / "model.safetensors"))
    assert ta.keys() == tc.keys()
    for k in ta:
        assert not np.array_equal(ta[k], tc[k]), k


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_loads(tmp_path, family):
    path = write_tiny_checkpoint(tmp_path, family, dtype="bfloat16")
    stored = mx.load(str(path / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in stored.values())
    model, tok = mlx_lm.load(str(path))
    assert all(v.dtype == mx.bfloat16 for _, v in tree_flatten(model.parameters()))
    if family == "qwen3_5" or mx.default_device() != mx.cpu:
        # MLX's CPU gather_mm (the MoE experts) only runs in float32.
        assert len(set(_greedy(model, tok, n=12))) >= 3


def test_float16_loads(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_5", dtype="float16")
    tensors = load_file(str(path / "model.safetensors"))
    assert all(v.dtype == np.float16 for v in tensors.values())
    model, tok = mlx_lm.load(str(path))
    assert len(set(_greedy(model, tok, n=12))) >= 3


def test_overrides_eight_layers(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_next", num_hidden_layers=8)
    shapes = tensor_shapes("qwen3_next", num_hidden_layers=8)
    gdn = {int(k.split(".")[2]) for k in shapes if ".linear_attn." in k}
    attn = {
        int(k.split(".")[2])
        for k in shapes
        if k.startswith("model.") and ".self_attn." in k
    }
    assert gdn == {0, 1, 2, 4, 5, 6} and attn == {3, 7}
    model, tok = mlx_lm.load(str(path))
    assert len(model.layers) == 8
    assert len(set(_greedy(model, tok, n=12))) >= 3


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="qwen4"):
        write_tiny_checkpoint(tmp_path, "qwen4")
    with pytest.raises(ValueError, match="int8"):
        write_tiny_checkpoint(tmp_path, "qwen3_5", dtype="int8")
    with pytest.raises(ValueError, match="hidden_sise"):
        write_tiny_checkpoint(tmp_path, "qwen3_5", hidden_sise=32)
    with pytest.raises(ValueError, match="num_experts"):
        write_tiny_checkpoint(tmp_path, "qwen3_5", num_experts=4)
    with pytest.raises(ValueError, match="vocab_size"):
        write_tiny_checkpoint(tmp_path, "qwen3_5", vocab_size=100)


def test_checkpoints_stay_tiny(tmp_path):
    """What keeps every test that writes checkpoints quick, without timing
    anything: a few hundred thousand parameters per family, about 4 bytes each."""
    for family in FAMILIES:
        params = sum(int(np.prod(s)) for s in tensor_shapes(family).values())
        assert 100_000 < params < 1_000_000, (family, params)
        path = write_tiny_checkpoint(tmp_path / family, family)
        size = (path / "model.safetensors").stat().st_size
        assert size < 4 * params + 64 * 1024, (family, size)
