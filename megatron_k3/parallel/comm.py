"""Tensor- and context-parallel communication for the K3 token mixers (explicit, differentiable).

Layout inside the megatron model is sequence-first, ``[S_local, B, ...]``. A token mixer (KDA, MLA, dense
FFN, shared experts) works on whole heads/columns of its tensor-parallel shard:

    tp_enter(x):  no SP: identity forward, all-reduce backward (megatron's copy_to_tensor_model_parallel_region)
                  SP:    all-gather the sequence forward, reduce-scatter backward
    ... local matmuls on this rank's heads / columns (no communication) ...
    tp_exit(y):   no SP: all-reduce forward (partial sums of the row-parallel output projection)
                  SP:    reduce-scatter to the sequence shard

Context parallelism is head-wise all-to-all (Ulysses style): the sequence is split contiguously over the CP
ranks; before the mixing step each rank trades its sequence chunk of all (TP-local) heads for the full
sequence of ``heads / CP`` heads, and trades back afterwards. It is exact for both KDA (the recurrence
sees the whole sequence of a head, no state passing needed) and MLA (causal softmax over the whole
sequence), with no load imbalance, at the price of TP x CP dividing the head counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import mappings

from .collectives import all_to_all_single


@dataclass
class ParallelCtx:
    tp: int
    tp_rank: int
    cp: int
    cp_rank: int
    sp: bool
    tp_group: object = None
    cp_group: object = None

    @classmethod
    def from_parallel_state(cls, sequence_parallel: bool) -> "ParallelCtx":
        return cls(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                   sp=sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1,
                   tp_group=ps.get_tensor_model_parallel_group(), cp_group=ps.get_context_parallel_group())

    @classmethod
    def single(cls) -> "ParallelCtx":
        return cls(tp=1, tp_rank=0, cp=1, cp_rank=0, sp=False)


def tp_enter(x: torch.Tensor, ctx: ParallelCtx) -> torch.Tensor:
    if ctx.tp == 1:
        return x
    if ctx.sp:
        return mappings.gather_from_sequence_parallel_region(x, True, ctx.tp_group)
    return mappings.copy_to_tensor_model_parallel_region(x, ctx.tp_group)


def tp_exit(y: torch.Tensor, ctx: ParallelCtx) -> torch.Tensor:
    if ctx.tp == 1:
        return y
    if ctx.sp:
        return mappings.reduce_scatter_to_sequence_parallel_region(y, ctx.tp_group)
    return mappings.reduce_from_tensor_model_parallel_region(y, ctx.tp_group)


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all over dim 0 (equal chunks): out[r] = chunk this rank receives from rank r."""
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    all_to_all_single(out, x, group=group)
    return out


class _SeqToHeads(torch.autograd.Function):
    """[s, B, H, *] (sequence chunk, all heads) -> [cp * s, B, H / cp, *] (full sequence, a head group)."""

    @staticmethod
    def forward(ctx, x, cp, group):
        ctx.cp, ctx.group = cp, group
        return _seq_to_heads(x, cp, group)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g, ctx.cp, ctx.group), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, group):
        ctx.cp, ctx.group = cp, group
        return _heads_to_seq(x, cp, group)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g, ctx.cp, ctx.group), None, None


def _seq_to_heads(x, cp, group):
    s, B, H = x.shape[:3]
    rest = x.shape[3:]
    h = H // cp
    send = x.reshape(s, B, cp, h, *rest).movedim(2, 0)          # [cp(dest head group), s, B, h, *]
    recv = _a2a(send, group)                                     # [cp(source seq chunk), s, B, h, *]
    return recv.reshape(cp * s, B, h, *rest)


def _heads_to_seq(x, cp, group):
    S, B, h = x.shape[:3]
    rest = x.shape[3:]
    s = S // cp
    send = x.reshape(cp, s, B, h, *rest)                         # [cp(dest seq chunk), s, B, h, *]
    recv = _a2a(send, group)                                     # [cp(source head group), s, B, h, *]
    return recv.movedim(0, 2).reshape(s, B, cp * h, *rest)


def cp_seq_to_heads(x: torch.Tensor, ctx: ParallelCtx) -> torch.Tensor:
    return x if ctx.cp == 1 else _SeqToHeads.apply(x, ctx.cp, ctx.cp_group)


def cp_heads_to_seq(x: torch.Tensor, ctx: ParallelCtx) -> torch.Tensor:
    return x if ctx.cp == 1 else _HeadsToSeq.apply(x, ctx.cp, ctx.cp_group)


def cp_head_slice(num_local_heads: int, ctx: ParallelCtx) -> slice:
    """The heads (of this TP rank's) whose full sequence this CP rank mixes."""
    h = num_local_heads // ctx.cp
    return slice(ctx.cp_rank * h, (ctx.cp_rank + 1) * h)
