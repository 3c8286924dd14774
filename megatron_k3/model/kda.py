r"""Kimi Delta Attention (KDA): gated delta rule with a per-channel (diagonal) decay.

P = H*d (H heads of head_dim d), D = hidden size::

    q = SiLU(CausalDWConv_4(q_proj x));  k = SiLU(CausalDWConv_4(k_proj x));  v = SiLU(CausalDWConv_4(v_proj x))
    graw = f_b_proj(f_a_proj(x))                                   # D -> d -> P (low rank)
    beta = sigmoid(b_proj x)                                       # D -> H
    g    = lower_bound * sigmoid(exp(A_log)[h] * (graw + dt_bias))  # K3: g in (lower_bound, 0) = (-5, 0)
         = -exp(A_log)[h] * softplus(graw + dt_bias)               # Kimi Linear (unbounded)
    q, k <- q/||q||, k/||k|| per head (eps 1e-6);  scale = d^-1/2
    per head:  S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T ;   o_t = scale * S_t^T q_t
    out = o_proj( RMSNorm_d(o) * o_norm.weight * sigmoid(g_proj x) )  # K3: g_proj full rank D -> P

Two exact pure-PyTorch forms of the recurrence live here (the reference the tests use):

* ``kda_recurrent``: token by token, the definition above (code order:
  ``S *= exp(g)[:, None]; S += k (x) beta (v - S^T k); o = S^T q``).
* ``kda_chunked``: the chunkwise (WY) form. Inside a chunk with in-chunk cumulative log decay
  ``G_i = sum_{j<=i} g_j`` and the incoming state ``S_0``, the delta-rule corrections
  ``u_i = beta_i (v_i - (Diag(e^{g_i}) S_{i-1})^T k_i)`` solve the unit lower-triangular system
  ``(I + A) U = beta * (V - (e^{G} * K) S_0)`` with ``A_ij = beta_i <k_i * e^{G_i - G_j}, k_j>`` (j < i), then
  ``o_i = scale (S_0^T (e^{G_i} q_i) + sum_{j<=i} <q_i * e^{G_i - G_j}, k_j> u_j)`` and
  ``S_C = e^{G_C} S_0 + sum_j (e^{G_C - G_j} k_j) u_j^T``. Decays are only ever formed as differences
  ``G_i - G_j <= 0`` so nothing overflows; a ragged last chunk is zero-padded (k = v = q = 0, g = 0, beta = 0
  change neither the outputs nor the state).

On CUDA with flash-linear-attention installed, ``KimiDeltaAttention`` calls ``fla.ops.kda.chunk_kda`` with the
gate, beta sigmoid and q/k L2 norm fused in the kernel (``safe_gate=True, lower_bound=-5``); tests pin it to
``kda_chunked``. The short convolutions run fla's Triton ``causal_conv1d`` there (SiLU fused; compared with
the ``F.conv1d`` reference in fp64 on the GPU by ``benchmarks/bench_ops.py --parts short_conv`` and
``benchmarks/gpu_check.py --only fused``).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..perf import current as current_kernels
from .common import (Linear, RMSNorm, acc_dtype, compile_enabled, compiled, fast, inverse_softplus, rms_norm,
                     scaled_init_std, sigmoid_gate, uniform_)

# ----------------------------------------------------------------------------------------------------
# Functional pieces
# ----------------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's convention), in fp32."""
    xf = x.to(acc_dtype(x))
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(graw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None) -> torch.Tensor:
    """Per-channel log decay g [..., H, d] (fp32) from the low-rank gate output graw [..., H, d].

    lower_bound (K3): g = lb * sigmoid(exp(A_log)[h] * (graw + dt_bias)), in (lb, 0).
    None (Kimi Linear): g = -exp(A_log)[h] * softplus(graw + dt_bias).
    """
    H, d = graw.shape[-2:]
    ct = acc_dtype(graw)
    a = A_log.to(ct).exp().view(H, 1)
    z = graw.to(ct) + dt_bias.to(ct).view(H, d)
    if lower_bound is None:
        return -a * F.softplus(z)
    return lower_bound * torch.sigmoid(a * z)


@functools.lru_cache(maxsize=None)
def _fla_causal_conv1d():
    """fla's ``causal_conv1d`` or None; looked up once (``short_conv_impl`` asks on every CUDA call, and a
    failing import would search the path each time)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_conv  # noqa: WPS433
    except Exception:  # not installed, or no triton/GPU
        return None
    return fla_conv


def short_conv_impl(x: torch.Tensor, cache: torch.Tensor | None = None) -> str:
    """Which form ``causal_conv1d`` runs: ``fla`` (flash-linear-attention's Triton kernel, fp32 accumulation,
    SiLU fused, strided input read in place, weight gradient reduced in fp32) for CUDA tensors without a
    ``cache`` when fla is installed, ``compiled`` (``causal_conv1d_shifted`` through torch.compile) for other
    CUDA training calls, else ``reference``. ``perf.short_conv = compiled`` keeps CUDA off the fla kernel;
    ``perf.short_conv = triton`` runs this project's kernels (``short_conv_triton.py``: no forward recomputed in
    backward; opt-in until measured on a GPU) for CUDA tensors without a cache."""
    form = current_kernels().short_conv
    if x.is_cuda and cache is None and form == "triton":
        from .short_conv_triton import supported

        if supported(x):
            return "triton"
    if x.is_cuda and cache is None and form == "fla" and _fla_causal_conv1d() is not None:
        return "fla"
    return "compiled" if compile_enabled(x) else "reference"


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, activation: bool = True,
                  cache: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv over time: x [B, T, C], weight [C, 1, K] -> [B, T, C] (fp32 math, cast back).

    ``cache`` [B, K-1, C] holds the K-1 inputs preceding x (zeros if None), e.g. from a previous CP rank.
    The fast forms (``short_conv_impl``) give the same values up to fp32 summation order.
    """
    impl = short_conv_impl(x, cache)
    if impl == "triton":
        from .short_conv_triton import short_conv_triton

        return short_conv_triton(x, weight, activation)
    if impl == "fla":
        C, K = weight.shape[0], weight.shape[-1]
        y, _ = _fla_causal_conv1d()(x, weight.reshape(C, K), activation="silu" if activation else None,
                                    backend="triton")
        return y
    if impl == "compiled":
        return compiled(causal_conv1d_shifted)(x, weight, activation, cache)
    B, T, C = x.shape
    K = weight.shape[-1]
    ct = acc_dtype(x)
    xf = x.to(ct).transpose(1, 2)  # [B, C, T]
    prev = (torch.zeros(B, C, K - 1, dtype=ct, device=x.device) if cache is None
            else cache.to(ct).transpose(1, 2))
    y = F.conv1d(torch.cat([prev, xf], dim=-1), weight.to(ct), groups=C)
    if activation:
        y = F.silu(y)
    return y.transpose(1, 2).to(x.dtype)


def causal_conv1d_shifted(x: torch.Tensor, weight: torch.Tensor, activation: bool = True,
                          cache: torch.Tensor | None = None) -> torch.Tensor:
    """``causal_conv1d`` as K shifted multiply-adds in the [B, T, C] layout, y_t = sum_j w_j x_(t-K+1+j)
    (no transposes, no conv kernel: element-wise, so torch.compile fuses it with the casts and SiLU into
    one kernel; the CUDA path). Equal to ``causal_conv1d`` up to fp32 summation order."""
    B, T, C = x.shape
    K = weight.shape[-1]
    ct = acc_dtype(x)
    prev = (torch.zeros(B, K - 1, C, dtype=ct, device=x.device) if cache is None else cache.to(ct))
    xp = torch.cat([prev, x.to(ct)], dim=1)                               # [B, T + K - 1, C]
    w = weight.to(ct).reshape(C, K)
    y = xp[:, 0:T] * w[:, 0]
    for j in range(1, K):
        y = y + xp[:, j:j + T] * w[:, j]
    if activation:
        y = F.silu(y)
    return y.to(x.dtype)


def kda_recurrent(q, k, v, g, beta, scale: float | None = None, initial_state=None,
                  output_final_state: bool = False):
    """Token-by-token KDA. q,k,g: [B,T,H,K]; v: [B,T,H,V]; beta: [B,T,H]; state [B,H,K,V]. fp32 math.

    q and k are used as given (normalise them first). Returns (o [B,T,H,V] in v.dtype, final state or None). fp64 inputs compute in fp64.
    """
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    ct = acc_dtype(v)
    qf, kf, vf, gf, bf = (t.to(ct) for t in (q, k, v, g, beta))
    S = (torch.zeros(B, H, K, Vd, dtype=ct, device=q.device) if initial_state is None
         else initial_state.to(ct).clone())
    outs = []
    for t in range(T):
        S = S * gf[:, t].exp().unsqueeze(-1)                            # Diag(exp g) S
        kt, vt, bt = kf[:, t], vf[:, t], bf[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)                      # S^T k
        S = S + torch.einsum("bhk,bhv->bhkv", kt, bt.unsqueeze(-1) * (vt - pred))
        outs.append(torch.einsum("bhk,bhkv->bhv", qf[:, t] * scale, S))
    o = torch.stack(outs, dim=1).to(v.dtype)
    return o, (S if output_final_state else None)


def kda_chunked(q, k, v, g, beta, scale: float | None = None, initial_state=None,
                output_final_state: bool = False, chunk_size: int = 64):
    """Chunkwise KDA, exactly equal to ``kda_recurrent`` (see the module docstring). Same shapes."""
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    pad = (-T) % C
    ct = acc_dtype(v)
    qf, kf, vf, gf, bf = (t.to(ct) for t in (q, k, v, g, beta))
    if pad:
        qf, kf, vf, gf = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (qf, kf, vf, gf))
        bf = F.pad(bf, (0, 0, 0, pad))
    N = (T + pad) // C
    # [B, H, N, C, *]
    qf, kf, vf, gf = (t.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4) for t in (qf, kf, vf, gf))
    bf = bf.reshape(B, N, C, H).permute(0, 3, 1, 2)
    G = gf.cumsum(dim=3)                                                  # in-chunk cumulative log decay
    tri_strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    tri_incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(0)
    S = (torch.zeros(B, H, K, Vd, dtype=ct, device=q.device) if initial_state is None
         else initial_state.to(ct).clone())
    eye = torch.eye(C, dtype=ct, device=q.device)
    outs = []
    for n in range(N):
        qn, kn, vn, Gn, bn = qf[:, :, n], kf[:, :, n], vf[:, :, n], G[:, :, n], bf[:, :, n]
        # pairwise decay e^{G_i - G_j} on the key dim, masked to j <= i (differences are <= 0 there)
        diff = Gn.unsqueeze(3) - Gn.unsqueeze(2)                          # [B,H,C(i),C(j),K]
        decay = torch.where(tri_incl[..., None], diff, torch.full_like(diff, -torch.inf)).exp()
        kk = torch.einsum("bhik,bhijk,bhjk->bhij", kn, decay, kn)         # <k_i e^{G_i-G_j}, k_j>
        A = (bn.unsqueeze(-1) * kk).masked_fill(~tri_strict, 0.0)
        rhs = bn.unsqueeze(-1) * (vn - torch.einsum("bhik,bhkv->bhiv", kn * Gn.exp(), S))
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("bhik,bhijk,bhjk->bhij", qn, decay, kn)         # includes the diagonal
        o = torch.einsum("bhik,bhkv->bhiv", qn * Gn.exp(), S) + torch.einsum("bhij,bhjv->bhiv", qk, U)
        outs.append(o * scale)
        GC = Gn[:, :, -1:]                                                # [B,H,1,K]
        S = GC.squeeze(2).exp().unsqueeze(-1) * S + torch.einsum("bhjk,bhjv->bhkv", kn * (GC - Gn).exp(), U)
    o = torch.stack(outs, dim=2)                                          # [B,H,N,C,V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, Vd)[:, :T].to(v.dtype)
    return o, (S if output_final_state else None)


def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda  # noqa: WPS433
    except Exception:  # not installed, or no triton/GPU
        return None
    return chunk_kda


# ----------------------------------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------------------------------


class ShortConv(nn.Module):
    """Depthwise causal conv weight [C, 1, K] (fp32, no bias); HF name ``{q,k,v}_conv1d.weight``."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=torch.float32))

    def reset_parameters(self, gen=None):
        bound = 1.0 / math.sqrt(self.weight.shape[-1])  # nn.Conv1d's default (kaiming a=sqrt(5)) bound
        uniform_(self.weight, -bound, bound, gen)

    def forward(self, x, cache=None):
        return causal_conv1d(x, self.weight, activation=True, cache=cache)


class KimiDeltaAttention(nn.Module):
    """The KDA token mixer with the official parameter names (``layers.{i}.self_attn.*``)."""

    # parameters kept in fp32 whatever the compute dtype
    fp32_params = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight")

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        self.cfg = cfg
        D, H, d = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        P = H * d
        self.num_heads, self.head_dim = H, d
        std, out_std = cfg.init_std, scaled_init_std(cfg.init_std, cfg.num_hidden_layers)
        self.q_proj = Linear(D, P, std)
        self.k_proj = Linear(D, P, std)
        self.v_proj = Linear(D, P, std)
        self.q_conv1d = ShortConv(P, cfg.short_conv_kernel_size)
        self.k_conv1d = ShortConv(P, cfg.short_conv_kernel_size)
        self.v_conv1d = ShortConv(P, cfg.short_conv_kernel_size)
        self.f_a_proj = Linear(D, d, std)
        self.f_b_proj = Linear(d, P, std)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.b_proj = Linear(D, H, std)
        if cfg.use_full_rank_gate:
            self.g_proj = Linear(D, P, std)
        else:  # Kimi Linear: low-rank output gate
            self.g_a_proj = Linear(D, d, std)
            self.g_b_proj = Linear(d, P, std)
        self.o_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=torch.float32)
        self.o_proj = Linear(P, D, out_std)
        # head layout of the per-head matrices (blocks of d along dim): per-head Muon and TP sharding
        heads = [self.q_proj, self.k_proj, self.v_proj, self.f_b_proj]
        heads.append(self.g_proj if cfg.use_full_rank_gate else self.g_b_proj)
        for m in heads:
            m.weight.k3_heads = (0, d)
        self.o_proj.weight.k3_heads = (1, d)

    def reset_parameters(self, gen=None):
        """A_log and dt_bias (fla defaults; no official init published). Submodules init themselves."""
        with torch.no_grad():
            if self.cfg.gate_lower_bound is not None:
                self.A_log.zero_()                       # bounded gate: A = 1
            else:
                a = torch.empty(self.A_log.shape)
                uniform_(a, 1.0, 16.0, gen)              # fla's Kimi Linear init: A ~ U(1, 16)
                self.A_log.copy_(a.log())
            dt = torch.empty(self.dt_bias.shape)
            uniform_(dt, math.log(1e-3), math.log(1e-1), gen)
            dt = dt.exp().clamp(min=1e-4)
            self.dt_bias.copy_(inverse_softplus(dt))

    # ------------------------------------------------------------------------------------------
    def gate_input(self, x):
        return self.f_b_proj(self.f_a_proj(x))

    def output_gate(self, x):
        return self.g_proj(x) if self.cfg.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))

    # The forward is split in three phases so the tensor/context-parallel layer (megatron_k3.parallel)
    # can run the same math on its shard, with communication between the phases.
    def project(self, x: torch.Tensor):
        """x [B, T, D] -> per-token projections: q/k/v/graw [B, T, H, d], beta logits [B, T, H], gate [B, T, H, d]."""
        B, T, _ = x.shape
        H, d = self.num_heads, self.head_dim
        return (self.q_proj(x).view(B, T, H, d), self.k_proj(x).view(B, T, H, d), self.v_proj(x).view(B, T, H, d),
                self.gate_input(x).view(B, T, H, d), self.b_proj(x), self.output_gate(x).view(B, T, H, d))

    def mix(self, q, k, v, graw, blogit, heads: slice | None = None, initial_state=None, conv_caches=None,
            output_final_state: bool = False, impl: str = "auto", normalize: bool = True):
        """Token mixing over the full sequence for the heads in ``heads`` (default: all of this module's):
        short convs, gate, beta, the delta rule and the per-head output RMSNorm (fp32 output). Inputs
        [B, T, h, d]. ``normalize=False`` leaves the norm to the caller (o in the delta rule's dtype): the
        megatron layer runs it in one kernel with the output gate (``common.rms_norm_gate_seq_first``)."""
        B, T, h, d = q.shape
        hs = heads or slice(0, self.num_heads)
        ch = slice(hs.start * d, hs.stop * d)
        cq, ck, cv = conv_caches if conv_caches is not None else (None, None, None)
        q = causal_conv1d(q.reshape(B, T, h * d), self.q_conv1d.weight[ch], True, cq).view(B, T, h, d)
        k = causal_conv1d(k.reshape(B, T, h * d), self.k_conv1d.weight[ch], True, ck).view(B, T, h, d)
        v = causal_conv1d(v.reshape(B, T, h * d), self.v_conv1d.weight[ch], True, cv).view(B, T, h, d)
        A_log, dt_bias = self.A_log[hs], self.dt_bias[ch]
        fla = _fla_chunk_kda() if impl in ("auto", "fla") and q.is_cuda else None
        if impl == "fla" and fla is None:
            raise RuntimeError("impl='fla' needs flash-linear-attention and a CUDA tensor")
        if fla is not None and self.cfg.gate_lower_bound is not None:
            o, state = fla(q, k, v, g=graw, beta=blogit, A_log=A_log, dt_bias=dt_bias, scale=d ** -0.5,
                           initial_state=initial_state, output_final_state=output_final_state,
                           use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                           safe_gate=True, lower_bound=self.cfg.gate_lower_bound)
        else:
            g = kda_gate(graw, A_log, dt_bias, self.cfg.gate_lower_bound)
            beta = torch.sigmoid(blogit.to(acc_dtype(blogit)))
            fn = kda_recurrent if impl == "recurrent" else kda_chunked
            kw = {} if impl == "recurrent" else {"chunk_size": self.cfg.kda_chunk_size}
            o, state = fn(l2norm(q), l2norm(k), v, g, beta, scale=d ** -0.5, initial_state=initial_state,
                          output_final_state=output_final_state, **kw)
        if not normalize:
            return o, state
        o = o.to(acc_dtype(q))
        return fast(rms_norm, o)(o, self.o_norm.weight, self.o_norm.eps), state

    def gated(self, o, gate, dtype):
        """The output gate: o * sigmoid(gate); o, gate [B, T, H, d] -> [B, T, H d] in ``dtype``."""
        B, T, H, d = o.shape
        return fast(sigmoid_gate, o)(o, gate, dtype).reshape(B, T, H * d)

    def output(self, o, gate, dtype):
        """Gated output projection: o_proj(o * sigmoid(gate)); o, gate [B, T, H, d]."""
        return self.o_proj(self.gated(o, gate, dtype))

    def forward(self, x: torch.Tensor, initial_state=None, conv_caches=None, output_final_state: bool = False,
                impl: str = "auto"):
        """x [B, T, D] -> [B, T, D]. ``impl``: "auto" (fla on CUDA if installed, else chunked), "chunked",
        "recurrent" or "fla". ``initial_state``/``conv_caches`` carry state in from earlier tokens."""
        q, k, v, graw, blogit, gate = self.project(x)
        o, state = self.mix(q, k, v, graw, blogit, initial_state=initial_state, conv_caches=conv_caches,
                            output_final_state=output_final_state, impl=impl)
        out = self.output(o, gate, x.dtype)
        return (out, state) if output_final_state else out
