"""Small shared pieces of the reference model: RMSNorm and explicit initialisers.

RMSNorm (everywhere in K3):  y = weight * x * rsqrt(mean(x^2) + eps), computed in fp32, plain gain
(not 1 + w), cast back to the input dtype.

Initialisation is explicit for every parameter (the released inference code leaves ``dt_bias`` and the
router bias as ``torch.empty``): every module owning parameters implements ``reset_parameters(gen)``
with a ``torch.Generator`` so a seed fully determines the weights.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..perf import current as current_kernels


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype K3's "computed in fp32" math uses: fp32, except that fp64 stays fp64 (exactness tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------------
# Fast GPU path of the element-wise glue: the same plain-PyTorch functions, compiled by torch.compile
# (inductor: one or two fused kernels per function instead of a dozen launches and fp32 round trips through
# memory). ``perf.current().compile``: "auto" (default) compiles for CUDA tensors with autograd on, "off" never,
# "all" always and on every device (tests); ``compile_backend`` picks the backend (default inductor). CPU
# runs the reference eagerly by default.
# Tests pin the traced graphs to eager (tests/model/test_attn_res.py, tests/model/test_kda.py; benchmarks/gpu_check.py).
_COMPILED: dict = {}


def compile_enabled(t: torch.Tensor, grad_only: bool = True) -> bool:
    """Whether to take the compiled path for ``t``. By default only with autograd on (training, and
    recomputation in backward): inference and evaluation see a new sequence length at almost every call
    (generation, HellaSwag), and a graph per shape would mean recompiling each time, then failing at the
    per-function graph limit, so they run eagerly."""
    mode = current_kernels().compile
    if mode == "all":
        return True
    return mode == "auto" and t.is_cuda and (torch.is_grad_enabled() or not grad_only)


def compiled(fn, backend: str | None = None):
    """``fn`` compiled once per backend (whole graph, static shapes: one graph per distinct shape)."""
    backend = backend or current_kernels().compile_backend
    key = (fn, backend)
    if key not in _COMPILED:
        # one graph per (shape, dtype, grad mode): the AttnRes mixer alone sees up to L / block + 1 candidate
        # counts in and out of recompute (k3-full: 10 x 2), past dynamo's default of 8 graphs per function,
        # beyond which a fullgraph compile fails hard (FailOnRecompileLimitHit, measured with torch 2.x here)
        import torch._dynamo.config as dcfg

        for name in ("recompile_limit", "cache_size_limit"):
            if getattr(dcfg, name, 64) < 64:
                setattr(dcfg, name, 64)
        _COMPILED[key] = torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
    return _COMPILED[key]


def fast(fn, t: torch.Tensor):
    """``fn`` compiled when ``compile_enabled(t)``, else ``fn`` itself (same signature, same results)."""
    return compiled(fn) if compile_enabled(t) else fn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    ct = acc_dtype(x)
    xf = x.to(ct)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(ct)
    return y.to(x.dtype)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(o * sigmoid(gate)) in fp32, cast to ``dtype`` (the KDA and MLA output gates)."""
    ct = acc_dtype(o)
    return (o.to(ct) * torch.sigmoid(gate.to(ct))).to(dtype)


# The megatron model keeps the residual stream sequence-first [S, B, D] while the token mixers (fla's KDA,
# SDPA) work batch-first [B, S, ...]. Changing layout is a permutation of whole rows (each token's D values
# stay contiguous), so it can be the output layout of the element-wise kernel next to it instead of a copy of
# its own: compiled, each of these is one kernel forward and one backward. Eager they are the two steps.
def rms_norm_batch_first(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``rms_norm`` of ``x`` [S, B, D], written batch-first [B, S, D] (contiguous)."""
    return rms_norm(x, weight, eps).transpose(0, 1).contiguous()


def sigmoid_gate_seq_first(o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sigmoid_gate`` of ``o`` [B, T, ...] (trailing dims flattened: heads x head dim) and ``gate`` [B, T, N],
    written sequence-first [T, B, N] (contiguous) for the output projection."""
    B, T = o.shape[:2]
    return sigmoid_gate(o.reshape(B, T, -1), gate.reshape(B, T, -1), dtype).transpose(0, 1).contiguous()


def rms_norm_gate_seq_first(o: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    """KDA's per-head output norm in fp32 (``rms_norm(o.float(), weight)``, o [B, T, H, d]) then
    ``sigmoid_gate_seq_first``: compiled, one kernel forward and one backward, without the fp32 copy of o and
    the fp32 normalised o between the two steps (4 x 4096 tokens, H d = 1024: 64 MB written and read again
    each way per layer and micro-batch)."""
    return sigmoid_gate_seq_first(rms_norm(o.to(acc_dtype(o)), weight, eps), gate, dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def reset_parameters(self, gen: torch.Generator | None = None):
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast(rms_norm, x)(x, self.weight, self.eps)


class Linear(nn.Module):
    """A bias-free linear layer (weight [out, in], like nn.Linear) whose init is explicit: normal(0, std)."""

    def __init__(self, in_features: int, out_features: int, std: float = 0.02, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.init_std = in_features, out_features, std
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def reset_parameters(self, gen: torch.Generator | None = None):
        normal_(self.weight, self.init_std, gen)

    fusable = True  # several of one class may run as one GEMM on their concatenated weights (fused_linears)

    def gemm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """This class's GEMM ``x @ w.T`` (FP8 subclasses: ``parallel/precision.py``)."""
        return F.linear(x, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _fp32_cpu_buffer(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is an fp32 CPU tensor (values are drawn in place: no second full-size copy), else a
    new fp32 CPU tensor of its shape."""
    return t if (t.dtype == torch.float32 and t.device.type == "cpu") else torch.empty(t.shape, dtype=torch.float32)


def normal_(t: torch.Tensor, std: float, gen: torch.Generator | None):
    """In-place normal(0, std) drawn in fp32 on the CPU generator (device/dtype independent)."""
    with torch.no_grad():
        v = _fp32_cpu_buffer(t)
        v.normal_(generator=gen)
        v.mul_(std)
        if v is not t:
            t.copy_(v.to(t.dtype))
    return t


def uniform_(t: torch.Tensor, low: float, high: float, gen: torch.Generator | None):
    with torch.no_grad():
        v = _fp32_cpu_buffer(t)
        v.uniform_(generator=gen)
        v.mul_(high - low).add_(low)
        if v is not t:
            t.copy_(v.to(t.dtype))
    return t


def inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    """y such that softplus(y) = x (for x > 0)."""
    return x + torch.log(-torch.expm1(-x))


def scaled_init_std(std: float, num_layers: int) -> float:
    """Output-projection std (megatron's scaled init): std / sqrt(2 * num_layers)."""
    return std / math.sqrt(2.0 * num_layers)
