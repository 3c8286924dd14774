"""megatron-k3: Kimi K3 pretraining on megatron-core."""
from .config import PRESETS, ConfigError, K3Config, get_preset, load_config  # noqa: F401

__version__ = "0.1.0"
