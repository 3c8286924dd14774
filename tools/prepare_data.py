#!/usr/bin/env python3
"""Tokenize text into a zarr v3 token store:
    python tools/prepare_data.py --input DOCS... --tokenizer tokenizer.json --output STORE"""


from megatron_k3.data.prepare import main  # noqa: E402

if __name__ == "__main__":
    main()
