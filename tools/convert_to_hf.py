#!/usr/bin/env python3
"""Export a K3 checkpoint (saved at any TP/PP/EP layout) to a HF model directory. (``python -m megatron_k3 convert-to-hf``;
the code: ``megatron_k3/commands/convert_to_hf.py``)."""
import sys

from megatron_k3.commands.convert_to_hf import main

if __name__ == "__main__":
    sys.exit(main())
