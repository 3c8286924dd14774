r"""Router and Stable LatentMoE, plus the SiTU-GLU MLP used by dense layers, shared and routed experts.

Router (sigmoid, aux-loss-free, one expert group)::

    s      = sigmoid(x_fp32 @ W_gate^T)                       # fp32
    choice = s + e_score_correction_bias                      # steers selection only: never gets a gradient
    idx    = topk(choice, k);  w = s[idx];  w /= (sum(w) + 1e-20);  w *= routed_scaling_factor

Stable LatentMoE::

    u = sum_{i in idx} w_i * E_i(routed_expert_down_proj x)   # D -> L (latent); E_i: w1,w3: L -> I, w2: I -> L
    y = routed_expert_up_proj( RMSNorm_L(u) ) + shared_experts(x)   # norm once, after combining

Routing runs on the full-width x. ``e_score_correction_bias`` is a persistent fp32 buffer (a balancing
state, not a parameter: the optimizer never sees it; the balancing update writes it in place). Without a
latent width (Kimi Linear) the experts act on x directly and there is no latent norm.

Each expert/MLP is ``down(act(gate(x), up(x)))`` with ``act`` SiTU-GLU (K3) or SiLU-GLU (Kimi Linear).
The reference dispatch loops over experts (exact, simple). The fast path (``grouped``; default on CUDA)
sorts the (token, slot) pairs by expert and runs every expert as one grouped GEMM per projection
(``grouped_mm``: ``torch._grouped_mm`` on CUDA, no host sync), as the megatron path does.
"""
from __future__ import annotations

import torch
from torch import nn

from .common import Linear, RMSNorm, acc_dtype, compile_enabled, compiled, normal_, scaled_init_std
from .situ import glu_activation_stream


def grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[rows of group e] = x[rows of group e] @ w_t[e]`` with group ends ``offs`` (int32): one
    ``torch._grouped_mm`` on CUDA; on the CPU (whose ``_grouped_mm`` has no backward in torch 2.14) a loop."""
    if x.is_cuda:
        return torch._grouped_mm(x, w_t, offs=offs)
    return torch.cat([x[a:b] @ w_t[e] for e, (a, b) in enumerate(_group_bounds(offs))], dim=0)


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] row ranges of the groups whose ends are ``offs`` (a host sync: CPU paths only)."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def stacked_main_grad(weights) -> tuple[torch.Tensor, bool] | None:
    """The ``main_grad`` buffers of E weights [out, in] as one strided view [E, out, in] into their common
    storage, and whether that view runs in reverse expert order; ``None`` unless every weight is marked
    ``k3_fuse_wgrad`` (``megatron.runtime.wrap_ddp``) and the buffers are contiguous, of one shape and dtype,
    evenly spaced in one storage and not overlapping. megatron's DDP lays the experts' gradients out that
    way (one grad buffer, parameters in reverse order: expert e-1 one (fc1 + fc2) stride after expert e)."""
    mgs = [getattr(w, "main_grad", None) if getattr(w, "k3_fuse_wgrad", False) else None for w in weights]
    if not mgs or any(m is None for m in mgs):
        return None
    m0 = mgs[0]
    if any(m.shape != m0.shape or m.dtype != m0.dtype or m.device != m0.device or not m.is_contiguous()
           or m.untyped_storage().data_ptr() != m0.untyped_storage().data_ptr() for m in mgs):
        return None
    if len(mgs) == 1:
        return m0.unsqueeze(0), False
    step = mgs[1].storage_offset() - m0.storage_offset()
    if abs(step) < m0.numel() or any(m.storage_offset() - m0.storage_offset() != e * step for e, m in enumerate(mgs)):
        return None
    base = m0 if step > 0 else mgs[-1]
    return base.as_strided((len(mgs), *m0.shape), (abs(step), *m0.stride()), base.storage_offset()), step < 0


class _GroupedLinear(torch.autograd.Function):
    """y[rows of group e] = x[rows of group e] @ W_e^T for E weights [out, in]. The weights are stacked
    inside forward and again in backward, so the stacked copy is never kept for backward (saves E x out x in
    elements per call, per micro-batch in flight). dW_e = dy_e^T x_e is one grouped GEMM over the token axis.

    Weight-gradient accumulation fusion: when the weights' ``main_grad`` buffers (megatron DDP) form one
    evenly spaced block (``stacked_main_grad``), the E gradients are added to them by one kernel and the
    weights get no ``.grad`` (instead of E gradients, E ``AccumulateGrad`` nodes and E adds by DDP's hooks,
    which only run for parameters that received a gradient; ``wrap_ddp`` marks the weights only when its
    hooks have nothing else to do, i.e. without overlapped gradient reduction). Same values either way."""

    @staticmethod
    def forward(ctx, x, offs, *weights):
        w = torch.stack([t.to(x.dtype) for t in weights])
        ctx.save_for_backward(x, offs, *weights)
        return grouped_mm(x, w.transpose(1, 2), offs)

    @staticmethod
    def backward(ctx, gy):
        x, offs, *weights = ctx.saved_tensors
        gy = gy.contiguous()
        gx = None
        if ctx.needs_input_grad[0]:
            gx = grouped_mm(gy, torch.stack([t.to(x.dtype) for t in weights]), offs)
        if x.is_cuda:
            gw = torch._grouped_mm(gy.t(), x, offs=offs)
        else:
            gw = torch.stack([gy[a:b].t() @ x[a:b] for a, b in _group_bounds(offs)])
        fused = stacked_main_grad(weights)
        if fused is not None:
            view, reverse = fused
            gw = gw.to(weights[0].dtype)
            add = compiled(add_stacked_grad) if compile_enabled(x, grad_only=False) else add_stacked_grad
            add(view, gw, reverse)
            return (gx, None, *[None] * len(weights))
        return (gx, None, *[g.to(t.dtype) for g, t in zip(gw.unbind(0), weights)])


def add_stacked_grad(main: torch.Tensor, g: torch.Tensor, reverse: bool) -> None:
    """``main[e] += g[E-1-e]`` (``reverse``) or ``main[e] += g[e]``, in ``main``'s dtype: the experts' weight
    gradients into their ``main_grad`` view (``stacked_main_grad``). Compiled on CUDA, the reversal is index
    arithmetic inside one kernel; eager ``flip`` copies ``g`` first and the add then takes aten's strided path
    (the view interleaves fc1 and fc2): 368 flips (15 ms) and 368 strided adds (26 ms) per k3-mini step of
    8 x 4 x 4096 tokens on an H100 (``benchmarks/README.md``, 2026-12-07)."""
    main.add_((g.flip(0) if reverse else g).to(main.dtype))


def grouped_linear(x: torch.Tensor, weights, offs: torch.Tensor) -> torch.Tensor:
    """``x`` [T, in] sorted by group, ``weights`` E tensors [out, in], ``offs`` int32 group ends -> [T, out]."""
    return _GroupedLinear.apply(x, offs, *weights)


def gather_sum_reference(y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[t] = y[rows[t, 0]] + y[rows[t, 1]] + ...`` for ``y`` [R, D] and ``rows`` [N, k] -> [N, D]: added
    in slot order in fp32 (in ``y``'s dtype when that is wider) and cast back once."""
    ct = acc_dtype(y)
    g = y.index_select(0, rows.reshape(-1)).view(*rows.shape, y.shape[-1])
    out = g[:, 0].to(ct)
    for j in range(1, rows.shape[1]):
        out = out + g[:, j].to(ct)
    return out.to(y.dtype)


def _gather_sum(y, rows, use_compiled: bool):
    return (compiled(gather_sum_reference) if use_compiled else gather_sum_reference)(y, rows)


class _PermuteTokens(torch.autograd.Function):
    """Token permutation for dropless top-k routing, without atomics. ``src`` [N k]: the token of each
    permuted row; ``rows`` [N, k]: the permuted rows of each token (every token has exactly k)::

        forward:  y[r] = x[src[r]]                      (gather)
        backward: dx[t] = sum_j dy[rows[t, j]]          (gather + sum, instead of an atomic index_add)
    """

    @staticmethod
    def forward(ctx, x, src, rows, use_compiled):
        ctx.save_for_backward(rows)
        ctx.use_compiled = use_compiled
        return x.index_select(0, src)

    @staticmethod
    def backward(ctx, gy):
        (rows,) = ctx.saved_tensors
        return _gather_sum(gy.contiguous(), rows, ctx.use_compiled), None, None, None


class _UnpermuteTokens(torch.autograd.Function):
    """The inverse of ``_PermuteTokens``, combining each token's k expert outputs::

        forward:  out[t] = sum_j y[rows[t, j]]          (gather + sum, instead of zeros + atomic scatter_add)
        backward: dy[r] = dout[src[r]]                  (gather)
    """

    @staticmethod
    def forward(ctx, y, src, rows, use_compiled):
        ctx.save_for_backward(src)
        return _gather_sum(y, rows, use_compiled)

    @staticmethod
    def backward(ctx, gout):
        (src,) = ctx.saved_tensors
        return gout.index_select(0, src), None, None, None


def token_permutation(src: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """``rows`` [N, k] for ``permute_tokens``/``unpermute_tokens`` from ``src`` (each permuted row's token):
    the positions of each token's k rows, in permuted order (one stable sort, no host sync)."""
    return torch.argsort(src, stable=True).view(num_tokens, top_k)


def permute_tokens(x: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[src]`` [N k, D] with the atomic-free backward of ``_PermuteTokens``."""
    return _PermuteTokens.apply(x, src, rows, compile_enabled(x))


def unpermute_tokens(y: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each token's k rows of ``y`` summed [N, D] (``_UnpermuteTokens``)."""
    return _UnpermuteTokens.apply(y, src, rows, compile_enabled(y))


class MLP(nn.Module):
    """Dense/shared FFN with HF names gate_proj, up_proj, down_proj."""

    names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg, hidden: int, width: int):
        super().__init__()
        self.cfg = cfg
        std, out_std = cfg.init_std, scaled_init_std(cfg.init_std, cfg.num_hidden_layers)
        gate, up, down = self.names
        setattr(self, gate, Linear(hidden, width, std))
        setattr(self, up, Linear(hidden, width, std))
        setattr(self, down, Linear(width, hidden, out_std))

    def forward(self, x):
        c = self.cfg
        gate, up, down = (getattr(self, n) for n in self.names)
        h = glu_activation_stream(gate(x), up(x), c.hidden_act, c.activation_situ_beta,
                                  c.activation_situ_linear_beta)
        return down(h)


class Expert(MLP):
    """Routed expert with HF names w1 (gate), w3 (up), w2 (down)."""

    names = ("w1", "w3", "w2")


class Router(nn.Module):
    """``block_sparse_moe.gate``: weight [E, D] and the buffer ``e_score_correction_bias`` [E] (fp32)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.top_k = cfg.num_experts_per_token
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(cfg.num_experts, dtype=torch.float32))

    def reset_parameters(self, gen=None):
        normal_(self.weight, self.cfg.init_std, gen)
        with torch.no_grad():
            self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor):
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k], scores [N, E] fp32)."""
        ct = acc_dtype(x)
        scores = torch.sigmoid(x.to(ct) @ self.weight.to(ct).t())
        choice = scores + self.e_score_correction_bias.detach().to(ct)
        idx = torch.topk(choice, self.top_k, dim=-1).indices
        w = scores.gather(-1, idx)
        if self.cfg.moe_renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.cfg.routed_scaling_factor, idx, scores


class LatentMoE(nn.Module):
    """``block_sparse_moe``: router, latent projections + latent RMSNorm, routed and shared experts."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        D, L = cfg.hidden_size, cfg.expert_width
        self.latent = cfg.routed_expert_hidden_size is not None
        self.gate = Router(cfg)
        if self.latent:
            out_std = scaled_init_std(cfg.init_std, cfg.num_hidden_layers)
            self.routed_expert_down_proj = Linear(D, L, cfg.init_std)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps)
            self.routed_expert_up_proj = Linear(L, D, out_std)
        self.experts = nn.ModuleList(Expert(cfg, L, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        if cfg.num_shared_experts > 0:
            self.shared_experts = MLP(cfg, D, cfg.num_shared_experts * cfg.moe_intermediate_size)
        self.last_routing = None  # (idx [N, k]) of the latest forward, for balancing and metrics
        self.grouped = None  # None: grouped GEMMs on CUDA, the loop elsewhere

    def _routed_grouped(self, z, w, idx):
        """sum_i w_i E_i(z) for all tokens with two grouped GEMMs over the expert-sorted (token, slot) pairs."""
        N, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        offs = torch.bincount(flat, minlength=len(self.experts)).cumsum(0).to(torch.int32)
        ex = self.experts
        zs = z[tok]
        c = self.cfg
        a = glu_activation_stream(grouped_linear(zs, [e.w1.weight for e in ex], offs),
                                  grouped_linear(zs, [e.w3.weight for e in ex], offs), c.hidden_act,
                                  c.activation_situ_beta, c.activation_situ_linear_beta)
        out = grouped_linear(a, [e.w2.weight for e in ex], offs)
        ct = acc_dtype(z)
        out = out.to(ct) * w.reshape(-1)[order].unsqueeze(-1).to(ct)
        return torch.zeros(z.shape, dtype=ct, device=z.device).index_add(0, tok, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx, _ = self.gate(flat)
        self.last_routing = idx.detach()
        z = self.routed_expert_down_proj(flat) if self.latent else flat
        if self.grouped if self.grouped is not None else z.is_cuda:
            u = self._routed_grouped(z, w, idx)
        else:
            u = torch.zeros(z.shape, dtype=acc_dtype(z), device=z.device)
            for e, expert in enumerate(self.experts):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)  # an idle expert still runs (on 0 rows)
                out = expert(z[tok]).to(u.dtype) * w[tok, slot].unsqueeze(-1).to(u.dtype)
                u = u.index_add(0, tok, out)
        u = u.to(x.dtype)
        if self.latent:
            if self.cfg.latent_moe_use_norm:
                u = self.routed_expert_norm(u)
            y = self.routed_expert_up_proj(u)
        else:
            y = u
        if self.cfg.num_shared_experts > 0:
            y = y + self.shared_experts(flat)
        return y.reshape(shape)
