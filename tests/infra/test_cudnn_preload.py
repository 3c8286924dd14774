"""megatron_k3/cudnn.py: torch's pip cuDNN is loaded before Transformer Engine can load a system one."""
import subprocess
import sys

import pytest

from megatron_k3 import cudnn


@pytest.mark.skipif(not sys.platform.startswith("linux") or not cudnn.torch_cudnn_libs(),
                    reason="Linux with torch's pip cuDNN (package nvidia.cudnn)")
def test_preload_maps_torch_cudnn_first():
    """In a fresh process, prefer_torch_cudnn maps every one of torch's cuDNN libraries (libcudnn_graph first),
    and a later ``import torch`` maps no cuDNN from anywhere else."""
    code = ("import megatron_k3.cudnn as c, json; r = c.prefer_torch_cudnn(force=True); import torch; "
            "print(json.dumps([r, c._mapped_cudnn()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import json

    r, mapped = json.loads(out.stdout.strip().splitlines()[-1])
    libs = cudnn.torch_cudnn_libs()
    assert r["skipped"] is None and r["preloaded"] == libs and "libcudnn_graph" in libs[0]
    import os

    real = {os.path.realpath(f) for f in libs}
    assert mapped and all(os.path.realpath(m) in real for m in mapped), mapped


def test_preload_refuses_when_another_cudnn_is_loaded(monkeypatch):
    """Too late (a system cuDNN already mapped): nothing is loaded, and status() says why."""
    monkeypatch.setattr(cudnn, "_STATUS", {"preloaded": [], "skipped": "not run"})
    monkeypatch.setattr(cudnn, "torch_cudnn_libs", lambda: ["/site/nvidia/cudnn/lib/libcudnn_graph.so.9"])
    monkeypatch.setattr(cudnn, "_mapped_cudnn", lambda: ["/usr/lib/x86_64-linux-gnu/libcudnn.so.9.14.0"])
    loaded = []
    monkeypatch.setattr("ctypes.CDLL", lambda *a, **k: loaded.append(a))
    r = cudnn.prefer_torch_cudnn(force=True)
    assert r["preloaded"] == [] and loaded == [] and "already loaded: /usr/lib" in r["skipped"]
    monkeypatch.setattr(cudnn, "_mapped_cudnn", lambda: [])
    r = cudnn.prefer_torch_cudnn(force=True)
    assert r["skipped"] is None and len(loaded) == 1
