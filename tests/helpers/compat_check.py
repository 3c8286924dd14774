"""Run by tests/parallel/test_patches.py in a child process (CPU mode patches torch process-wide): patch 7's (patches/foreach_kernels.py)
foreach stand-ins for apex's multi-tensor kernels equal megatron's own local loops (which they replace when
neither Transformer Engine nor apex is importable), and are the ones megatron calls."""
import sys
import torch

from megatron_k3 import compat
from megatron_k3.patches import foreach_kernels

compat.setup_device()


def _tensors(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(7,), (3, 5), (64, 33), (1,), (0,), (128, 17, 3)]
    return [torch.randn(s, generator=g).to(dtype) * (i + 1) for i, s in enumerate(shapes)]


def test_l2_norm_equals_megatron_local(dtype):
    from megatron.core.utils import local_multi_tensor_l2_norm

    ts = _tensors(dtype)
    ours, _ = foreach_kernels.foreach_l2_norm(2048, None, [ts], False)
    ref, _ = local_multi_tensor_l2_norm(2048, None, [ts], False)
    assert ours.shape == (1,) and ours.dtype == torch.float32
    exact = float(torch.sqrt(sum((t.double() ** 2).sum() for t in ts)))
    if dtype == torch.float32:  # megatron's grads for the norm are fp32 main grads
        torch.testing.assert_close(ours.cpu(), ref.cpu(), rtol=1e-6, atol=0)
        assert abs(float(ours) - exact) / exact < 1e-5
    else:  # ours accumulates in fp32 (like apex's kernel); megatron's loop rounds each norm to bf16
        assert abs(float(ours) - exact) / exact < 1e-5 and abs(float(ref) - exact) / exact < 8e-3


def test_scale_equals_megatron_local(scale):
    from megatron.core.utils import local_multi_tensor_scale

    src = _tensors(torch.float32)
    for dst_dtype in (torch.float32, torch.bfloat16):
        a = [torch.full_like(t, 9.0, dtype=dst_dtype) for t in src]
        b = [torch.full_like(t, 9.0, dtype=dst_dtype) for t in src]
        foreach_kernels.foreach_scale(2048, None, [src, a], scale)
        local_multi_tensor_scale(2048, None, [src, b], scale)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    # in place (megatron's grad clipping passes [grads, grads])
    a, b = _tensors(torch.float32), _tensors(torch.float32)
    foreach_kernels.foreach_scale(2048, None, [a, a], scale)
    local_multi_tensor_scale(2048, None, [b, b], scale)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_installed_when_no_te_or_apex():
    from megatron.core.optimizer import clip_grads, optimizer as mopt

    assert clip_grads.l2_norm_impl is foreach_kernels.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_kernels.foreach_scale
    assert mopt.multi_tensor_scale_impl is foreach_kernels.foreach_scale
    # megatron's gradient-norm entry point gives the exact norm through them
    g = _tensors(torch.float32)
    ps = []
    for t in g:
        p = torch.nn.Parameter(torch.zeros_like(t))
        p.grad = t.clone()
        ps.append(p)
    import torch.distributed as dist

    if not dist.is_initialized():
        import tempfile

        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", world_size=1, rank=0)
    norm = clip_grads.get_grad_norm_fp32([p.grad for p in ps if p.numel()])
    exact = float(torch.sqrt(sum((t.double() ** 2).sum() for t in g)))
    assert abs(norm - exact) / exact < 1e-5


if __name__ == "__main__":
    for dt in (torch.float32, torch.bfloat16):
        test_l2_norm_equals_megatron_local(dt)
    for sc in (1.0, 0.37):
        test_scale_equals_megatron_local(sc)
    test_installed_when_no_te_or_apex()
    print("compat foreach stand-ins: OK")
    sys.exit(0)
