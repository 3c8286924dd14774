"""Tokenize documents in parallel into a zarr v3 token store (``tools/prepare_data.py``)."""
from __future__ import annotations

import multiprocessing as mp
import sys

from ..cli import ArgumentParser, friendly_errors
from ..config import ConfigError
from .store import StoreWriter, default_workers, find_inputs, iter_documents, store_size_bytes
from .tokenizer import file_sha256, load_tokenizer

_TOK = None


def _init(tok_path):
    global _TOK
    _TOK = load_tokenizer(tok_path)


def _encode(text):
    return _TOK.encode(text) + [_TOK.eos_id]


def prepare(inputs, tokenizer_path, output, workers=None, text_field="text", progress=True) -> dict:
    files = find_inputs(inputs)
    tok = load_tokenizer(tokenizer_path)
    writer = StoreWriter(output, tok.identity())
    sources = []
    workers = workers or default_workers()
    from tqdm import tqdm

    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="tokenizing",
               disable=not progress, file=sys.stderr)
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=_init, initargs=(str(tokenizer_path),)) as pool:
        for f in files:
            docs = [t for t, _ in iter_documents(f, text_field) if t and t.strip()]
            n_tok = 0
            for ids in pool.imap(_encode, docs, chunksize=16):  # ordered: the store is deterministic
                writer.add(ids)
                n_tok += len(ids)
            sources.append({"path": str(f), "sha256": file_sha256(f), "documents": len(docs), "tokens": n_tok})
            bar.update(f.stat().st_size)
    bar.close()
    man = writer.close(sources)
    ship_tokenizer(tokenizer_path, output)
    man["store_bytes"] = store_size_bytes(output)
    return man


def ship_tokenizer(tokenizer_path, store) -> str:
    """A copy of the tokenizer file inside the store (``STORE/tokenizer/<name>``): a run given only
    ``--data-path`` trains with it, records it, and its checkpoints and HF exports carry it."""
    import os
    import shutil

    d = os.path.join(str(store), "tokenizer")
    os.makedirs(d, exist_ok=True)
    dst = os.path.join(d, os.path.basename(str(tokenizer_path)))
    shutil.copyfile(tokenizer_path, dst)
    return dst


def store_tokenizer(store) -> str | None:
    """The tokenizer file a store carries (``ship_tokenizer``), or None (stores made before it)."""
    import os

    d = os.path.join(str(store), "tokenizer")
    if not os.path.isdir(d):
        return None
    files = sorted(f for f in os.listdir(d) if f.endswith((".json", ".model", ".tiktoken")))
    return os.path.join(d, files[0]) if files else None


@friendly_errors
def main(argv=None):
    ap = ArgumentParser(description="Tokenize .txt/.jsonl/.parquet (optionally .gz) files or directories "
                                             "into a zarr v3 token store.")
    ap.add_argument("--input", nargs="+", required=True)
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json (HF tokenizers) or Kimi tiktoken.model")
    ap.add_argument("--output", required=True)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--text-field", default="text")
    args = ap.parse_args(argv)
    import os

    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise ConfigError(f"--output {args.output} exists and is not a directory (a token store is a directory)")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be >= 1 (got {args.workers})")
    man = prepare(args.input, args.tokenizer, args.output, args.workers, args.text_field)
    print(f"[prepare] {man['num_documents']} documents, {man['token_count']:,} tokens -> {args.output} "
          f"({man['store_bytes'] / 1e6:.2f} MB, {man['store_bytes'] / man['token_count']:.2f} B/token)")


if __name__ == "__main__":
    main()
