"""Token store: a zarr v3 group of tokenized documents, written by ``tools/prepare_data.py``.

Layout::

    STORE/                      zarr v3 group
      tokens      uint32 [N]    the token stream; every document ends with the tokenizer's EOS
                                (sharded: 16M-token shards of 64K-token chunks, zstd level 3)
      doc_starts  int64  [D]    offset of each document's first token
      attrs["manifest"]         format, token_count, num_documents, tokenizer identity (type, file,
                                sha256, vocab_size), sources (path, documents, tokens), created

Inputs: ``.txt`` (one document per file), ``.jsonl`` (a ``text`` field per line), ``.parquet`` (a
``text`` column), each optionally ``.gz``; directories are searched recursively, in sorted order.
"""
from __future__ import annotations

import datetime
import gzip
import json
import os
from pathlib import Path

import numpy as np

from ..config import ConfigError

FORMAT = "k3-tokens/1"
SUFFIXES = (".txt", ".jsonl", ".parquet", ".txt.gz", ".jsonl.gz")


def _open_text(p: Path):
    return gzip.open(p, "rt", encoding="utf-8") if p.suffix == ".gz" else open(p, encoding="utf-8")


def find_inputs(paths) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SUFFIXES))
        elif p.is_file():
            if not p.name.endswith(SUFFIXES):
                raise ConfigError(f"unsupported input file {p} (use .txt, .jsonl, .parquet, optionally .gz)")
            files.append(p)
        else:
            raise ConfigError(f"input not found: {p}")
    if not files:
        raise ConfigError(f"no input files (.txt/.jsonl/.parquet) under: {', '.join(map(str, paths))}")
    return files


def iter_documents(path: Path, text_field: str = "text"):
    """Yield (text, extra-fields) for each document of one input file."""
    name = path.name
    if name.endswith((".txt", ".txt.gz")):
        with _open_text(path) as f:
            yield f.read(), {}
    elif name.endswith((".jsonl", ".jsonl.gz")):
        with _open_text(path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None
                if text_field not in rec:
                    raise ConfigError(f"{path}:{i + 1}: no '{text_field}' field")
                yield rec[text_field], {k: v for k, v in rec.items() if k != text_field}
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise ConfigError(f"{path}: no '{text_field}' column (has: {', '.join(table.column_names)})")
        for t in table.column(text_field).to_pylist():
            yield t, {}


def open_store(path: str | Path):
    """(tokens array, doc_starts array, manifest) of an existing store; clear error otherwise."""
    import zarr

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"data path not found: {path} (create it with tools/prepare_data.py)")
    try:
        g = zarr.open_group(str(path), mode="r")
        man = dict(g.attrs["manifest"])
        tokens, starts = g["tokens"], g["doc_starts"]
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{path} is not a token store ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if man.get("format") != FORMAT:
        raise ConfigError(f"{path}: unknown store format {man.get('format')!r} (expected {FORMAT})")
    if man["token_count"] == 0:
        raise ConfigError(f"{path}: the token store is empty")
    return tokens, starts, man


class StoreWriter:
    """Append tokenized documents to a new store; ``close()`` writes the manifest last."""

    def __init__(self, path: str | Path, tokenizer_identity: dict, shard_tokens: int = 1 << 24,
                 chunk_tokens: int = 1 << 16, zstd_level: int = 3):
        import zarr
        from zarr.codecs import ZstdCodec

        self.path = Path(path)
        if self.path.exists() and any(self.path.iterdir()):
            raise ConfigError(f"output {self.path} exists and is not empty (refusing to overwrite)")
        self.group = zarr.open_group(str(self.path), mode="w", zarr_format=3)
        comp = ZstdCodec(level=zstd_level)
        self.tokens = self.group.create_array("tokens", shape=(0,), dtype="uint32", chunks=(chunk_tokens,),
                                              shards=(shard_tokens,), compressors=comp)
        self.starts = self.group.create_array("doc_starts", shape=(0,), dtype="int64", chunks=(chunk_tokens,),
                                              compressors=comp)
        self.tokenizer_identity = tokenizer_identity
        self.buf, self.buf_starts, self.buffered, self.n, self.docs = [], [], 0, 0, 0
        self.flush_tokens = chunk_tokens * 16

    def add(self, ids: list[int]):
        self.buf_starts.append(self.n + self.buffered)
        self.buf.append(np.asarray(ids, dtype=np.uint32))
        self.buffered += len(ids)
        self.docs += 1
        if self.buffered >= self.flush_tokens:
            self.flush()

    def flush(self):
        if self.buf:
            data = np.concatenate(self.buf)
            self.tokens.append(data)
            self.starts.append(np.asarray(self.buf_starts, dtype=np.int64))
            self.n += len(data)
            self.buf, self.buf_starts, self.buffered = [], [], 0

    def close(self, sources: list[dict]) -> dict:
        self.flush()
        if self.n == 0:
            raise ConfigError("the input produced no tokens (empty corpus)")
        man = {"format": FORMAT, "token_count": int(self.n), "num_documents": int(self.docs),
               "tokenizer": self.tokenizer_identity, "sources": sources, "eos_appended": True,
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        self.group.attrs["manifest"] = man
        return man


def store_size_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2)))
