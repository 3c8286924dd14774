"""megatron-k3: Kimi K3 pretraining on megatron-core."""
import os as _os


def _point_te_at_torch_cudnn():
    """Make Transformer Engine load the cuDNN that PyTorch uses, not the CUDA toolkit's.

    megatron-core imports Transformer Engine at import time, and TE loads cuDNN from ``CUDNN_HOME`` /
    ``CUDNN_PATH``, else from the CUDA toolkit (``CUDA_HOME``, ``/usr/local/cuda``), ahead of the pip
    package PyTorch is linked against. On the lent H200 that put the toolkit's cuDNN 9.14 into the process
    beside torch's 9.19, and torch then refused cuDNN ("cuDNN version incompatibility: PyTorch was
    compiled against (9, 19, 0) but found runtime version (9, 14, 0)"), which silently turned SDPA's cuDNN
    attention off: the MLA layers ran the memory-efficient kernel, 13.9 vs 3.5 ms fwd+bwd at k3-mini's shape
    (``tools/gpu_check.py --only sdpa``, 2026-12-03). Setting ``CUDNN_PATH`` to torch's cuDNN (the
    ``nvidia-cudnn`` package beside torch) before TE is imported makes both load the same file. A
    ``CUDNN_HOME`` or ``CUDNN_PATH`` set by the user is left alone, and nothing is imported here."""
    if _os.environ.get("CUDNN_HOME") or _os.environ.get("CUDNN_PATH"):
        return
    import importlib.util

    candidates = []
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is not None and torch_spec.origin:  # the copy torch's rpath points at
        candidates.append(_os.path.join(_os.path.dirname(_os.path.dirname(torch_spec.origin)), "nvidia", "cudnn"))
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
        candidates += list(spec.submodule_search_locations or []) if spec else []
    except (ImportError, ValueError):
        pass
    for d in candidates:
        if _os.path.exists(_os.path.join(d, "lib", "libcudnn.so.9")):
            _os.environ["CUDNN_PATH"] = d
            return


_point_te_at_torch_cudnn()

from .config import PRESETS, ConfigError, K3Config, get_preset, load_config  # noqa: E402,F401

__version__ = "0.1.0"
