"""Tokenizers: the official Kimi tiktoken model from a local path, or a byte-level BPE trained offline.

Both expose ``vocab_size`` (the id space the model's embedding must cover), ``eos_id``, ``bos_id``,
``pad_id``, ``encode(text)``, ``decode(ids)`` and ``identity()`` (type, file and its SHA-256: stored in
every token store's manifest and checked against the training run). Nothing is downloaded.

Kimi (``tiktoken.model``, 163,584 BPE ranks + 256 reserved special ids = 163,840): ids of the special
tokens come from a ``tokenizer_config.json`` beside the model file when present (``added_tokens_decoder``),
otherwise the released defaults: ``[BOS]`` 163584, ``[EOS]`` 163585, ``<|im_end|>`` 163586 (the release's
``eos_token_id``), ``[PAD]`` 163839.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..config import ConfigError

# The release's pre-tokenisation pattern (tokenization_kimi.py): Han runs, cased words with English
# contractions, 1-3 digit numbers, punctuation runs, newlines, whitespace.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_NUM_RESERVED = 256
KIMI_DEFAULT_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 255: "[PAD]"}  # offsets past the BPE ranks


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class HFTokenizer:
    """A HF ``tokenizers`` JSON file (e.g. from ``tools/train_tokenizer.py``)."""

    kind = "hf-tokenizers"

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"tokenizer file not found: {self.path}")
        try:
            self.tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001  (the tokenizers library raises a bare Exception)
            raise ConfigError(f"{self.path}: not a readable tokenizer.json ({str(e).splitlines()[0][:200]})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self.tok.token_to_id("<|endoftext|>")
        self.pad_id = self.tok.token_to_id("<|pad|>")
        self.bos_id = self.tok.token_to_id("<|bos|>")
        if self.eos_id is None:
            raise ConfigError(f"{self.path}: tokenizer has no <|endoftext|> token (train it with tools/train_tokenizer.py)")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def identity(self) -> dict:
        return {"type": self.kind, "file": self.path.name, "sha256": file_sha256(self.path), "vocab_size": self.vocab_size}


class KimiTiktokenTokenizer:
    """The official Kimi ``tiktoken.model`` (base64 token + rank per line), from a local path."""

    kind = "kimi-tiktoken"

    def __init__(self, path: str | Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"tokenizer file not found: {self.path}")
        ranks = load_tiktoken_bpe(str(self.path))
        n = len(ranks)
        names = {}
        cfg = self.path.with_name("tokenizer_config.json")
        if cfg.is_file():
            for i, rec in json.loads(cfg.read_text()).get("added_tokens_decoder", {}).items():
                names[int(i)] = rec["content"]
        for off, name in KIMI_DEFAULT_SPECIALS.items():
            names.setdefault(n + off, name)
        specials = {}
        for i in range(n, n + KIMI_NUM_RESERVED):
            specials[names.get(i, f"<|reserved_token_{i}|>")] = i
        self.enc = tiktoken.Encoding(name=self.path.stem, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=specials)
        self.vocab_size = n + KIMI_NUM_RESERVED
        self.bos_id = specials.get("[BOS]")
        self.eos_id = specials.get("<|im_end|>", specials.get("[EOS]"))
        self.pad_id = specials.get("[PAD]")

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, disallowed_special=())

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_batch(texts, disallowed_special=())

    def decode(self, ids) -> str:
        return self.enc.decode(list(ids))

    def identity(self) -> dict:
        return {"type": self.kind, "file": self.path.name, "sha256": file_sha256(self.path), "vocab_size": self.vocab_size}


def load_tokenizer(path: str | Path):
    """``*.json`` -> HFTokenizer; ``tiktoken.model`` / ``*.tiktoken`` -> KimiTiktokenTokenizer."""
    p = Path(path)
    if p.is_dir():
        for cand in ("tokenizer.json", "tiktoken.model"):
            if (p / cand).is_file():
                return load_tokenizer(p / cand)
        raise ConfigError(f"no tokenizer.json or tiktoken.model in {p}")
    if p.suffix == ".json":
        return HFTokenizer(p)
    if p.suffix in (".model", ".tiktoken"):
        return KimiTiktokenTokenizer(p)
    raise ConfigError(f"unknown tokenizer file type: {p} (expected tokenizer.json or tiktoken.model)")


def train_bpe(texts, vocab_size: int, out_path: str | Path, min_frequency: int = 2):
    """Train a byte-level BPE (HF tokenizers) offline; special tokens <|endoftext|>, <|pad|>, <|bos|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=["<|endoftext|>", "<|pad|>", "<|bos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return HFTokenizer(out_path)
