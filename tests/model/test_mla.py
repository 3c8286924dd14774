"""The attention core's kernel choice (``megatron_k3.model.mla.sdpa_backends``): the same values whatever the
order, and a clear error for an unknown choice. Which kernel runs on the H200, and how far cuDNN's is from the
memory-efficient one there, is ``benchmarks/gpu_check.py --only sdpa``."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_k3.model.mla import causal_attention, sdpa_backends


def test_sdpa_backend_choice():
    from megatron_k3 import perf
    from megatron_k3.config import ConfigError

    assert sdpa_backends(cuda=True) is None
    assert sdpa_backends(cuda=True, choice="cudnn")[0] == SDPBackend.CUDNN_ATTENTION  # explicit beats the setting
    with perf.using(sdpa_backend="cudnn"):
        order = sdpa_backends(cuda=True)
        assert order[0] == SDPBackend.CUDNN_ATTENTION and SDPBackend.MATH in order
        assert sdpa_backends(cuda=False) is None  # CPU keeps torch's order
    with pytest.raises(ValueError, match="sdpa_backend='cudnn9'"):
        sdpa_backends(cuda=True, choice="cudnn9")
    with pytest.raises(ConfigError, match="perf.sdpa_backend = 'cudnn9': choose one of auto, cudnn"):
        perf.configure(sdpa_backend="cudnn9")


def test_cudnn_first_order_is_a_valid_priority_list_with_the_same_values():
    """The order ``--sdpa-backend cudnn`` gives, applied as ``causal_attention`` applies it on CUDA
    (``set_priority``), is accepted by this torch and, on CPU, falls through to a kernel with the default's
    values (cuDNN's kernel exists only on CUDA)."""
    from megatron_k3 import perf

    perf.configure(sdpa_backend="cudnn")
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 16, 12, generator=g) for _ in range(2))
    v = torch.randn(2, 3, 16, 8, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    with sdpa_kernel(sdpa_backends(cuda=True), set_priority=True):
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(got, want)
    out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.3)
    torch.testing.assert_close(out.transpose(1, 2), want)
    perf.configure(sdpa_backend="auto")


def test_heads_first_qkv_is_the_plain_split_and_cat():
    """``heads_first_qkv`` (what ``project_qkv`` returns; compiled on CUDA) equals the split + head concatenation
    it replaced, bit for bit, eager and traced (aot_eager: the graph the CUDA path compiles), gradients
    included; its outputs are [B,T,H,*] views of contiguous [B,H,T,*] tensors."""
    from megatron_k3.model.common import compiled
    from megatron_k3.model.mla import heads_first_qkv

    g = torch.Generator().manual_seed(0)
    B, T, H, nope, rope, vd = 2, 5, 3, 4, 2, 6
    q0, kv0, kr0 = (torch.randn(*s, generator=g) for s in ((B, T, H, nope + rope), (B, T, H, nope + vd), (B, T, rope)))
    dq, dk, dv = (torch.randn(B, T, H, d, generator=g) for d in (nope + rope, nope + rope, vd))
    q, kv, kr = (t.clone().requires_grad_() for t in (q0, kv0, kr0))
    k_nope, v = kv.split([nope, vd], dim=-1)
    k = torch.cat([k_nope, kr.unsqueeze(2).expand(B, T, H, rope)], dim=-1)
    ref = (q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, kv, kr), (dq, dk, dv))
    for fn in (heads_first_qkv, compiled(heads_first_qkv, backend="aot_eager")):
        q, kv, kr = (t.clone().requires_grad_() for t in (q0, kv0, kr0))
        out = fn(q, kv, kr, nope)
        for a, b in zip(out, ref):
            assert torch.equal(a, b) and a.transpose(1, 2).is_contiguous()
        for a, b in zip(torch.autograd.grad(out, (q, kv, kr), (dq, dk, dv)), ref_grads):
            assert torch.equal(a, b)
