"""The tiny checkpoints' tokenizer: a byte-level BPE learned offline.

A small deterministic trainer (ties go to the smallest pair) learns 143 merges
from an embedded snippet of Python code: 256 byte tokens (ids 0-255 in byte
order), the merges and ``<|endoftext|>`` (EOS and pad, id 399), 400 tokens in
all. It does not use the ``tokenizers`` trainer, so the vocabulary is identical
across library versions. The pipeline is the Qwen3.5 one (NFC normalizer, Qwen
split regex, ByteLevel), which transformers rebuilds for ``model_type``
qwen3_5* anyway, so every loading path encodes alike.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Dict, List, Tuple

EOS_TOKEN = "<|endoftext|>"
_NUM_MERGES = 143
TOKENIZER_VOCAB_SIZE = 256 + _NUM_MERGES + 1  # bytes + merges + EOS
EOS_TOKEN_ID = TOKENIZER_VOCAB_SIZE - 1

_CORPUS = '''\
import os
import sys
from typing import Dict, List, Optional


def read_lines(path: str) -> List[str]:
    """Return the lines of a text file without the trailing newline."""
    with open(path, "r", encoding="utf-8") as handle:
        return [line.rstrip("\\n") for line in handle]


def count_words(lines: List[str]) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    return counts


class Stack:
    def __init__(self) -> None:
        self.items: List[int] = []

    def push(self, value: int) -> None:
        self.items.append(value)

    def pop(self) -> Optional[int]:
        if not self.items:
            return None
        return self.items.pop()

    def __len__(self) -> int:
        return len(self.items)


def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def main(argv: List[str]) -> int:
    if len(argv) < 2:
        print("usage: words.py FILE", file=sys.stderr)
        return 1
    path = argv[1]
    if not os.path.exists(path):
        print(f"no such file: {path}", file=sys.stderr)
        return 2
    counts = count_words(read_lines(path))
    for word, count in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"{word}\\t{count}")
    stack = Stack()
    for i in range(10):
        stack.push(fibonacci(i))
    while len(stack) > 0:
        value = stack.pop()
        print("value =", value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
'''


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character table (ByteLevel alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table: Dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _train_bpe(words: Counter, num_merges: int) -> List[Tuple[str, str]]:
    """Greedy BPE: merge the most frequent adjacent pair; ties -> smallest pair."""
    seqs = {w: list(w) for w in words}
    merges: List[Tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for w, n in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best_n = max(pairs.values())
        if best_n < 2:
            break
        best = min(p for p, n in pairs.items() if n == best_n)
        merges.append(best)
        joined = best[0] + best[1]
        for w, s in seqs.items():
            if len(s) < 2:
                continue
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == best[0] and s[i + 1] == best[1]:
                    out.append(joined)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


# The pre-tokenizer split of the Qwen3.5 tokenizer (transformers' ``Qwen3_5Tokenizer``
# rebuilds exactly this pipeline for ``model_type`` qwen3_5*, whatever tokenizer.json
# says, so writing it into tokenizer.json keeps every loading path identical).
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    normalizer = normalizers.NFC()
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    words = Counter(
        piece for piece, _ in pre.pre_tokenize_str(normalizer.normalize_str(_CORPUS))
    )
    merges = _train_bpe(words, _NUM_MERGES)
    if len(merges) != _NUM_MERGES:  # pragma: no cover - corpus is fixed
        raise AssertionError(f"corpus gave {len(merges)} merges, not {_NUM_MERGES}")
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    if len(vocab) != TOKENIZER_VOCAB_SIZE - 1:  # pragma: no cover
        raise AssertionError("duplicate merge result")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    if tok.token_to_id(EOS_TOKEN) != EOS_TOKEN_ID:  # pragma: no cover
        raise AssertionError("EOS id mismatch")
    return tok.to_str(pretty=True)


def build_tokenizer():
    """The tiny byte-level BPE as a ``tokenizers.Tokenizer`` (deterministic, offline)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json())


def tokenizer_config(max_len: int, eos_id: int = EOS_TOKEN_ID) -> Dict[str, Any]:
    """``tokenizer_config.json`` in the form of the Qwen releases (no chat
    template), for a tokenizer whose EOS (and pad) is ``<|endoftext|>``."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(eos_id): {
                "content": EOS_TOKEN,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": max_len,
        "pad_token": EOS_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
