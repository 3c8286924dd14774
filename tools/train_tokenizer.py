#!/usr/bin/env python3
"""Train a byte-level BPE tokenizer (HF tokenizers) offline on local text: (``python -m megatron_k3 train-tokenizer``;
the code: ``megatron_k3/commands/train_tokenizer.py``)."""
import sys

from megatron_k3.commands.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
