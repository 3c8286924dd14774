"""Keep torch's own cuDNN when Transformer Engine is imported (Linux, pip-installed CUDA torch).

Why: megatron-core imports Transformer Engine at import time, and TE loads ``libcudnn.so`` through the
system loader. On a machine with a system cuDNN older than torch's pip one (the lent H100/H200 image:
``/usr/lib/x86_64-linux-gnu/libcudnn_*.so.9.14.0`` in ``ldconfig`` beside torch 2.11's cuDNN 9.19), cuDNN's
sub-libraries (``libcudnn_graph``, ``_ops``, ``_engines_*``, ...), which cuDNN opens by soname, then come from
the system, torch reports "cuDNN version incompatibility: PyTorch was compiled against (9, 19, 0) but found
runtime version (9, 14, 0)", and SDPA falls back from cuDNN's attention to the memory-efficient kernel:
13.7 ms instead of 3.7 ms fwd+bwd at k3-mini's MLA shape (H100, 2026-12-06,
``benchmarks/results/gpu_check_sdpa_te_h100_2026-12-06.json``; the same on the H200 on 2026-12-03).

How: before anything imports TE, ``prefer_torch_cudnn`` dlopens torch's pip cuDNN libraries (package
``nvidia.cudnn``) by path with ``RTLD_GLOBAL``, ``libcudnn_graph`` first (the others need it by soname): a
later load by soname finds these already mapped. Measured in the same probe (mode ``preload-te-first``):
TE 2.20.2 imported, torch sees cuDNN 9.19, SDPA picks cuDNN's kernels again (3.7 ms).
``megatron_k3/__init__.py`` calls it on import. It does nothing without a GPU device node, without the
``nvidia.cudnn`` package, or when a cuDNN is already mapped into the process (too late: loading a second copy
beside it would be worse than leaving it); ``status()`` says what happened.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys

_STATUS: dict = {"preloaded": [], "skipped": "not run"}


def _mapped_cudnn() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "libcudnn" in line})
    except OSError:
        return []


def torch_cudnn_libs() -> list[str]:
    """torch's pip cuDNN libraries, ``libcudnn_graph`` first and the front end ``libcudnn.so.9`` last."""
    spec = importlib.util.find_spec("nvidia.cudnn") if importlib.util.find_spec("nvidia") else None
    if spec is None or not spec.submodule_search_locations:
        return []
    libs = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "lib", "libcudnn*.so.9")))
    libs.sort(key=lambda f: (not os.path.basename(f).startswith("libcudnn_graph"),
                             os.path.basename(f) == "libcudnn.so.9"))
    return libs


def prefer_torch_cudnn(force: bool = False) -> dict:
    """Load torch's cuDNN before TE can load another (see the module docstring); returns ``status()``.
    ``force``: also without a GPU device node (tests)."""
    import ctypes

    if _STATUS["preloaded"]:
        return status()
    if not sys.platform.startswith("linux"):
        _STATUS["skipped"] = "not Linux"
    elif not force and not os.path.exists("/dev/nvidiactl"):
        _STATUS["skipped"] = "no GPU device"
    elif not (libs := torch_cudnn_libs()):
        _STATUS["skipped"] = "torch has no pip cuDNN (package nvidia.cudnn)"
    elif foreign := [m for m in _mapped_cudnn() if os.path.dirname(m) != os.path.dirname(libs[0])]:
        _STATUS["skipped"] = f"another cuDNN is already loaded: {foreign[0]}"
    else:
        try:
            for f in libs:
                ctypes.CDLL(f, mode=ctypes.RTLD_GLOBAL)
                _STATUS["preloaded"].append(f)
            _STATUS["skipped"] = None
        except OSError as e:  # a broken install: leave the loader's choice as it was
            _STATUS["skipped"] = f"load failed: {e}"
    return status()


def status() -> dict:
    """``{"preloaded": [files], "skipped": reason or None}``."""
    return {"preloaded": list(_STATUS["preloaded"]), "skipped": _STATUS["skipped"]}
