"""Patches of megatron-core: what this project changes in megatron-core at run time, and for which versions.

Every patch is written against the megatron-core versions in ``TESTED`` (its private names, call orders and
fallbacks were read there) and lives in its own file here, whose docstring says what it fixes and why.
``megatron_k3.compat.setup_device`` applies them in one place, after ``check_megatron_core()``, which refuses a
megatron-core outside that range with one line before anything is patched.

====  =========================  ===========================================================  =====================
item  file                       what it fixes                                                 applied
====  =========================  ===========================================================  =====================
1-6   ``cpu_mode.py``            megatron-core on a CPU-only machine (CPU plays CUDA, gloo)    no CUDA (setup_device)
7     ``foreach_kernels.py``     Python-loop/host-sync multi-tensor fallbacks; fused AdamW     no TE/apex (apply)
8     ``router_walks.py``        two walks over every module per step to find MoE routers      always (apply)
9     ``lean_grad_clip.py``      per-step grad filters and host sync in grad norm/clip         ``perf.lean_grad_clip``
10    ``local_dispatcher.py``    per-layer host sync of the MoE all-to-all dispatcher (EP=1)   ``parallel.layers``
11    ``coalesced_master_copy``  one copy per parameter tensor from fp32 masters after a step  ``runtime.build_optimizer``
====  =========================  ===========================================================  =====================

Private megatron-core names read (not patched) elsewhere, covered by the same version check:
``checkpoints_io/k3ckpt.py`` reads each rank's distributed-optimizer shard through
``DistributedOptimizer._get_model_param_range_map`` and ``_get_main_param_and_optimizer_states``;
``plan/simulate.py`` reads ``shard_fp32_from_float16_groups``.
"""
from __future__ import annotations

TESTED = ("0.19.2",)  # megatron-core versions every patch was written and tested against
REQUIREMENT = "megatron-core==0.19.2"


def apply() -> None:
    """Apply the patches every machine gets (items 7-9; idempotent). CPU mode (items 1-6) is switched on by
    ``compat.setup_device`` before this; items 10 and 11 are applied where megatron builds the objects."""
    from .foreach_kernels import use_foreach_fallbacks
    from .lean_grad_clip import use_lean_grad_clipping
    from .router_walks import use_cached_router_walks

    use_foreach_fallbacks()
    use_cached_router_walks()
    use_lean_grad_clipping()


def installed_megatron_core() -> str | None:
    """The installed megatron-core's version (its distribution metadata), or None if it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


def check_megatron_core() -> str:
    """The installed version, or a ``ConfigError`` (one line) when it is missing or outside ``TESTED``."""
    from ..config import ConfigError

    v = installed_megatron_core()
    if v is None:
        raise ConfigError(f"megatron-core is not installed: install {REQUIREMENT} (bash tools/setup_env.sh does)")
    if v not in TESTED:
        raise ConfigError(f"megatron-core {v} is outside the versions megatron_k3's patches were tested with "
                          f"({', '.join(TESTED)}; megatron_k3/patches): install {REQUIREMENT}")
    return v
