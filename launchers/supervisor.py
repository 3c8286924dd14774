#!/usr/bin/env python3
"""Restart a training command until it finishes, as long as it makes progress. (``python -m megatron_k3 supervise``;
the code: ``megatron_k3/commands/supervise.py``)."""
import sys

from megatron_k3.commands.supervise import main

if __name__ == "__main__":
    sys.exit(main())
