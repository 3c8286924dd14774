"""Patches of megatron-core: what this project changes in megatron-core at run time, and for which versions.

Every patch is written against the megatron-core versions in ``TESTED`` (its private names, call orders and
fallbacks were read there); ``megatron_k3.compat.setup_device`` applies them in one place, after
``check_megatron_core()``, which refuses a megatron-core outside that range with one line before anything is
patched. The patches themselves, each with what it fixes and why, are listed in ``megatron_k3/compat.py``'s
docstring (items 1-9).
"""
from __future__ import annotations

TESTED = ("0.19.2",)  # megatron-core versions every patch was written and tested against
REQUIREMENT = "megatron-core==0.19.2"


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
