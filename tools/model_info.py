#!/usr/bin/env python3
"""Parameter counts of a K3 config (meta-device instantiation of the golden model). (``python -m megatron_k3 model-info``;
the code: ``megatron_k3/commands/model_info.py``)."""
import sys

from megatron_k3.commands.model_info import main

if __name__ == "__main__":
    sys.exit(main())
