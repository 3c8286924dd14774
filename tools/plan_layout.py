#!/usr/bin/env python3
"""Pick or check a parallel layout for K3 training and print the per-GPU memory it needs. (``python -m megatron_k3 plan``;
the code: ``megatron_k3/commands/plan.py``)."""
import sys

from megatron_k3.commands.plan import main

if __name__ == "__main__":
    sys.exit(main())
