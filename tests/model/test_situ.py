"""SiTU-GLU: bounded by beta * beta_l = 100, correct values, and gradients that match finite differences."""
import torch

from megatron_k3.model.situ import situ, situ_glu


def test_bounded_by_100():
    x = torch.cat([torch.randn(1000, 64) * 1e3, torch.full((1, 64), 1e30), torch.full((1, 64), -1e30)])
    h = situ_glu(x)
    assert torch.isfinite(h).all()
    assert h.abs().max() <= 100.0
    assert h.abs().max() > 99.0  # the bound is approached, not an artefact of small inputs


def test_values_by_hand():
    g = torch.tensor([0.0, 1.0, -2.0, 8.0], dtype=torch.float64)
    u = torch.tensor([3.0, -1.0, 50.0, 0.0], dtype=torch.float64)
    import math

    def ref(a, b):
        sig = 1 / (1 + math.exp(-a))
        return 4 * math.tanh(a / 4) * sig * 25 * math.tanh(b / 25)

    expect = torch.tensor([ref(a, b) for a, b in zip(g.tolist(), u.tolist())], dtype=torch.float64)
    torch.testing.assert_close(situ(g, u), expect)
    torch.testing.assert_close(situ_glu(torch.cat([g, u])), expect)


def test_fp32_math_for_bf16_input():
    x = torch.randn(7, 10) * 5
    out = situ_glu(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), situ_glu(x.bfloat16().float()), rtol=1e-2, atol=1e-2)


def test_gradient_matches_finite_differences():
    x = (torch.randn(5, 6, dtype=torch.float64) * 4).requires_grad_()
    assert torch.autograd.gradcheck(situ_glu, (x,), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradgradcheck(situ_glu, (x,), eps=1e-6, atol=1e-5)
