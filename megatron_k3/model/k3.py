r"""The golden model: a plain-PyTorch Kimi K3 with the official HF parameter names.

Structure (names as in the release, minus the ``language_model.`` prefix the HF adapter adds)::

    model.embed_tokens                           [V, D]
    model.layers.{i}.input_layernorm / post_attention_layernorm
    model.layers.{i}.self_attention_res_norm / self_attention_res_proj / mlp_res_norm / mlp_res_proj  (AttnRes)
    model.layers.{i}.self_attn.*                 KDA (kda.py) or gated NoPE MLA (mla.py)
    model.layers.0.mlp.{gate,up,down}_proj       dense layer(s) (first_k_dense_replace)
    model.layers.{i}.block_sparse_moe.*          Stable LatentMoE (moe.py)
    model.norm, model.output_attn_res_norm, model.output_attn_res_proj
    model.mtp.{k}.*                              optional MTP (mtp.py)
    lm_head                                      [V, D]

The layer/residual math is in attn_res.py; a layer passes ``(h, blocks)``: the partial block sum and the
completed block snapshots. Without AttnRes (Kimi Linear) the residual stream is the usual pre-norm one.

Loss: token-mean cross-entropy over positions whose label is not ``ignore_index``, computed by a chunked
cross-entropy that never holds more than one chunk of [chunk, V] logits (each chunk recomputed in
backward), plus ``mtp_loss_weight`` times the mean of the MTP depths' losses. ``linear_cross_entropy`` is the
same sum with its gradients formed in the forward pass (no recomputation; the megatron model's fast path).

No megatron imports here: this is the reference everything else is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..perf import current as current_kernels
from .attn_res import ResProj, attn_res_mix, attn_res_mix_through
from .common import Linear, RMSNorm, acc_dtype, compile_enabled, compiled, fast, normal_
from .kda import KimiDeltaAttention
from .mla import GatedMLA
from .moe import MLP, LatentMoE
from .mtp import MTPModule, shift_left

IGNORE_INDEX = -100


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, std: float):
        super().__init__()
        self.init_std = std
        self.weight = nn.Parameter(torch.empty(num, dim))

    def reset_parameters(self, gen=None):
        normal_(self.weight, self.init_std, gen)

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class K3DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str | None = None, moe: bool | None = None,
                 attn_res: bool | None = None):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        D = cfg.hidden_size
        self.kind = kind or ("kda" if cfg.is_kda_layer(layer_idx) else "mla")
        self.is_moe = cfg.is_moe_layer(layer_idx) if moe is None else moe
        self.attn_res = (cfg.attn_res_block_size is not None) if attn_res is None else attn_res
        self.snapshot = self.attn_res and layer_idx % cfg.attn_res_block_size == 0
        self.input_layernorm = self.make_input_layernorm(cfg)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        if self.attn_res:
            self.self_attention_res_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.self_attention_res_proj = ResProj(D)
            self.mlp_res_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.mlp_res_proj = ResProj(D)
        self.self_attn = self.make_attention(cfg, layer_idx)
        if self.is_moe:
            self.block_sparse_moe = self.make_moe(cfg)
        else:
            self.mlp = self.make_mlp(cfg)

    # Factories: the parallel (megatron) layer overrides these and keeps everything else.
    def make_input_layernorm(self, cfg):
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_attention(self, cfg, layer_idx):
        return KimiDeltaAttention(cfg, layer_idx) if self.kind == "kda" else GatedMLA(cfg, layer_idx)

    def make_moe(self, cfg):
        return LatentMoE(cfg)

    def make_mlp(self, cfg):
        return MLP(cfg, cfg.hidden_size, cfg.intermediate_size)

    def ffn(self, x):
        return self.block_sparse_moe(x) if self.is_moe else self.mlp(x)

    def token_mixer(self, x):
        """``self_attn(input_layernorm(x))``: the parallel layer overrides it (its input norm writes the
        mixer's batch-first layout)."""
        return self.self_attn(self.input_layernorm(x))

    def mix(self, which: str, prefix, blocks, blocks_through: bool = False):
        """(mixed, prefix', blocks'): ``attn_res_mix_through`` (prefix' and blocks' carry the same values; use
        them after the mix so that their gradients are added inside the mixer's backward on CUDA)."""
        norm, proj = getattr(self, f"{which}_res_norm"), getattr(self, f"{which}_res_proj")
        return attn_res_mix_through(prefix, blocks, proj.weight.reshape(-1), norm.weight, norm.eps, blocks_through)

    def forward(self, h: torch.Tensor, blocks: list | None):
        """(h, blocks) -> (h, blocks). ``blocks`` is None without AttnRes; a new list is returned otherwise.
        Inside the layer the mixers hand their candidates on (``mix``): the residual adds and the second mixer
        read the handed-on tensors, the same values; the returned ``blocks`` are the tensors that came in (and
        ``h`` at a block's first layer), as the layer's graph needs (``parallel/graphs.py``)."""
        if not self.attn_res:
            h = h + self.token_mixer(h)
            return h + self.ffn(self.post_attention_layernorm(h)), blocks
        prefix, inner = h, blocks
        if blocks:
            x, prefix, inner = self.mix("self_attention", prefix, blocks, blocks_through=True)
        else:
            x = prefix
        if self.snapshot:
            blocks, inner = list(blocks) + [h], list(inner) + [prefix]
            prefix = None
        a = self.token_mixer(x)
        prefix = a if prefix is None else prefix + a
        mixed, prefix, _ = self.mix("mlp", prefix, inner)
        m = self.ffn(self.post_attention_layernorm(mixed))
        return prefix + m, blocks


class K3Model(nn.Module):
    def __init__(self, cfg, only_layers=None):
        """``only_layers``: build just these decoder layers (the others are empty placeholders, keeping the
        names): the meta-device skeleton of ``init.GoldenSkeleton``; not a model that can run."""
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.embed_tokens = Embedding(cfg.vocab_size, D, cfg.init_std)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i) if only_layers is None or i in only_layers else nn.Module()
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.output_attn_res_proj = ResProj(D)
        if cfg.num_nextn_predict_layers > 0:
            mtp_moe = cfg.num_experts > 0
            self.mtp = nn.ModuleList(
                MTPModule(cfg, lambda: K3DecoderLayer(cfg, cfg.num_hidden_layers, kind="mla", moe=mtp_moe,
                                                      attn_res=False))
                for _ in range(cfg.num_nextn_predict_layers))

    def trunk(self, input_ids: torch.Tensor, checkpoint_layers: bool = False) -> torch.Tensor:
        """input_ids [B, T] -> final representation [B, T, D] (after the output mix, before ``norm``)."""
        h = self.embed_tokens(input_ids)
        blocks = [] if self.cfg.attn_res_block_size is not None else None
        for layer in self.layers:
            if checkpoint_layers and torch.is_grad_enabled():
                h, blocks = checkpoint(layer, h, blocks, use_reentrant=False)
            else:
                h, blocks = layer(h, blocks)
        if blocks is not None:
            h = attn_res_mix(h, blocks, self.output_attn_res_proj.weight.reshape(-1),
                             self.output_attn_res_norm.weight, self.output_attn_res_norm.eps)
        return h


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of CE over the non-ignored targets, the log-softmax in fp32 (fp64 for fp64 logits). On CUDA
    compiled (``fast``): the cast is fused into the row reductions and the backward writes the 16-bit logits'
    gradient directly, so no fp32 [N, V] copy of the logits (or of their gradient) is written."""
    return F.cross_entropy(logits.to(acc_dtype(logits)), targets, ignore_index=ignore_index, reduction="sum")


def _ce_chunk(h, weight, targets, ignore_index):
    logits = F.linear(h, weight)
    return fast(cross_entropy_sum, logits)(logits, targets, ignore_index)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          ignore_index: int = IGNORE_INDEX, chunk_tokens: int = 4096):
    """Sum of CE over non-ignored tokens and their count; only one [chunk, V] logits block is alive at a time
    (each chunk is recomputed in backward)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    for s in range(0, t.numel(), chunk_tokens):
        hc, tc = h[s:s + chunk_tokens], t[s:s + chunk_tokens]
        if torch.is_grad_enabled() and (hc.requires_grad or weight.requires_grad):
            total = total + checkpoint(_ce_chunk, hc, weight, tc, ignore_index, use_reentrant=False)
        else:
            total = total + _ce_chunk(hc, weight, tc, ignore_index)
    return total, (t != ignore_index).sum()


def ce_logits_grad(xf: torch.Tensor, lse: torch.Tensor, t: torch.Tensor, has_target: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
    """d CE sum / d logits for logits ``xf`` [n, V] (fp32/fp64) with row log-sum-exp ``lse`` [n]:
    softmax - onehot(t), the onehot only where ``has_target`` (under TP: the target is in this rank's columns),
    zero on rows that are not ``valid`` (ignored targets)."""
    onehot = (torch.arange(xf.shape[-1], device=xf.device)[None, :] == t[:, None]) & has_target[:, None]
    return (torch.exp(xf - lse[:, None]) - onehot.to(xf.dtype)) * valid[:, None].to(xf.dtype)


def ce_sum_and_grad(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """``cross_entropy_sum`` and its gradient in one pass: (loss sum, d sum / d logits = (softmax - onehot) on
    the non-ignored rows, in the logits' dtype). Math in fp32 (fp64 for fp64 logits)."""
    x = logits.to(acc_dtype(logits))
    valid = targets != ignore_index
    t = targets.masked_fill(~valid, 0)
    lse = torch.logsumexp(x, dim=-1)
    loss = ((lse - x.gather(1, t[:, None]).squeeze(1)) * valid).sum()
    return loss, ce_logits_grad(x, lse, t, valid, valid).to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of CE of ``hidden @ weight.T`` with the gradients computed in the forward pass, chunk by chunk:
    each [chunk, V] logits block is formed once (not again in backward, as ``chunked_cross_entropy`` does),
    its gradient goes straight into d hidden (one GEMM) and d weight (accumulated by ``addmm_`` in the weight's
    dtype, as autograd accumulates the chunks of ``chunked_cross_entropy``). Backward only scales the two
    stored gradients by the incoming scalar. ``chunk_fn(logits, targets, ignore_index) -> (loss sum, d logits)``
    is ``ce_sum_and_grad``, or a vocabulary-parallel form whose ``weight`` is this rank's rows (then d hidden
    is this rank's partial sum, which the caller's TP region reduces in backward)."""

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, chunk_tokens, chunk_fn):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = h.new_zeros((), dtype=acc_dtype(h))
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros_like(weight) if need_w else None
        for s in range(0, targets.numel(), chunk_tokens):
            hc = h[s:s + chunk_tokens]
            loss, g = chunk_fn(F.linear(hc, weight), targets[s:s + chunk_tokens], ignore_index)
            total += loss
            if need_h:
                torch.mm(g, weight, out=gh[s:s + chunk_tokens])
            if need_w:
                gw.addmm_(g.t(), hc)
            del g
        ctx.save_for_backward(gh, gw)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw = ctx.saved_tensors
        return (None if gh is None else gh * grad_out.to(gh.dtype),
                None if gw is None else gw * grad_out.to(gw.dtype), None, None, None, None)


def ce_chunk_impl(hidden: torch.Tensor) -> str:
    """Which form of ``ce_sum_and_grad`` ``linear_cross_entropy`` runs its chunks through: ``triton``
    (``ce_triton.py``: each logits row read twice instead of three times) for CUDA tensors, the default since
    measured (``benchmarks/README.md``); ``perf.cross_entropy = compiled`` opts out; else the function itself,
    torch.compile'd on CUDA (``compiled``) or eager (``reference``)."""
    if hidden.is_cuda and current_kernels().cross_entropy == "triton":
        from .ce_triton import DTYPES

        if hidden.dtype in DTYPES:  # the logits have the hidden states' dtype
            return "triton"
    return "compiled" if compile_enabled(hidden, grad_only=False) else "reference"


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, chunk_tokens: int = 4096, chunk_fn=None):
    """``chunked_cross_entropy``'s loss sum (hidden [..., D], weight [V, D], targets [...]) computed the fast
    way when gradients are needed (``_LinearCrossEntropy``: no logits recomputation; holds d hidden and
    d weight from forward to backward). Without autograd it is ``chunked_cross_entropy``. ``chunk_fn``: see
    ``_LinearCrossEntropy`` (default ``ce_sum_and_grad`` in the form ``ce_chunk_impl`` picks)."""
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return chunked_cross_entropy(hidden, weight, targets, ignore_index, chunk_tokens)[0]
    if chunk_fn is None:
        impl = ce_chunk_impl(hidden)
        if impl == "triton":
            from .ce_triton import ce_sum_and_grad_triton as chunk_fn
        else:
            chunk_fn = compiled(ce_sum_and_grad) if impl == "compiled" else ce_sum_and_grad
    h = hidden.reshape(-1, hidden.shape[-1])
    return _LinearCrossEntropy.apply(h, weight, targets.reshape(-1), ignore_index, chunk_tokens, chunk_fn)


class K3ForCausalLM(nn.Module):
    """The golden K3 language model. ``init=True`` initialises every parameter from ``seed`` (``init.py``).
    ``only_layers``: see ``K3Model`` (meta skeletons only)."""

    def __init__(self, cfg, init: bool = True, seed: int = 0, only_layers=None):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.model = K3Model(cfg, only_layers)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, cfg.init_std)
        self.checkpoint_layers = False
        if init and not self.lm_head.weight.is_meta:
            self.init_weights(seed)

    # ------------------------------------------------------------------------------------------------
    def init_weights(self, seed: int = 0):
        """Initialise every parameter and buffer explicitly: each module from its own generator, seeded by
        ``seed`` and the module's name (``init.py``), so any rank can reproduce one tensor alone."""
        from .init import init_module_

        for name, m in self.named_modules():
            if hasattr(m, "reset_parameters"):
                init_module_(m, name, seed)
        return self

    def fp32_parameter_names(self) -> list[str]:
        """Parameters kept in fp32 whatever the compute dtype (KDA A_log/dt_bias/conv/o_norm)."""
        out = []
        for mname, m in self.named_modules():
            for p in getattr(m, "fp32_params", ()):
                out.append(f"{mname}.{p}")
        return out

    def to_compute_dtype(self, dtype: torch.dtype):
        """Cast to ``dtype`` except the fp32 parameters and buffers (router bias)."""
        keep = set(self.fp32_parameter_names())
        for name, p in self.named_parameters():
            if name not in keep:
                p.data = p.data.to(dtype)
        return self

    # ------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, mtp_loss_weight: float = 0.1,
                ce_chunk_tokens: int = 4096):
        """Without labels: logits [B, T, V]. With labels (already shifted: labels[t] is the target of
        position t, ``-100`` = ignore): a dict with ``loss``, ``lm_loss``, ``mtp_losses``."""
        h = self.model.trunk(input_ids, checkpoint_layers=self.checkpoint_layers)
        if labels is None:
            return self.lm_head(self.model.norm(h))
        s, n = chunked_cross_entropy(self.model.norm(h), self.lm_head.weight, labels, chunk_tokens=ce_chunk_tokens)
        lm_loss = s / n.clamp(min=1)
        mtp_losses = []
        h_prev = h
        for k, mtp in enumerate(getattr(self.model, "mtp", []), start=1):
            emb_next = self.model.embed_tokens(shift_left(input_ids, k, 0))
            h_prev = mtp(h_prev, emb_next)
            tgt = shift_left(labels, k, IGNORE_INDEX)
            s_k, _ = chunked_cross_entropy(mtp.norm(h_prev), self.lm_head.weight, tgt,
                                             chunk_tokens=ce_chunk_tokens)
            mtp_losses.append(s_k / n.clamp(min=1))  # per main-loss token (megatron's per-token convention)
        loss = lm_loss
        if mtp_losses:
            loss = loss + mtp_loss_weight * torch.stack(mtp_losses).mean()
        return {"loss": loss, "lm_loss": lm_loss, "mtp_losses": mtp_losses}


def hf_shapes(cfg) -> dict:
    """{official HF name (without ``language_model.``): shape} in ``state_dict`` order, from a meta-device build."""
    with torch.device("meta"):
        return {k: v.shape for k, v in K3ForCausalLM(cfg, init=False).state_dict().items()}
