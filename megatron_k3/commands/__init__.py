"""The project's command-line programs (``python -m megatron_k3 <command>``); ``tools/`` and ``launchers/`` hold
thin wrappers with the paths users name."""
