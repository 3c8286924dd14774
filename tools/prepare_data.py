#!/usr/bin/env python3
"""Tokenize text into a zarr v3 token store:
    python tools/prepare_data.py --input DOCS... --tokenizer tokenizer.json --output STORE"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_k3.data.prepare import main  # noqa: E402

if __name__ == "__main__":
    main()
