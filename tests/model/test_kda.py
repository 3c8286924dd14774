"""KDA: the token-by-token recurrence and the chunked form agree; the bounded gate stays in range."""
import pytest
import torch

from megatron_k3 import get_preset
from megatron_k3.model.kda import KimiDeltaAttention, kda_chunked, kda_gate, kda_recurrent, l2norm


def _inputs(B, T, H, K, V, dtype, seed=0, with_state=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k = l2norm(r(B, T, H, K)), l2norm(r(B, T, H, K))
    v = r(B, T, H, V)
    gate = -5.0 * torch.rand(B, T, H, K, generator=g, dtype=torch.float64)  # the K3 range (-5, 0)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    s0 = r(B, H, K, V) if with_state else None
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return [cast(t) for t in (q, k, v, gate, beta, s0)]


@pytest.mark.parametrize("T,chunk", [(37, 16), (64, 64), (1, 16), (100, 32), (5, 4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_equals_chunked_fp64(T, chunk, with_state):
    q, k, v, g, beta, s0 = _inputs(2, T, 3, 8, 6, torch.float64, seed=T, with_state=with_state)
    o1, S1 = kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o2, S2 = kda_chunked(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk)
    assert o1.dtype == torch.float64
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S2, S1, rtol=1e-10, atol=1e-10)


def test_recurrent_equals_chunked_fp32():
    q, k, v, g, beta, s0 = _inputs(2, 77, 4, 16, 16, torch.float32, seed=3)
    o1, S1 = kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o2, S2 = kda_chunked(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=32)
    torch.testing.assert_close(o2, o1, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(S2, S1, rtol=2e-5, atol=2e-5)


def test_chunked_state_carries_across_calls():
    """Splitting a sequence in two and carrying the state equals one call (what CP relies on)."""
    q, k, v, g, beta, _ = _inputs(1, 50, 2, 8, 8, torch.float64, seed=5, with_state=False)
    o, S = kda_chunked(q, k, v, g, beta, output_final_state=True, chunk_size=16)
    oa, Sa = kda_chunked(q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23], output_final_state=True,
                         chunk_size=16)
    ob, Sb = kda_chunked(q[:, 23:], k[:, 23:], v[:, 23:], g[:, 23:], beta[:, 23:], initial_state=Sa,
                         output_final_state=True, chunk_size=16)
    torch.testing.assert_close(torch.cat([oa, ob], 1), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(Sb, S, rtol=1e-10, atol=1e-10)


def test_delta_rule_single_step_by_hand():
    """One token from a zero state: S = beta k v^T, o = scale * beta <k, q> v."""
    q, k, v, g, beta, _ = _inputs(1, 1, 1, 4, 3, torch.float64, seed=9, with_state=False)
    o, S = kda_recurrent(q, k, v, g, beta, output_final_state=True)
    b = beta[0, 0, 0]
    torch.testing.assert_close(S[0, 0], b * torch.outer(k[0, 0, 0], v[0, 0, 0]))
    torch.testing.assert_close(o[0, 0, 0], 4 ** -0.5 * b * (k[0, 0, 0] @ q[0, 0, 0]) * v[0, 0, 0])


def test_lower_bound_gate_in_range():
    torch.manual_seed(0)
    H, d = 4, 8
    graw = torch.randn(3, 50, H, d) * 2           # the operating range: |exp(A) (graw + dt_bias)| < ~15
    A_log = torch.randn(H) * 0.3
    dt_bias = torch.randn(H * d) - 3
    g = kda_gate(graw, A_log, dt_bias, -5.0)
    assert g.dtype == torch.float32
    assert (g > -5).all() and (g < 0).all(), (g.min(), g.max())
    # extreme inputs saturate in fp32 but never leave [-5, 0] nor produce NaN
    g2 = kda_gate(graw * 1e4, A_log, dt_bias, -5.0)
    assert torch.isfinite(g2).all() and (g2 >= -5).all() and (g2 <= 0).all()
    # the Kimi Linear (unbounded) gate is not bounded below
    g3 = kda_gate(graw * 100, A_log, dt_bias, None)
    assert (g3 <= 0).all() and g3.min() < -5


def test_kda_layer_init_gate_range_and_impls_agree():
    cfg = get_preset("k3-tiny")
    layer = KimiDeltaAttention(cfg)
    gen = torch.Generator().manual_seed(0)
    for m in layer.modules():
        m.reset_parameters(gen) if hasattr(m, "reset_parameters") else None
    assert torch.all(layer.A_log == 0)
    dt = torch.nn.functional.softplus(layer.dt_bias)
    assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 1e-1 + 1e-6
    x = torch.randn(2, 45, cfg.hidden_size)
    y_rec = layer(x, impl="recurrent")
    y_chk = layer(x, impl="chunked")
    torch.testing.assert_close(y_chk, y_rec, rtol=1e-4, atol=1e-5)
    # causality: changing a future token does not change earlier outputs
    x2 = x.clone()
    x2[:, 30] += 1.0
    y2 = layer(x2, impl="chunked")
    torch.testing.assert_close(y2[:, :30], y_chk[:, :30])
    assert not torch.allclose(y2[:, 30:], y_chk[:, 30:])


def test_short_conv_form_choice(monkeypatch):
    """Which short-convolution form runs: the F.conv1d reference on the CPU, the compiled shifted form when
    compilation is forced; fla's Triton kernel only for CUDA tensors without a cache (compared with the
    reference on the GPU by benchmarks/bench_ops.py --parts short_conv and benchmarks/gpu_check.py --only fused)."""
    from megatron_k3.model.kda import short_conv_impl

    from megatron_k3 import perf

    x = torch.zeros(1, 4, 8)
    assert short_conv_impl(x) == "reference"
    with perf.using(short_conv="triton"):  # this project's kernels: CUDA tensors only
        assert short_conv_impl(x) == "reference"
    with perf.using(compile="all"):
        assert short_conv_impl(x) == "compiled"
        assert short_conv_impl(x, torch.zeros(1, 3, 8)) == "compiled"


def test_shifted_conv_and_gates_equal_reference_and_trace():
    """The CUDA path of the KDA/MLA glue: ``causal_conv1d_shifted`` equals the conv1d reference (with and
    without a cache), and the compiled graphs (aot_eager here) of it and of the sigmoid output gate equal
    their eager forms, values and gradients (the compiled RMSNorm: tests/model/test_attn_res.py)."""
    from megatron_k3.model.common import compiled, sigmoid_gate
    from megatron_k3.model.kda import causal_conv1d, causal_conv1d_shifted

    g = torch.Generator().manual_seed(0)
    B, T, C, K = 2, 13, 12, 4
    w = torch.randn(C, 1, K, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(B, T, C, generator=g).to(dtype)
        cache = torch.randn(B, K - 1, C, generator=g).to(dtype)
        dy = torch.randn(B, T, C, generator=g).to(dtype)
        for c in (None, cache):
            res = []
            for fn in (causal_conv1d, causal_conv1d_shifted, compiled(causal_conv1d_shifted, backend="aot_eager")):
                xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
                y = fn(xx, ww, True, c)
                y.backward(dy)
                res.append((y.float(), xx.grad.float(), ww.grad))
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            for a, b in zip(res[1], res[0]):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)
            for a, b in zip(res[2], res[1]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    o = torch.randn(B, T, 3, 8, generator=g)
    gate = torch.randn(B, T, 3, 8, generator=g).to(torch.bfloat16)
    for fn, args in ((sigmoid_gate, (o, gate, torch.bfloat16)), (sigmoid_gate, (o, gate.float(), torch.float32))):
        outs = []
        for f in (fn, compiled(fn, backend="aot_eager")):
            a = [t.clone().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t for t in args]
            y = f(*a)
            y.float().sum().backward()
            outs.append([y] + [t.grad for t in a if torch.is_tensor(t) and t.requires_grad])
        for a, b in zip(outs[1], outs[0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_short_conv_triton_kernels_under_interpreter(run_triton_interpreted):
    """The opt-in short-convolution kernels (``short_conv_triton.py``, ``--short-conv-impl triton``) against the
    fp64 reference, output and both gradients, run by Triton's interpreter on the CPU: a strided input (the
    q/k/v slice of the fused projection), T and C not multiples of the blocks (row and channel masks, the
    K-1 recomputed rows past the end), SiLU on and off, kernel sizes 4 and 2, bf16 (the interpreter truncates
    fp32 -> bf16, hence the looser bound)."""
    run_triton_interpreted(r"""
from megatron_k3.model.kda import causal_conv1d
from megatron_k3.model.short_conv_triton import short_conv_triton, supported
torch.manual_seed(0)
for B, T, C, K, dt, act, strided, tol in ((2, 70, 40, 4, torch.float32, True, True, 1e-6),
                                          (1, 5, 130, 4, torch.float32, False, False, 1e-6),
                                          (3, 66, 24, 2, torch.float32, True, False, 1e-6),
                                          (2, 129, 96, 4, torch.bfloat16, True, True, 1e-2)):
    base = torch.randn(B, T, 3 * C).to(dt)
    x = (base[..., C:2 * C] if strided else base[..., :C].contiguous()).detach().requires_grad_()
    assert x.stride(-1) == 1 and x.is_contiguous() != strided
    w = (torch.randn(C, 1, K) * 0.5).requires_grad_()
    assert supported(x, w)
    y = short_conv_triton(x, w, act)
    dy = torch.randn(B, T, C).to(dt)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = causal_conv1d(x64, w64, act)
    rx, rw = torch.autograd.grad(yr, (x64, w64), dy.double())
    errs = (rel(y, yr), rel(gx, rx), rel(gw, rw))
    assert y.dtype == gx.dtype == dt and gw.shape == w.shape and all(e <= tol for e in errs), (B, T, C, K, dt, errs)
assert not supported(torch.zeros(2, 3)) and not supported(torch.zeros(1, 2, 3, dtype=torch.float64))
print("OK")
""")
