"""The K3 math: one file per component, each a plain-PyTorch reference (CPU) with its GPU fast path."""
from .k3 import IGNORE_INDEX, K3DecoderLayer, K3ForCausalLM, K3Model, chunked_cross_entropy, hf_shapes  # noqa: F401
