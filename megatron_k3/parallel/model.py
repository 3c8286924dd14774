"""The K3 language model as a megatron-core module: one instance per (virtual) pipeline stage.

A stage owns a contiguous range of whole Attention-Residual blocks (``ParallelLayout.validate`` refuses
anything else). Between stages the state is the partial block sum *and* the stack of completed block
snapshots; megatron's p2p carries one tensor per micro-batch, so the stage output is the concatenation
``[b_0, ..., b_{n-1}, h]`` along the hidden axis, ``[S_local, B, (n + 1) * D]`` (``variable_seq_lengths``
lets the shape grow from stage to stage). The first stage embeds (vocabulary-parallel), the last applies
the output mix, final norm, a vocabulary-parallel output layer and a chunked vocabulary-parallel
cross-entropy, plus the optional MTP heads.

Parameter names follow the release: ``embed_tokens``, ``layers.{i}`` (global layer index), ``norm``,
``output_attn_res_*``, ``lm_head``, ``mtp_heads.{k}`` (HF ``model.mtp.{k}``); MoE internals are megatron's
(``block_sparse_moe.router.weight``, ``...experts.local_experts.{j}.linear_fc1.weight``). ``adapter.py``
maps them to and from the official names for any layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.transformer.module import MegatronModule
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model.attn_res import ResProj, attn_res_mix
from ..model.common import Linear, RMSNorm, acc_dtype, compile_enabled, compiled, fast
from ..model.k3 import IGNORE_INDEX, ce_logits_grad, cross_entropy_sum, linear_cross_entropy
from ..model.mtp import MTPModule
from .precision import layer_context
from .comm import ParallelCtx, tp_enter, tp_exit
from .graphs import run_layer
from .layers import ParallelK3Layer, mark_replicated, mark_tp


class VocabParallelEmbedding(nn.Module):
    """``embed_tokens``: rows [V / TP, D] of the table; ids [B, S] -> [S_local, B, D] (reduced over TP)."""

    def __init__(self, cfg, ctx: ParallelCtx):
        super().__init__()
        self.ctx = ctx
        self.per = cfg.vocab_size // ctx.tp
        self.start = ctx.tp_rank * self.per
        self.weight = nn.Parameter(torch.empty(self.per, cfg.hidden_size))
        mark_tp(self.weight, 0)

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.per)
        e = F.embedding(local.masked_fill(outside, 0), self.weight)
        e = e.masked_fill(outside.unsqueeze(-1), 0.0)
        return tp_exit(e.transpose(0, 1).contiguous(), self.ctx)


def _ce_chunk(h, weight, target, tp: int):
    logits = F.linear(h, weight)
    if tp == 1:  # the whole vocabulary is local: the golden model's CE (compiled on CUDA: no fp32 logits copy)
        return fast(cross_entropy_sum, logits)(logits, target, IGNORE_INDEX)
    logits = logits.float().unsqueeze(1)                                   # [N, 1, V/TP]
    valid = target != IGNORE_INDEX
    loss = vocab_parallel_cross_entropy(logits, target.masked_fill(~valid, 0).unsqueeze(1)).squeeze(1)
    return (loss * valid).sum()


def _row_max(x):
    return x.to(acc_dtype(x)).amax(-1)


def _row_stats(x, m, local, inside):
    """[sum_v exp(x - m), x[target]] over this rank's columns (the target's logit only where it is local)."""
    xf = x.to(acc_dtype(x))
    tgt = xf.gather(1, local[:, None]).squeeze(1) * inside
    return torch.stack([torch.exp(xf - m[:, None]).sum(-1), tgt])


def _row_grad(x, lse, local, inside, valid):
    """d CE sum / d logits on this rank's columns (``ce_logits_grad``), in x's dtype."""
    return ce_logits_grad(x.to(acc_dtype(x)), lse, local, inside, valid).to(x.dtype)


class VocabParallelCEChunk:
    """``chunk_fn`` of ``linear_cross_entropy`` under TP: logits [n, V/TP] of the vocabulary rows
    [start, start + V/TP) -> (the full CE sum, equal on every rank, and d logits of these columns). Two
    all-reduces over the TP group per chunk: the row max, then the row sums of exp and the target logits.
    The element-wise passes are compiled on CUDA (the collectives stay outside the compiled functions)."""

    def __init__(self, group, start: int):
        self.group, self.start = group, start

    def __call__(self, logits, targets, ignore_index):
        from .collectives import ReduceOp, all_reduce

        fn = (lambda f: compiled(f)) if compile_enabled(logits, grad_only=False) else (lambda f: f)
        valid = targets != ignore_index
        local = targets - self.start
        inside = valid & (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~inside, 0)
        m = fn(_row_max)(logits)
        all_reduce(m, ReduceOp.MAX, self.group)
        st = fn(_row_stats)(logits, m, local, inside)
        all_reduce(st, group=self.group)
        lse = m + torch.log(st[0])
        loss = ((lse - st[1]) * valid).sum()
        return loss, fn(_row_grad)(logits, lse, local, inside, valid)


def vocab_parallel_chunked_ce(hidden, weight, targets, chunk_tokens: int = 4096):
    """Sum of CE over non-ignored tokens; hidden [S, B, D] (full over TP), weight [V/TP, D], targets [S, B].
    One chunk of [chunk, V/TP] logits is alive at a time. With autograd on, the golden model's
    ``linear_cross_entropy`` (gradients formed in forward, no logits recomputation; under TP with
    ``VocabParallelCEChunk``); without, each chunk through megatron's vocabulary-parallel CE under TP and the
    golden model's ``cross_entropy_sum`` at TP 1 (the same sum)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if torch.is_grad_enabled():
        chunk_fn = None if tp == 1 else VocabParallelCEChunk(ps.get_tensor_model_parallel_group(),
                                                             ps.get_tensor_model_parallel_rank() * weight.shape[0])
        return linear_cross_entropy(hidden, weight, targets, IGNORE_INDEX, chunk_tokens, chunk_fn)
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    total = h.new_zeros((), dtype=torch.float32)
    for s in range(0, t.numel(), chunk_tokens):
        args = (h[s:s + chunk_tokens], weight, t[s:s + chunk_tokens], tp)
        total = total + (checkpoint(_ce_chunk, *args, use_reentrant=False) if torch.is_grad_enabled()
                         else _ce_chunk(*args))
    return total


class K3MegatronModel(MegatronModule):
    def __init__(self, cfg, tconfig, ctx: ParallelCtx, layer_start: int, layer_end: int, pre_process: bool,
                 post_process: bool, vp_stage: int | None = None, recompute: str = "none"):
        super().__init__(config=tconfig)
        self.recompute = recompute
        self.cfg, self.ctx = cfg, ctx
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = False
        if vp_stage is not None:
            self.vp_stage = vp_stage
        self.layer_start, self.layer_end = layer_start, layer_end
        self.attn_res = cfg.attn_res_block_size is not None
        D = cfg.hidden_size
        if pre_process:
            self.embed_tokens = VocabParallelEmbedding(cfg, ctx)
        self.layers = nn.ModuleDict({str(i): ParallelK3Layer(cfg, ctx, tconfig, i, recompute=recompute)
                                     for i in range(layer_start, layer_end)})
        if post_process:
            self.norm = RMSNorm(D, cfg.rms_norm_eps)
            mark_replicated(self.norm, ctx)
            if self.attn_res:
                self.output_attn_res_norm = RMSNorm(D, cfg.rms_norm_eps)
                self.output_attn_res_proj = ResProj(D)
                mark_replicated(self.output_attn_res_norm, ctx)
                mark_replicated(self.output_attn_res_proj, ctx)
            self.lm_head = Linear(D, cfg.vocab_size // ctx.tp, cfg.init_std)
            mark_tp(self.lm_head.weight, 0)
            if cfg.num_nextn_predict_layers > 0:
                moe = cfg.num_experts > 0
                self.mtp_heads = nn.ModuleList(
                    MTPModule(cfg, lambda: ParallelK3Layer(cfg, ctx, tconfig, cfg.num_hidden_layers, kind="mla",
                                                           moe=moe, attn_res=False, recompute=recompute))
                    for _ in range(cfg.num_nextn_predict_layers))
                for m in self.mtp_heads:
                    for sub in (m.enorm, m.hnorm, m.eh_proj, m.norm):
                        mark_replicated(sub, ctx)
        self.input_tensor = None

    # ------------------------------------------------------------------------------------------------
    def num_blocks_before(self, layer: int) -> int:
        """Completed AttnRes blocks when ``layer`` starts (snapshots taken at layers 0, bs, 2bs, ... < layer)."""
        bs = self.cfg.attn_res_block_size
        return 0 if bs is None else -(-layer // bs)

    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def _run_layer(self, layer, h, blocks):
        """One decoder layer inside its FP8 autocast when FP8 is on (re-entered when recomputed); through its
        CUDA graphs when they were captured and this call can replay them (``graphs.run_layer``)."""
        with layer_context(self.config, layer.layer_idx):
            return run_layer(layer, h, blocks)

    def forward(self, input_ids=None, labels=None, mtp_input_ids=None, mtp_labels=None, ce_chunk_tokens=4096):
        """First stage: ``input_ids`` [B, S_cp]. Last stage: ``labels`` [B, S_cp] (IGNORE_INDEX = skip) gives
        ``(loss_sum, {"lm": sum, "mtp": [sums]})`` with sums over tokens (the schedule divides by the global
        token count); without labels, logits [B, S_cp, V] gathered over TP. Other stages return the packed
        state for the next stage."""
        D = self.cfg.hidden_size
        if self.pre_process:
            h = self.embed_tokens(input_ids)
            blocks = [] if self.attn_res else None
        else:
            x = self.input_tensor
            nb = self.num_blocks_before(self.layer_start)
            parts = list(x.split(D, dim=-1))
            assert len(parts) == nb + 1, f"received {len(parts)} hidden slices, expected {nb + 1}"
            h, blocks = parts[-1], (parts[:-1] if self.attn_res else None)
        for layer in self.layers.values():
            if self.recompute == "full" and torch.is_grad_enabled():
                h, blocks = checkpoint(self._run_layer, layer, h, blocks, use_reentrant=False)
            else:
                h, blocks = self._run_layer(layer, h, blocks)
        if not self.post_process:
            return torch.cat(list(blocks) + [h], dim=-1) if self.attn_res else h
        if self.attn_res:
            h = attn_res_mix(h, blocks, self.output_attn_res_proj.weight.reshape(-1), self.output_attn_res_norm.weight,
                             self.output_attn_res_norm.eps)
        if labels is None:
            logits = F.linear(tp_enter(self.norm(h), self.ctx), self.lm_head.weight)
            if self.ctx.tp > 1:
                logits = mappings.gather_from_tensor_model_parallel_region(logits, self.ctx.tp_group)
            return logits.transpose(0, 1)
        lm = vocab_parallel_chunked_ce(tp_enter(self.norm(h), self.ctx), self.lm_head.weight, labels.transpose(0, 1),
                                       ce_chunk_tokens)
        mtp_sums = []
        h_prev = h
        for k, mtp in enumerate(getattr(self, "mtp_heads", [])):
            h_prev = mtp(h_prev, self.embed_tokens(mtp_input_ids[k]))
            mtp_sums.append(vocab_parallel_chunked_ce(tp_enter(mtp.norm(h_prev), self.ctx), self.lm_head.weight,
                                                      mtp_labels[k].transpose(0, 1), ce_chunk_tokens))
        return lm, mtp_sums
