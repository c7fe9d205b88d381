"""Corpus and tokenizer of the demo model.

Corpus: the ``.py`` files of the running interpreter's standard library
(``sysconfig``'s ``stdlib`` directory), sorted by relative path, without
``site-packages`` and the test suites (``test``, ``tests``, ``idle_test``
directories), and without files that are not valid UTF-8. A seeded
permutation holds out ~3% of the files for evaluation. The manifest records
the Python version, the file lists and hashes of the list and of the bytes.

Tokenizer: a byte-level BPE trained with the ``tokenizers`` library on the
training files (Qwen's split regex, no normaliser, so decoding round-trips
every byte), followed by ``<|endoftext|>`` as the last id; the token streams
put one EOS after every file.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from mlx_spec.testing import tokenizer as tiny_tokenizer

EOS_TOKEN = tiny_tokenizer.EOS_TOKEN
EXCLUDED_DIRS = ("site-packages", "test", "tests", "idle_test", "__pycache__")

# Qwen's pre-tokenizer split (the regex of the Qwen3 / Qwen3-Next tokenizer.json).
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass
class Corpus:
    python_version: str
    stdlib_root: str
    seed: int
    train_files: List[str]
    eval_files: List[str]
    skipped_non_utf8: List[str]
    file_list_sha256: str  # sha256 of the sorted relative paths, one per line
    content_sha256: str  # sha256 over (path, bytes) of every used file
    total_bytes: int
    texts: Dict[str, str] = field(repr=False, default_factory=dict)

    def manifest(self) -> dict:
        d = asdict(self)
        d.pop("texts")
        d["num_files"] = len(self.train_files) + len(self.eval_files)
        return d


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Optional[Path] = None) -> List[str]:
    """Sorted relative posix paths of the corpus candidates under ``root``."""
    root = Path(root or stdlib_root())
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if set(rel.parts[:-1]) & set(EXCLUDED_DIRS) or not p.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def _spread(items: Sequence[str], n: int) -> List[str]:
    """``n`` items evenly spaced over ``items`` (all if n >= len)."""
    if n >= len(items):
        return list(items)
    idx = np.linspace(0, len(items) - 1, n).round().astype(int)
    return [items[i] for i in sorted(set(idx.tolist()))]


def build_corpus(
    seed: int,
    holdout: float = 0.03,
    max_files: Optional[int] = None,
    root: Optional[Path] = None,
) -> Corpus:
    root = Path(root or stdlib_root())
    names = stdlib_files(root)
    if max_files is not None:
        names = _spread(names, max_files)
    texts, skipped = {}, []
    content = hashlib.sha256()
    for name in names:
        data = (root / name).read_bytes()
        try:
            texts[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(name)
            continue
        content.update(name.encode() + b"\0" + data + b"\0")
    used = [n for n in names if n in texts]
    if len(used) < 2:
        raise ValueError("the corpus needs at least two files")
    perm = np.random.default_rng(seed).permutation(len(used))
    n_eval = max(1, int(round(holdout * len(used))))
    eval_set = {used[i] for i in perm[:n_eval]}
    return Corpus(
        python_version=platform.python_version(),
        stdlib_root=str(root),
        seed=seed,
        train_files=[n for n in used if n not in eval_set],
        eval_files=[n for n in used if n in eval_set],
        skipped_non_utf8=skipped,
        file_list_sha256=hashlib.sha256("\n".join(used).encode()).hexdigest(),
        content_sha256=content.hexdigest(),
        total_bytes=sum(len(t.encode()) for t in texts.values()),
        texts=texts,
    )


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE of ``vocab_size`` ids; EOS is the last id."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    return tok


def tokenizer_config(eos_id: int, max_len: int) -> dict:
    """``tokenizer_config.json`` in the form of the Qwen releases (no chat template)."""
    return tiny_tokenizer.tokenizer_config(max_len, eos_id=eos_id)


def encode_files(tok, texts: Sequence[str]) -> np.ndarray:
    """One stream: each file's tokens followed by EOS. uint16 or int32."""
    eos = tok.token_to_id(EOS_TOKEN)
    parts = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        parts.append(np.asarray(enc.ids + [eos], dtype=np.int32))
    stream = np.concatenate(parts)
    return stream.astype(np.uint16) if tok.get_vocab_size() < 65536 else stream


def check_round_trip(tok, texts: Sequence[str]) -> int:
    """Number of texts whose decode(encode(text)) differs from the text."""
    bad = 0
    for text, enc in zip(
        texts, tok.encode_batch(list(texts), add_special_tokens=False)
    ):
        if tok.decode(enc.ids, skip_special_tokens=False) != text:
            bad += 1
    return bad


def unigram_loss(train: np.ndarray, held_out: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of held-out tokens under add-one unigram counts."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[held_out.astype(np.int64)].mean())


def prepare_data(
    work: Path,
    seed: int,
    vocab_size: int,
    holdout: float = 0.03,
    max_files: Optional[int] = None,
    max_len: int = 4096,
) -> dict:
    """Corpus + tokenizer + token streams into ``work``; returns the manifest."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(seed, holdout, max_files)
    train_texts = [corpus.texts[n] for n in corpus.train_files]
    eval_texts = [corpus.texts[n] for n in corpus.eval_files]
    tok = train_tokenizer(train_texts, vocab_size)
    eos = tok.token_to_id(EOS_TOKEN)
    if eos != vocab_size - 1 or tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer has {tok.get_vocab_size()} ids, EOS {eos}; "
            f"wanted {vocab_size} with EOS last (corpus too small?)"
        )
    train = encode_files(tok, train_texts)
    held = encode_files(tok, eval_texts)
    bad = check_round_trip(tok, train_texts + eval_texts)
    if bad:
        raise RuntimeError(f"{bad} files do not round-trip through the tokenizer")
    tok.save(str(work / "tokenizer.json"))
    (work / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(eos, max_len), indent=2) + "\n"
    )
    np.save(work / "train_tokens.npy", train)
    np.save(work / "eval_tokens.npy", held)
    (work / "eval_texts.json").write_text(
        json.dumps(dict(zip(corpus.eval_files, eval_texts)))
    )
    manifest = {
        **corpus.manifest(),
        "vocab_size": vocab_size,
        "eos_token_id": eos,
        "train_tokens": int(train.size),
        "eval_tokens": int(held.size),
        "round_trip_failures": bad,
        "unigram_eval_loss": unigram_loss(train, held, vocab_size),
    }
    (work / "corpus.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
