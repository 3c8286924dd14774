"""Train a byte-level BPE tokenizer (HF tokenizers) offline on local text:
    python tools/train_tokenizer.py --input DOCS... --vocab-size 512 --output tokenizer.json"""
import argparse


from megatron_k3.cli import ArgumentParser, friendly_errors
from megatron_k3.config import ConfigError
from megatron_k3.data.store import find_inputs, iter_documents
from megatron_k3.data.tokenizer import train_bpe


@friendly_errors
def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True)
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--text-field", default="text")
    args = ap.parse_args(argv)
    if args.vocab_size < 260:
        raise ConfigError("--vocab-size must be >= 260 (256 bytes + special tokens)")
    texts = [t for f in find_inputs(args.input) for t, _ in iter_documents(f, args.text_field) if t and t.strip()]
    if not texts:
        raise ConfigError("empty corpus: no documents with text")
    tok = train_bpe(texts, args.vocab_size, args.output)
    print(f"[tokenizer] {args.output}: vocab {tok.vocab_size}, sha256 {tok.identity()['sha256'][:16]}...")


if __name__ == "__main__":
    main()
