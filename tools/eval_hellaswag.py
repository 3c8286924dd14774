#!/usr/bin/env python3
"""HellaSwag (0-shot, lm-eval's task definition: acc and acc_norm) on a HF directory or a trainer checkpoint. (``python -m megatron_k3 eval-hellaswag``;
the code: ``megatron_k3/commands/eval_hellaswag.py``)."""
import sys

from megatron_k3.commands.eval_hellaswag import main

if __name__ == "__main__":
    sys.exit(main())
