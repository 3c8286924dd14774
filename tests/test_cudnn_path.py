"""megatron_k3/__init__.py points Transformer Engine at torch's cuDNN (CUDNN_PATH) before TE can be imported."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = "import os, megatron_k3; print(os.environ.get('CUDNN_PATH'))"


def _run(env):
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                       env=env | {"PYTHONPATH": ROOT}, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def torch_cudnn_dir():
    torch_dir = os.path.dirname(importlib.util.find_spec("torch").origin)
    d = os.path.join(os.path.dirname(torch_dir), "nvidia", "cudnn")
    return d if os.path.exists(os.path.join(d, "lib", "libcudnn.so.9")) else None


@pytest.mark.skipif(torch_cudnn_dir() is None, reason="this torch has no nvidia-cudnn package beside it")
def test_cudnn_path_is_torchs():
    env = {k: v for k, v in os.environ.items() if k not in ("CUDNN_PATH", "CUDNN_HOME")}
    assert _run(env) == torch_cudnn_dir()


def test_user_setting_is_kept(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDNN_PATH", "CUDNN_HOME")}
    assert _run(env | {"CUDNN_PATH": str(tmp_path)}) == str(tmp_path)
    assert _run(env | {"CUDNN_HOME": str(tmp_path)}) == "None"  # TE reads CUDNN_HOME first: not overridden
