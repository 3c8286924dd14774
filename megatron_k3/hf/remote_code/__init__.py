"""Templates of the remote code that ``megatron_k3.hf.export`` writes into a K3 HF directory.

``configuration_k3.py`` and ``modeling_k3.py`` are copied as they are; they import the golden model's
sources, which the exporter copies beside them as ``k3_*.py`` (see ``megatron_k3.hf.export.remote_modules``).
They are not importable from this package (their relative imports name those copies).
"""
