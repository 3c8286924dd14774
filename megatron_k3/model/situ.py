r"""SiTU-GLU: the bounded gated activation of every K3 FFN.

    act(g) = beta * tanh(g / beta) * sigmoid(g)                 (beta = 4)
    lin(u) = beta_l * tanh(u / beta_l)                           (beta_l = 25)
    h      = act(g) * lin(u)          computed in fp32, cast back; |h| <= beta * beta_l = 100

``x = [g ; u]`` is the concatenated output of the FFN's first projection (gate half first), as in the
field report's ``situ_and_mul``. Kimi Linear (the predecessor) uses ``silu(g) * u`` instead.

Two implementations, pinned to each other by tests (tests/model/test_situ.py, tests/model/test_situ_stream.py):

**Reference** (``situ``, ``situ_glu``, ``glu_activation``): plain PyTorch. Autograd saves six fp32 [R, H]
tensors per call (tanh(g/beta), sigmoid(g), beta*tanh(g/beta), tanh(u/beta_l), act, lin): 24 R H bytes.

**Streaming op** (``situ_stream``, ``situ_glu_stream``, ``glu_activation_stream``; used by every K3 FFN):
a custom autograd function that saves only its input (bf16 [R, 2H] = 4 R H bytes, 1/6 of the reference)
and recomputes tanh/sigmoid in backward. With t = tanh(g / beta), s = sigmoid(g), t_u = tanh(u / beta_l):

    forward:   h     = (beta t s) * (beta_l t_u)
    backward:  d act / dg = s * ((1 - t^2) + beta t (1 - s))
               dg    = dh * (d act / dg) * beta_l t_u
               du    = dh * (beta t s) * (1 - t_u^2)

Everything is element-wise, so the work is chunked along the token (row) axis and exact: on CUDA a Triton
kernel (``situ_triton.py``; fp32 math in registers, one pass over the bf16 input and the output;
inductor compiling these same formulas was measured 2x slower on the H200, so there is no such variant);
elsewhere (CPU, fp64) a PyTorch loop over row chunks through a constant-size fp32 workspace (``STREAM_CHUNK_ELEMS``
elements per buffer; 3 buffers forward, 5 backward), whatever R is. Inputs may be the two halves of one
[.., 2H] tensor (megatron's expert fc1 output) or two separate tensors (the dense/shared MLP's gate_proj
and up_proj outputs); the op works under activation recompute (``torch.utils.checkpoint``) like any
autograd function. It is not twice differentiable (the reference is).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


# fp32 elements per workspace buffer of the chunked PyTorch path (1 MiB in fp32): rows per chunk = this // H
STREAM_CHUNK_ELEMS = 1 << 18


def situ_gate(g: torch.Tensor, beta: float = 4.0) -> torch.Tensor:
    """beta * tanh(g / beta) * sigmoid(g)  (bounded by beta in magnitude)."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g)


def situ_linear(u: torch.Tensor, linear_beta: float = 25.0) -> torch.Tensor:
    """beta_l * tanh(u / beta_l)  (bounded by beta_l in magnitude)."""
    return linear_beta * torch.tanh(u / linear_beta)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU on separate gate/up halves, in fp32 (fp64 stays fp64), cast back to the input dtype."""
    ct = torch.float64 if g.dtype == torch.float64 else torch.float32
    out = situ_gate(g.to(ct), beta) * situ_linear(u.to(ct), linear_beta)
    return out.to(g.dtype)


def situ_glu(x: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU on a concatenated [..., 2H] input (gate half first) -> [..., H]."""
    g, u = torch.chunk(x, 2, dim=-1)
    return situ(g, u, beta, linear_beta)


def silu_glu(x: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's SwiGLU on a concatenated [..., 2H] input (gate half first)."""
    g, u = torch.chunk(x, 2, dim=-1)
    return F.silu(g) * u


def glu_activation(g: torch.Tensor, u: torch.Tensor, hidden_act: str, beta: float = 4.0,
                   linear_beta: float = 25.0) -> torch.Tensor:
    """The FFN activation selected by ``hidden_act`` on separate gate/up halves (reference version)."""
    if hidden_act == "situ":
        return situ(g, u, beta, linear_beta)
    if hidden_act == "silu":
        return F.silu(g) * u
    raise ValueError(f"unknown hidden_act {hidden_act!r}")


# ---------------------------------------------------------------------------------------------------------
# the streaming op
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _use_triton(t: torch.Tensor) -> bool:
    if not t.is_cuda or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    try:
        from .situ_triton import situ_fwd  # noqa: F401  (imported only on CUDA)
    except ImportError:
        return False
    return True


def _rows_per_chunk(R: int, H: int, chunk_elems: int) -> int:
    return max(1, min(R, chunk_elems // max(H, 1)))


def situ_forward_chunked(g, u, out, beta, linear_beta, chunk_elems: int = None):
    """out = situ(g, u) for 2-D [R, H] views (unit column stride), row chunk by row chunk through a
    constant fp32 workspace of 3 x chunk_elems elements (the same operations as ``situ``, in place)."""
    R, H = g.shape
    if R == 0 or H == 0:
        return out
    C = _rows_per_chunk(R, H, chunk_elems or STREAM_CHUNK_ELEMS)
    ws = torch.empty((3, C, H), dtype=_compute_dtype(g.dtype), device=g.device)
    for r0 in range(0, R, C):
        r1 = min(R, r0 + C)
        n = r1 - r0
        a, s, lin = ws[0, :n], ws[1, :n], ws[2, :n]
        a.copy_(g[r0:r1])
        torch.sigmoid(a, out=s)
        a.div_(beta).tanh_().mul_(beta).mul_(s)               # act = beta tanh(g/beta) sigmoid(g)
        lin.copy_(u[r0:r1]).div_(linear_beta).tanh_().mul_(linear_beta)
        out[r0:r1].copy_(a.mul_(lin))
    return out


def situ_backward_chunked(g, u, dy, dg, du, beta, linear_beta, chunk_elems: int = None):
    """(dg, du) of ``situ`` for 2-D [R, H] views, recomputing tanh/sigmoid per row chunk in a constant
    fp32 workspace of 5 x chunk_elems elements."""
    R, H = g.shape
    if R == 0 or H == 0:
        return dg, du
    C = _rows_per_chunk(R, H, chunk_elems or STREAM_CHUNK_ELEMS)
    ws = torch.empty((5, C, H), dtype=_compute_dtype(g.dtype), device=g.device)
    for r0 in range(0, R, C):
        r1 = min(R, r0 + C)
        n = r1 - r0
        x, s, t, tu, d = ws[0, :n], ws[1, :n], ws[2, :n], ws[3, :n], ws[4, :n]
        x.copy_(g[r0:r1])
        torch.sigmoid(x, out=s)
        t.copy_(x).div_(beta).tanh_()                         # t = tanh(g / beta)
        x.copy_(s).neg_().add_(1).mul_(t).mul_(beta)          # beta t (1 - s)
        x.addcmul_(t, t, value=-1).add_(1).mul_(s)            # d act / dg = s ((1 - t^2) + beta t (1 - s))
        s.mul_(t).mul_(beta)                                  # act = beta t s
        tu.copy_(u[r0:r1]).div_(linear_beta).tanh_()          # t_u = tanh(u / beta_l)
        d.copy_(dy[r0:r1])
        dg[r0:r1].copy_(x.mul_(d).mul_(tu).mul_(linear_beta))  # dh * act' * lin
        tu.mul_(tu).neg_().add_(1)                            # lin' = 1 - t_u^2
        du[r0:r1].copy_(s.mul_(d).mul_(tu))                   # dh * act * lin'
    return dg, du


def _fwd(g2, u2, out2, beta, linear_beta):
    if _use_triton(g2):
        from .situ_triton import situ_fwd

        return situ_fwd(g2, u2, out2, beta, linear_beta)
    return situ_forward_chunked(g2, u2, out2, beta, linear_beta)


def _bwd(g2, u2, dy2, dg2, du2, beta, linear_beta):
    if _use_triton(g2):
        from .situ_triton import situ_bwd

        return situ_bwd(g2, u2, dy2, dg2, du2, beta, linear_beta)
    return situ_backward_chunked(g2, u2, dy2, dg2, du2, beta, linear_beta)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [R, last] view with unit column stride (copies only if the input has none)."""
    if t.dim() == 0:
        raise ValueError("SiTU-GLU needs at least one dimension")
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


class SiTUGLUFunction(torch.autograd.Function):
    """Streaming SiTU-GLU on a concatenated [..., 2H] input; saves only the input."""

    @staticmethod
    def forward(ctx, x, beta: float, linear_beta: float):
        if x.shape[-1] % 2:
            raise ValueError(f"SiTU-GLU needs an even last dimension, got {x.shape[-1]}")
        H = x.shape[-1] // 2
        ctx.save_for_backward(x)
        ctx.beta, ctx.linear_beta = beta, linear_beta
        x2 = _rows(x)
        out = torch.empty(x.shape[:-1] + (H,), dtype=x.dtype, device=x.device)
        _fwd(x2[:, :H], x2[:, H:], out.view(-1, H), beta, linear_beta)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        H = x.shape[-1] // 2
        x2 = _rows(x)
        dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        _bwd(x2[:, :H], x2[:, H:], _rows(dy.to(x.dtype)), dx[:, :H], dx[:, H:], ctx.beta, ctx.linear_beta)
        return dx.view(x.shape), None, None


class SiTUFunction(torch.autograd.Function):
    """Streaming SiTU-GLU on separate gate/up tensors [..., H]; saves only the two inputs."""

    @staticmethod
    def forward(ctx, g, u, beta: float, linear_beta: float):
        if g.shape != u.shape:
            raise ValueError(f"gate {tuple(g.shape)} and up {tuple(u.shape)} differ in shape")
        u = u.to(g.dtype)
        out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        if g.numel():
            _fwd(_rows(g), _rows(u), out.view(-1, g.shape[-1]), beta, linear_beta)
        ctx.save_for_backward(g, u)
        ctx.beta, ctx.linear_beta, ctx.u_dtype = beta, linear_beta, u.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        du = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        if g.numel():
            H = g.shape[-1]
            _bwd(_rows(g), _rows(u), _rows(dy.to(g.dtype)), dg.view(-1, H), du.view(-1, H), ctx.beta,
                 ctx.linear_beta)
        return dg, du, None, None


def situ_glu_stream(x: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Streaming SiTU-GLU on a concatenated [..., 2H] input (gate half first) -> [..., H]."""
    return SiTUGLUFunction.apply(x, float(beta), float(linear_beta))


def situ_stream(g: torch.Tensor, u: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Streaming SiTU-GLU on separate gate/up halves [..., H] -> [..., H]."""
    return SiTUFunction.apply(g, u, float(beta), float(linear_beta))


def glu_activation_stream(g: torch.Tensor, u: torch.Tensor, hidden_act: str, beta: float = 4.0,
                          linear_beta: float = 25.0) -> torch.Tensor:
    """``glu_activation`` with SiTU through the streaming op (what the K3 FFNs call)."""
    if hidden_act == "situ":
        return situ_stream(g, u, beta, linear_beta)
    return glu_activation(g, u, hidden_act, beta, linear_beta)
