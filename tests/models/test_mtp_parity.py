"""The MTP head against an independent numpy forward written from docs/mtp_head.md.

The reference reads the RAW tensors of the checkpoint file (zero-centred norms,
per-expert or fused experts) and implements the forward of docs/mtp_head.md
in float64; it shares no code with ``mlx_spec.models.mtp``. The only thing taken
from MLX is the target's hidden state, which is the input of both.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mlx_spec
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.models.mtp import MTPKVCache
from mlx_spec.testing.checkpoints import FAMILIES, write_tiny_checkpoint

PROMPT = "def fibonacci(n: int) -> int:\n    a, b = 0, 1"
REL_TOL = 1e-4


def rms1p(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class NumpyMTP:
    """The head step of docs/mtp_head.md, one call per block of rows, with its own KV cache."""

    def __init__(self, W, cfg, stored=None):
        self.W = {k: v.astype(np.float64) for k, v in W.items()}
        self.stored = stored  # the cache's stored dtype (None: exact)
        self.c = cfg.get("text_config", cfg)
        base = "model." if "model.embed_tokens.weight" in W else "model.language_model."
        self.embed = self.W[base + "embed_tokens.weight"]
        self.lm_head = self.W.get("lm_head.weight", self.embed)
        self.keys, self.values = [], []  # per position: [kv_heads, head_dim]

    def w(self, name):
        return self.W["mtp." + name]

    def rope(self, x, pos):
        # x: [L, heads, hd]; NeoX rotate_half on the first rot dims.
        c = self.c
        theta = c.get("rope_theta") or c["rope_parameters"]["rope_theta"]
        prf = (
            c.get("partial_rotary_factor")
            or c["rope_parameters"]["partial_rotary_factor"]
        )
        rot = int(c["head_dim"] * prf)
        inv = theta ** (-np.arange(0, rot, 2) / rot)  # [rot/2]
        ang = pos[:, None, None] * inv[None, None, :]
        x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
        out = x.copy()
        out[..., : rot // 2] = x1 * np.cos(ang) - x2 * np.sin(ang)
        out[..., rot // 2 : rot] = x2 * np.cos(ang) + x1 * np.sin(ang)
        return out

    def experts(self):
        p = "layers.0.mlp.experts."
        if "mtp." + p + "gate_up_proj" in self.W:
            gu, down = self.w(p + "gate_up_proj"), self.w(p + "down_proj")
            inter = gu.shape[1] // 2
            return [(gu[e, :inter], gu[e, inter:], down[e]) for e in range(gu.shape[0])]
        return [
            tuple(
                self.w(f"{p}{e}.{n}.weight")
                for n in ("gate_proj", "up_proj", "down_proj")
            )
            for e in range(self.c["num_experts"])
        ]

    def mlp(self, m):
        p = "layers.0.mlp."
        swiglu = lambda x, g, u, d: (silu(x @ g.T) * (x @ u.T)) @ d.T  # noqa: E731
        if "mtp." + p + "gate.weight" not in self.W:
            return swiglu(
                m,
                *(
                    self.w(p + n + ".weight")
                    for n in ("gate_proj", "up_proj", "down_proj")
                ),
            )
        logits = m @ self.w(p + "gate.weight").T  # [L, E]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1)[:, : self.c["num_experts_per_tok"]]
        experts = self.experts()
        out = np.zeros_like(m)
        for i in range(m.shape[0]):
            wts = probs[i, top[i]]
            if self.c.get("norm_topk_prob", False):
                wts = wts / wts.sum()
            for e, wt in zip(top[i], wts):
                out[i] += wt * swiglu(m[i : i + 1], *experts[e])[0]
        sh = [
            self.w(f"{p}shared_expert.{n}.weight")
            for n in ("gate_proj", "up_proj", "down_proj")
        ]
        gate = sigmoid(m @ self.w(p + "shared_expert_gate.weight").T)  # [L, 1]
        return out + gate * swiglu(m, *sh)

    def __call__(self, tokens, hidden):
        """tokens: [L]; hidden: [L, H] -> (logits [L, V], post-norm hidden [L, H])."""
        c, eps = self.c, self.c["rms_norm_eps"]
        nq, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        L = len(tokens)
        e = self.embed[np.asarray(tokens)]
        x = (
            np.concatenate(
                [
                    rms1p(e, self.w("pre_fc_norm_embedding.weight"), eps),
                    rms1p(hidden, self.w("pre_fc_norm_hidden.weight"), eps),
                ],
                axis=-1,
            )
            @ self.w("fc.weight").T
        )
        a = rms1p(x, self.w("layers.0.input_layernorm.weight"), eps)
        at = "layers.0.self_attn."
        qg = (a @ self.w(at + "q_proj.weight").T).reshape(L, nq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]  # per-head split
        q = rms1p(q, self.w(at + "q_norm.weight"), eps)
        k = rms1p(
            (a @ self.w(at + "k_proj.weight").T).reshape(L, nkv, hd),
            self.w(at + "k_norm.weight"),
            eps,
        )
        v = (a @ self.w(at + "v_proj.weight").T).reshape(L, nkv, hd)
        start = len(self.keys)
        pos = np.arange(start, start + L, dtype=np.float64)
        q, k = self.rope(q, pos), self.rope(k, pos)
        if self.stored is not None:  # rounded as the head's cache stores them
            k, v = (a.astype(self.stored).astype(np.float64) for a in (k, v))
        self.keys += list(k)
        self.values += list(v)
        K, V = np.stack(self.keys), np.stack(self.values)  # [T, kv, hd]
        o = np.zeros((L, nq, hd))
        for i in range(L):
            T = start + i + 1  # causal: positions 0..start+i
            for h in range(nq):
                kvh = h // (nq // nkv)
                s = K[:T, kvh] @ q[i, h] / np.sqrt(hd)
                p = np.exp(s - s.max())
                o[i, h] = (p / p.sum()) @ V[:T, kvh]
        o = (o * sigmoid(gate)).reshape(L, nq * hd)
        x = x + o @ self.w(at + "o_proj.weight").T
        x = x + self.mlp(
            rms1p(x, self.w("layers.0.post_attention_layernorm.weight"), eps)
        )
        hm = rms1p(x, self.w("norm.weight"), eps)
        return hm @ self.lm_head.T, hm


def assert_close(got, ref, what):
    got = np.asarray(got, dtype=np.float64)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < REL_TOL, f"{what}: relative error {err:.2e}"


def _check(path):
    model, tok = mlx_spec.load(path)
    W = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    tokens = tok.encode(PROMPT)
    hidden = model.model(mx.array(tokens[:-1])[None])[0]  # [N-1, H]
    hidden_np = np.array(hidden, dtype=np.float64)

    # Prefill: every row of the head against the reference, with the cache
    # stored in float16 (where the attention kernel reads it) and as computed.
    head = model.mtp_head
    # The drafter below runs with the last (the CPU's: no Metal here).
    for stored, rounded in ((mx.float16, np.float16), (None, None)):
        ref = NumpyMTP(W, cfg, rounded)
        ref_logits, ref_hm = ref(tokens[1:], hidden_np)
        cache = [MTPKVCache(stored)]
        logits, hm = head(mx.array(tokens[1:])[None], hidden[None], cache)
        assert_close(logits[0], ref_logits, f"prefill logits ({stored})")
        assert_close(hm[0], ref_hm, f"prefill hidden ({stored})")

    # Drafting: d_1 from the last prefill row, then 3 chained steps.
    drafter = MTPDrafter(head)
    drafter.reset(tokens, hidden)
    drafts = drafter.draft(4)
    rows, ref_tokens = [ref_logits[-1]], []
    h = ref_hm[-1:]
    for _ in range(3):
        ref_tokens.append(int(np.argmax(rows[-1])))
        step_logits, h = ref([ref_tokens[-1]], h)
        rows.append(step_logits[0])
    ref_tokens.append(int(np.argmax(rows[-1])))
    assert drafts == ref_tokens
    assert drafter.last_draft_logits.shape == (
        4,
        cfg.get("text_config", cfg)["vocab_size"],
    )
    assert_close(drafter.last_draft_logits, np.stack(rows), "draft logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_head_matches_numpy_reference(tmp_path, family):
    _check(write_tiny_checkpoint(tmp_path / family, family, seed=3))


def test_per_expert_layout_of_qwen3_5_moe(tmp_path):
    """Some qwen3_5_moe releases ship per-expert MTP experts: same forward."""
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3_5_moe", seed=4)
    file = path / "model.safetensors"
    W = load_file(str(file))
    p = "mtp.layers.0.mlp.experts."
    gate_up, down = W.pop(p + "gate_up_proj"), W.pop(p + "down_proj")
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        W[f"{p}{e}.gate_proj.weight"] = np.ascontiguousarray(gate_up[e, :inter])
        W[f"{p}{e}.up_proj.weight"] = np.ascontiguousarray(gate_up[e, inter:])
        W[f"{p}{e}.down_proj.weight"] = np.ascontiguousarray(down[e])
    save_file(W, str(file), metadata={"format": "pt"})
    _check(path)
