"""The streaming SiTU-GLU op against the reference ``situ_glu``: values and gradients (fp32 to 1e-6, bf16
within bf16 rounding, fp64 gradcheck), saved bytes measured with autograd saved-tensor hooks (1/6 of the
reference for bf16), constant workspace chunking, recompute, the FFN modules, and the Triton kernels'
indexing under the Triton interpreter."""
import pytest
import torch

from megatron_k3.model import situ as S
from megatron_k3.model.situ import situ, situ_glu, situ_glu_stream, situ_stream

ODD_SHAPES = [(1, 2), (7, 10), (13, 2 * 37), (3, 5, 2 * 19), (129, 2 * 65)]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 6  # spans both tanh saturations
    x.view(-1)[:3] = torch.tensor([0.0, 60.0, -80.0], dtype=torch.float64)[: x.numel()][:3]
    return x.to(dtype)


def _fwd_bwd(fn, x, dy):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


def _close(a, b, rel, elementwise=False):
    """fp32: max |a - b| <= rel * max |b| (the tensor's scale: a gradient's ulp-level differences near its
    zeros are not relative errors). bf16 (elementwise): |a - b| <= rel * |b| + 1e-6 * max |b| (one rounding)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().clamp(min=1e-30)
    if elementwise:
        bad = (a - b).abs() > rel * b.abs() + 1e-6 * scale
        assert not bool(bad.any()), f"{int(bad.sum())} elements off, e.g. {a[bad][:4]} vs {b[bad][:4]}"
    else:
        err = float((a - b).abs().max() / scale)
        assert err <= rel, err


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_fp32_equals_reference(shape):
    x = _inputs(shape, torch.float32)
    dy = _inputs(shape[:-1] + (shape[-1] // 2,), torch.float32, seed=1)
    y0, dx0 = _fwd_bwd(situ_glu, x, dy)
    y1, dx1 = _fwd_bwd(situ_glu_stream, x, dy)
    _close(y1, y0, 1e-6)  # same fp32 operations; tanh may differ by an ulp (vectorised vs strided loop)
    _close(dx1, dx0, 1e-6)


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_bf16_within_bf16_rounding(shape):
    x = _inputs(shape, torch.bfloat16)
    dy = _inputs(shape[:-1] + (shape[-1] // 2,), torch.bfloat16, seed=1)
    y0, dx0 = _fwd_bwd(situ_glu, x, dy)
    y1, dx1 = _fwd_bwd(situ_glu_stream, x, dy)
    assert y1.dtype == dx1.dtype == torch.bfloat16
    _close(y1, y0, 2 ** -7, elementwise=True)
    _close(dx1, dx0, 2 ** -7, elementwise=True)  # one bf16 rounding apart at most (8 significant bits)


def test_fp64_gradcheck_and_split_form():
    x = (torch.randn(5, 6, dtype=torch.float64) * 4).requires_grad_()
    assert torch.autograd.gradcheck(situ_glu_stream, (x,), eps=1e-6, atol=1e-7)
    g = (torch.randn(4, 3, dtype=torch.float64) * 5).requires_grad_()
    u = (torch.randn(4, 3, dtype=torch.float64) * 30).requires_grad_()
    assert torch.autograd.gradcheck(situ_stream, (g, u), eps=1e-6, atol=1e-7)
    torch.testing.assert_close(situ_stream(g, u), situ(g, u), rtol=1e-15, atol=1e-13)


def test_split_form_equals_cat_form():
    x = _inputs((11, 2 * 23), torch.float32)
    dy = _inputs((11, 23), torch.float32, seed=3)
    y0, dx0 = _fwd_bwd(situ_glu_stream, x, dy)
    g = x[:, :23].clone().requires_grad_()
    u = x[:, 23:].clone().requires_grad_()
    y1 = situ_stream(g, u)
    y1.backward(dy)
    assert torch.equal(y1, y0) and torch.equal(torch.cat([g.grad, u.grad], -1), dx0)


def test_non_contiguous_and_empty_inputs():
    x = _inputs((2 * 29, 9, 2 * 7), torch.float32).transpose(0, 1)  # non-contiguous rows
    dy = torch.randn(9, 2 * 29, 7)
    y0, dx0 = _fwd_bwd(situ_glu, x, dy)
    y1, dx1 = _fwd_bwd(situ_glu_stream, x, dy)
    _close(y1, y0, 1e-6)
    _close(dx1, dx0, 1e-6)
    e = torch.zeros(0, 8, requires_grad=True)
    situ_glu_stream(e).sum().backward()
    assert e.grad.shape == (0, 8)


def test_chunking_is_exact_and_workspace_constant(monkeypatch):
    """Any chunk size gives the same bits; the workspace is chunk-sized, not input-sized."""
    x = _inputs((97, 2 * 31), torch.bfloat16)
    dy = _inputs((97, 31), torch.bfloat16, seed=2)
    y0, dx0 = _fwd_bwd(situ_glu_stream, x, dy)
    sizes = []
    real_empty = torch.empty

    def spy(*a, **k):
        t = real_empty(*a, **k)
        if k.get("dtype") == torch.float32:
            sizes.append(t.numel())
        return t

    for chunk in (31, 5 * 31, 1000):
        monkeypatch.setattr(S, "STREAM_CHUNK_ELEMS", chunk)
        monkeypatch.setattr(S.torch, "empty", spy)
        sizes.clear()
        y1, dx1 = _fwd_bwd(situ_glu_stream, x, dy)
        monkeypatch.setattr(S.torch, "empty", real_empty)
        assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
        rows = max(1, chunk // 31)
        assert sizes == [3 * rows * 31, 5 * rows * 31]  # forward and backward workspaces only


def _saved_bytes(fn, x):
    seen, total = set(), [0]

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += st.nbytes()
        return t

    x = x.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    y.sum().backward()
    return total[0]


def test_saved_bytes_one_sixth_of_reference():
    R, H = 257, 96
    x = _inputs((R, 2 * H), torch.bfloat16)
    naive = _saved_bytes(situ_glu, x)
    stream = _saved_bytes(situ_glu_stream, x)
    assert naive == 6 * R * H * 4          # six fp32 [R, H] tensors
    assert stream == R * 2 * H * 2         # the bf16 input only
    assert stream * 6 <= naive


def test_under_activation_recompute():
    from torch.utils.checkpoint import checkpoint

    x = _inputs((33, 2 * 17), torch.float32)
    dy = torch.randn(33, 17)
    y0, dx0 = _fwd_bwd(situ_glu_stream, x, dy)
    y1, dx1 = _fwd_bwd(lambda t: checkpoint(situ_glu_stream, t, use_reentrant=False), x, dy)
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)


def test_ffn_modules_use_the_op_and_match_reference():
    """The golden MLP/Expert and megatron's GLUActivation call the streaming op; same math as before."""
    from megatron_k3.config import get_preset
    from megatron_k3.parallel.layers import GLUActivation
    from megatron_k3.model.moe import MLP
    from megatron_k3.model.situ import glu_activation

    cfg = get_preset("k3-tiny")
    torch.manual_seed(0)
    mlp = MLP(cfg, 16, 24)
    for p in mlp.parameters():  # the golden modules are initialised by init_weights, not their constructors
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 16)
    calls = []
    orig = S.SiTUFunction.apply

    def spy(*a):
        calls.append(1)
        return orig(*a)

    S.SiTUFunction.apply = spy
    try:
        y = mlp(x)
    finally:
        S.SiTUFunction.apply = orig
    assert calls
    ref = mlp.down_proj(glu_activation(mlp.gate_proj(x), mlp.up_proj(x), "situ"))
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    act = GLUActivation(hidden_act="situ")
    h = torch.randn(6, 2 * 12, requires_grad=True)
    assert _saved_bytes(act, h) == h.numel() * 4
    torch.testing.assert_close(act(h), situ_glu(h), rtol=1e-6, atol=1e-6)
    act_rc = GLUActivation(hidden_act="situ", recompute=True)
    h2 = h.detach().clone().requires_grad_()
    act_rc(h2).sum().backward()
    h3 = h.detach().clone().requires_grad_()
    act(h3).sum().backward()
    assert torch.equal(h2.grad, h3.grad)


def test_triton_kernels_under_interpreter(run_triton_interpreted):
    """Indexing, strides, masking and algebra of the Triton kernels (interpreter: tanh by formula)."""
    run_triton_interpreted(r"""
from megatron_k3.model.situ import situ_glu, situ_backward_chunked
from megatron_k3.model import situ_triton as T
torch.manual_seed(0)
def close(a, b, tol):  # tol x the tensor's scale, plus one bf16 rounding elementwise for bf16
    a, b = a.double(), b.double()
    bound = tol * b.abs().max() + (2 ** -7 * b.abs() if tol > 1e-3 else 0)
    return bool(((a - b).abs() <= bound).all())
for R, H, dt, tol in ((37, 53, torch.float32, 1e-5), (5, 1030, torch.bfloat16, 1e-2)):
    x = (torch.randn(R, 2 * H) * 6).to(dt)
    g, u = x[:, :H], x[:, H:]
    out = torch.empty(R, H, dtype=dt)
    T.situ_fwd(g, u, out, 4.0, 25.0)
    ref = situ_glu(x)
    assert close(out, ref, tol), "fwd"
    dy = torch.randn(R, H).to(dt)
    dx = torch.empty(R, 2 * H, dtype=dt)
    T.situ_bwd(g, u, dy, dx[:, :H], dx[:, H:], 4.0, 25.0)
    dg, du = torch.empty(R, H, dtype=dt), torch.empty(R, H, dtype=dt)
    situ_backward_chunked(g, u, dy, dg, du, 4.0, 25.0)
    assert close(dx, torch.cat([dg, du], -1), tol), "bwd"
print("OK")
""")
