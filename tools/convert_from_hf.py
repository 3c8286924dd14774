#!/usr/bin/env python3
"""Import a HF model directory into a checkpoint the trainer loads (``--load OUT``). (``python -m megatron_k3 convert-from-hf``;
the code: ``megatron_k3/commands/convert_from_hf.py``)."""
import sys

from megatron_k3.commands.convert_from_hf import main

if __name__ == "__main__":
    sys.exit(main())
