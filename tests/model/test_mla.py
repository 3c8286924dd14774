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
