"""megatron-k3: Kimi K3 pretraining on megatron-core."""
from .cudnn import prefer_torch_cudnn as _prefer_torch_cudnn

_prefer_torch_cudnn()  # before megatron-core imports Transformer Engine (megatron_k3/cudnn.py says why)
from .config import PRESETS, ConfigError, K3Config, get_preset, load_config  # noqa: F401

__version__ = "0.1.0"
