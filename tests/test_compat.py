"""compat item 7: the foreach stand-ins for apex's multi-tensor kernels (no host sync) equal megatron's own
local loops and are installed when neither Transformer Engine nor apex is importable. The checks run in a
child process (tests/helpers/compat_check.py) because CPU mode patches torch process-wide."""
import os
import subprocess
import sys

import pytest


def test_foreach_stand_ins_equal_megatron_local(root):
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine present: megatron uses its multi-tensor kernels")
    except ImportError:
        pass
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "compat_check.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "compat foreach stand-ins: OK" in r.stdout
