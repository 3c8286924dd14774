"""compat item 7: the foreach stand-ins for apex's multi-tensor kernels (no host sync) equal megatron's own
local loops and are installed when neither Transformer Engine nor apex is importable; item 8: megatron's
per-step router walks over cached router lists give what the full walks give; item 9: megatron's gradient
norm and clip without host sync or per-step filters give megatron's own results. The checks run in child
processes (tests/helpers/) because CPU mode patches torch process-wide."""
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


def test_coalesced_float16_params_train_bit_identically(root):
    """runtime.coalesce_float16_params (bf16 parameters and fp32 masters in flat buffers, one copy per step):
    three bf16 steps of k3-tiny give bit-identical losses, parameters and masters to megatron's own layout
    (tests/helpers/coalesce_check.py)."""
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "coalesce_check.py"), "29745"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "coalesce check OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_cached_router_walks_equal_megatron(root):
    """compat item 8 and runtime.moe_routers' cache (tests/helpers/router_walk_check.py): megatron's expert-bias
    update through the cached walk is bit-identical to the original on k3-tiny with MTP, the reset zeroes every
    router's token counts, and the cached router list equals a fresh walk."""
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "router_walk_check.py"), "29747"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "router walk check OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_lean_grad_clipping_equals_megatron(root):
    """compat item 9 (tests/helpers/lean_clip_check.py): megatron's gradient norm and clip through a cached
    selection of gradients and a device-tensor clip coefficient: the same gradients as megatron's filter, no
    host read inside the optimizer step, bit-identical training to megatron's tensor path, and one step of the
    float path's update up to the coefficient's rounding."""
    from megatron_k3.launch_env import free_port

    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "lean_clip_check.py"), str(free_port())],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "lean clip check OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
