"""A tiny checkpoint that speaks like an agent's model: a chat template with
tools, think tags, and a tool call it can be steered into.

Agent clients (the OpenAI Agents SDK, Codex, Claude Code) walk a tool-calling
conversation: the model calls a tool, the client runs it and sends the result
back, the model answers. A random tiny model never writes a tool call, so
:func:`write_agent_checkpoint` builds one whose greedy text is known:

- its tokenizer is the tiny byte-level BPE plus added tokens: the chat
  markers, ``<think>`` / ``</think>``, ``<tool_call>`` / ``</tool_call>``,
  ``<tool_response>`` / ``</tool_response>``, and whole phrases (the plan,
  the call's JSON, the answer) so that each piece of text is one token;
- its chat template renders system, user, assistant (reasoning and tool
  calls included) and tool messages the way Qwen's templates do, and names
  ``<tool_call>`` and ``tool_call.name``, so mlx-lm picks its JSON tool
  parser and the think tags make it a thinking model;
- it is a predictive checkpoint (:func:`write_cycle_checkpoint`'s recipe:
  the target is close to a bigram model, the MTP head predicts it) whose
  output head holds two chains. After the generation prompt's last token
  (the newline after ``assistant``) it answers, :data:`ANSWER` then EOS. A
  stronger chain starts at ``<think>``: :data:`PLAN` inside think tags, then
  ``<tool_call>`` :data:`CALL` ``</tool_call>`` and EOS.

Nothing in the context makes this model choose the tool: a request that
wants the call adds :data:`CALL_BIAS` to ``<think>`` (``logit_bias``),
enough to beat the answer's first token and too little to leave the
stronger chain once in it. mlx-lm given the same bias decodes the same
tokens, so the answers stay checkable against mlx-lm.
"""

import json
import pathlib
from typing import Dict, List, Union

import numpy as np
from safetensors.numpy import load_file, save_file

from .mtp_heads import write_predictive_checkpoint
from .tokenizer import EOS_TOKEN_ID, TOKENIZER_VOCAB_SIZE, tokenizer_config

TOOL_NAME = "get_weather"
TOOL_ARGUMENTS = {"city": "Paris"}
TOOL = {
    "name": TOOL_NAME,
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
SPECIAL = ["<|im_start|>", "<|im_end|>"]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
MARKERS += ["<tool_response>", "</tool_response>"]
PLAN = ["The user asks", " for the weather", " in Paris."]
CALL = ['{"name": "get_weather", ', '"arguments": ', '{"city": "Paris"}}']
ANSWER = ["It is sunny", " and 22 C", " in Paris today."]
ADDED = SPECIAL + MARKERS + PLAN + CALL + ANSWER
ANSWER_TEXT = "".join(ANSWER)
PLAN_TEXT = "".join(PLAN)
CALL_BIAS = 20.0  # added to <think>'s logit: the model then calls the tool
# the chains' strengths (logit scale of a successor): the call's beats
# CALL_BIAS, the answer's does not
_CALL_STRENGTH, _ANSWER_STRENGTH = 60.0, 8.0

CHAT_TEMPLATE = """\
{%- if messages and messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}
{%- if system or tools %}<|im_start|>system
{% if system %}{{ system }}
{% endif %}
{%- if tools %}# Tools
Call a function as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
{% endif %}<|im_end|>
{% endif %}
{%- for message in rest %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
{{- message.content or '' }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def added_token_ids() -> Dict[str, int]:
    """The id of each added token (they follow the BPE's 400 ids)."""
    return {text: TOKENIZER_VOCAB_SIZE + i for i, text in enumerate(ADDED)}


def _tokenizer_files(max_len: int):
    from tokenizers import AddedToken

    from .tokenizer import build_tokenizer

    tok = build_tokenizer()
    ids = added_token_ids()
    for text in ADDED:  # one at a time: ids in ADDED's order
        token = AddedToken(text, special=text in SPECIAL, normalized=False)
        tok.add_tokens([token])
        if tok.token_to_id(text) != ids[text]:  # pragma: no cover - fixed layout
            raise AssertionError(f"added token {text!r} got another id")
    config = tokenizer_config(max_len)
    for text in ADDED:
        config["added_tokens_decoder"][str(ids[text])] = {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text in SPECIAL,
        }
    config["chat_template"] = CHAT_TEMPLATE
    return tok.to_str(pretty=True), config


def _chains(ids: Dict[str, int]) -> List[tuple]:
    """``(token, next token, strength)`` of each link of the two chains."""
    newline = 10  # the byte token of "\n": the generation prompt ends with it
    answer = [newline] + [ids[t] for t in ANSWER] + [EOS_TOKEN_ID]
    call = ["<think>", *PLAN, "</think>", "<tool_call>", *CALL, "</tool_call>"]
    call = [ids[t] for t in call] + [EOS_TOKEN_ID]
    links = [(a, b, _ANSWER_STRENGTH) for a, b in zip(answer, answer[1:])]
    return links + [(a, b, _CALL_STRENGTH) for a, b in zip(call, call[1:])]


def write_agent_checkpoint(
    path: Union[str, pathlib.Path], family: str = "qwen3_next", *, seed: int = 0
) -> pathlib.Path:
    """Write the agent checkpoint of ``family`` (float32) into ``path``."""
    out = write_predictive_checkpoint(
        path, family, seed=seed, target_scale=0.01, tie_word_embeddings=False
    )
    file = out / "model.safetensors"
    w = load_file(str(file))
    embed = next(w[n] for n in w if n.endswith("embed_tokens.weight"))
    gain = 1 + next(w[n] for n in w if n.endswith("model.norm.weight"))
    head = w["lm_head.weight"] * 0.1  # other successors stay weak
    links = _chains(added_token_ids())
    tokens = sorted({a for a, _, _ in links})
    # The final hidden state at a token is about its RMS-normalised embedding
    # times the final norm's gain. The chains' tokens get embeddings whose
    # such states are orthogonal (so one link does not score at another's
    # token), at the scale of the other embeddings.
    rng = np.random.default_rng([seed, 23])
    basis, _ = np.linalg.qr(rng.standard_normal((embed.shape[1], len(tokens))))
    scale = float(np.sqrt(np.mean(embed[:TOKENIZER_VOCAB_SIZE] ** 2)))
    states = {}
    for t, q in zip(tokens, basis.T):
        e = q / gain
        embed[t] = e * scale / np.sqrt(np.mean(e * e))
        states[t] = q / np.sqrt(np.mean(e * e))  # unit(embed[t]) * gain
    for a, b, strength in links:
        head[b] += strength * states[a] / float(states[a] @ states[a])
    w["lm_head.weight"] = head.astype(np.float32)
    save_file(w, str(file), metadata={"format": "pt"})
    dims = json.loads((out / "config.json").read_text())
    max_len = (
        dims.get("max_position_embeddings")
        or dims["text_config"]["max_position_embeddings"]
    )
    tokenizer, config = _tokenizer_files(max_len)
    (out / "tokenizer.json").write_text(tokenizer)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
