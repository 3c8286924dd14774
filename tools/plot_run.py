#!/usr/bin/env python3
"""Render a run's loss and routing plots to PNG:  python tools/plot_run.py RUN_DIR (``python -m megatron_k3 plot-run``;
the code: ``megatron_k3/commands/plot_run.py``)."""
import sys

from megatron_k3.commands.plot_run import main

if __name__ == "__main__":
    sys.exit(main())
