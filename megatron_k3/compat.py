"""The one place that knows whether a GPU exists: device selection, and megatron-core on CPU with gloo.

``setup_device()`` picks this process's device and applies the megatron-core patches of
``megatron_k3/patches/`` in one place, after refusing (one line) a megatron-core outside the versions they
were written against. On a machine without CUDA it turns on CPU mode (``patches/cpu_mode.py``: the CPU plays
the CUDA device for megatron-core); nothing else in the project branches on CPU vs GPU, and megatron-core
itself is not modified. Process groups use gloo on CPU and NCCL on GPU (``backend()``).
"""
from __future__ import annotations

import os

import torch

from . import patches
from .patches import cpu_mode


def has_gpu() -> bool:
    return torch.cuda.is_available()


def backend() -> str:
    return "nccl" if has_gpu() else "gloo"


def setup_device(local_rank: int | None = None) -> torch.device:
    """Pick this process's device: ``cuda:local_rank`` when CUDA exists, else the CPU (with CPU mode on), and
    apply the patches (``patches.apply``). Refuses (one ``ConfigError`` line) a megatron-core outside the
    versions the patches were tested with before patching anything."""
    patches.check_megatron_core()
    if has_gpu():
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        cpu_mode.enable()
        device = torch.device("cpu")
    patches.apply()
    return device


def cpu_mode_enabled() -> bool:
    return cpu_mode.enabled()


def play_cuda_on(device: str) -> None:
    """CPU mode: let ``device`` ("cpu", or "meta" for ``megatron_k3.plan.simulate``) play the CUDA device."""
    cpu_mode.play_cuda_on(device)
