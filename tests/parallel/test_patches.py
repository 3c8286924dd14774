"""patch 7 (patches/foreach_kernels.py): the foreach stand-ins for apex's multi-tensor kernels (no host sync) equal megatron's own
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
    """patches.coalesced_master_copy.coalesce_float16_params (bf16 parameters and fp32 masters in flat buffers, one copy per step):
    three bf16 steps of k3-tiny give bit-identical losses, parameters and masters to megatron's own layout;
    and torch's fused AdamW stepped by foreach_kernels.LeanFusedAdamWStep equals torch's own fused step
    (tests/helpers/coalesce_check.py)."""
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "coalesce_check.py"), "29745"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "coalesce check OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_cached_router_walks_equal_megatron(root):
    """patch 8 (patches/router_walks.py) and runtime.moe_routers' cache (tests/helpers/router_walk_check.py): megatron's expert-bias
    update through the cached walk is bit-identical to the original on k3-tiny with MTP, the reset zeroes every
    router's token counts, and the cached router list equals a fresh walk."""
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "router_walk_check.py"), "29747"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "router walk check OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_lean_grad_clipping_equals_megatron(root):
    """patch 9 (patches/lean_grad_clip.py) (tests/helpers/lean_clip_check.py): megatron's gradient norm and clip through a cached
    selection of gradients and a device-tensor clip coefficient: the same gradients as megatron's filter, no
    host read inside the optimizer step, bit-identical training to megatron's tensor path, and one step of the
    float path's update up to the coefficient's rounding."""
    from megatron_k3.train.launch_env import free_port

    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "lean_clip_check.py"), str(free_port())],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "lean clip check OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def _adamw_pair(lean: bool):
    import torch

    from megatron_k3.patches.foreach_kernels import LeanFusedAdamWStep

    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((64, 33), (7,), (1,), (128, 5))]
    opt = torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2,
                            betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    if lean:
        opt.step = LeanFusedAdamWStep(opt)
    grads = [torch.zeros_like(p) for p in ps]  # like megatron's main_grad: the same tensors every step
    return ps, opt, grads


def test_lean_fused_adamw_step_is_torchs_step():
    """foreach_kernels.LeanFusedAdamWStep (torch's fused AdamW launches without its per-parameter list building) gives
    torch's fused AdamW bit for bit over steps with changing lr and gradients, and falls back to torch's step
    (then lists again) when a gradient or a state tensor is replaced, as a checkpoint restore replaces them."""
    import torch

    runs = {}
    for lean in (False, True):
        ps, opt, grads = _adamw_pair(lean)
        g = torch.Generator().manual_seed(1)
        trace = []
        for step in range(8):
            for p, gr in zip(ps, grads):
                gr.copy_(torch.randn(gr.shape, generator=g))
                p.grad = gr
            if step == 4:  # a restore replaces a moment (k3ckpt._restore assigns new tensors)
                opt.state[ps[1]]["exp_avg"] = opt.state[ps[1]]["exp_avg"].clone() * 0.5
            if step == 6:  # a new gradient tensor
                ps[3].grad = grads[3].clone()
            for grp in opt.param_groups:
                grp["lr"] = 1e-2 / (step + 1)
            opt.step()
            trace.append([p.detach().clone() for p in ps] + [opt.state[p][k].clone() for p in ps
                                                              for k in ("exp_avg", "exp_avg_sq", "step")])
        runs[lean] = (trace, opt)
    for a, b in zip(runs[False][0], runs[True][0]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    lean_opt = runs[True][1]
    # torch's step ran at steps 0 (state creation), 4 (a moment replaced), 6 and 7 (a gradient replaced, then
    # the original one back); the lean path at 1, 2, 3 and 5
    assert lean_opt.step.lean_steps == 4, lean_opt.step.lean_steps
