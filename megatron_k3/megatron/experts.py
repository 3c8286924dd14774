"""Routed experts as two grouped GEMMs: megatron's ``SequentialMLP`` (same parameters, same names, same
checkpoint pieces) with a forward that does not loop over experts.

For the tokens already permuted by the dispatcher into expert order, with ``n_e`` tokens for local expert
``e`` and ``offs = cumsum(n)``::

    H   = grouped_mm(X, W1ᵀ, offs)          # [T, 2F]: row block e uses W1[e] = [w1_e; w3_e]
    A   = act(H) * p                         # SiTU-GLU (the streaming op) times the routing prob
    Y   = grouped_mm(A, W2ᵀ, offs)          # [T, L]

``torch._grouped_mm`` runs the E GEMMs as one kernel (CUTLASS on Hopper) and takes the group boundaries
from a device tensor, so neither a Python loop of 3 x E GEMMs nor ``tokens_per_expert.tolist()`` (a
host sync) is needed. The per-expert weights are stacked inside the op's forward and again in its
backward (``megatron_k3.model.moe.grouped_linear``), so no stacked copy is kept for backward; the
parameters stay one per expert, so DDP, the optimizers, the checkpoint adapter and Muon's per-matrix view
are unchanged. Under megatron's DDP (``runtime.wrap_ddp``) the E weight gradients of a projection are added
to the experts' ``main_grad`` buffers by one kernel through a strided view (``stacked_main_grad``) instead of
E gradients and E adds by DDP's hooks. Falls back to the loop when the grouped
kernel cannot be used (dtype other than fp32/bf16/fp16, or a row stride that is not a multiple of 16 bytes).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from ..model.common import fast
from ..model.moe import grouped_linear, permute_tokens, token_permutation, unpermute_tokens


def grouped_ok(x: torch.Tensor, widths) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all((w * x.element_size()) % 16 == 0 for w in widths)


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` whose forward is two grouped GEMMs (see the module docstring)."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        experts = self.local_experts
        fc1 = [e.linear_fc1.weight for e in experts]
        fc2 = [e.linear_fc2.weight for e in experts]
        # under FP8 the experts stay bf16 grouped GEMMs (megatron_k3/precision.py)
        if (self.config.moe_apply_probs_on_input or experts[0].linear_fc1.bias is not None
                or not grouped_ok(x, (fc1[0].shape[1], fc1[0].shape[0], fc2[0].shape[1], fc2[0].shape[0]))):
            return super().forward(x, tokens_per_expert, permuted_probs)
        if not torch.is_tensor(tokens_per_expert):
            tokens_per_expert = torch.tensor(tokens_per_expert)
        offs = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int64), 0).to(torch.int32)
        h = grouped_linear(x, fc1, offs)  # [T, 2F]
        h = experts[0].activation_func(h)
        h = fast(scale_rows, h)(h, permuted_probs, x.dtype)
        return grouped_linear(h, fc2, offs), None


def scale_rows(h: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``h * p`` per row (the routing probability, fp32) cast to ``dtype``; compiled on CUDA (one kernel each
    way instead of a mixed-dtype multiply into an fp32 copy and a cast)."""
    return (h * p.unsqueeze(-1)).to(dtype)


class LocalAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher without its host synchronisation when every expert is local and the
    tokens are not sequence-sharded (EP x TP = 1, dropless).

    megatron 0.19.2 copies ``tokens_per_expert`` to the host and waits for it in every MoE forward
    (``_maybe_dtoh_and_synchronize`` at "before_permutation_2"/"before_finish"), and sorts the tokens by
    local expert with a split/cat (``sort_chunks_by_idxs``) on the way in and back. With one source rank
    that sort is the identity permutation, and ``GroupedExperts`` reads the counts on the device, so both
    are skipped here: no device-to-host copy, no sync (the host keeps running ahead of the GPU), no two
    copies of the permuted tokens per layer. The permutation itself (megatron's argsort ``permute``) was
    already sync-free. The permutation of the tokens and its inverse are gathers both ways
    (``model.moe.permute_tokens``/``unpermute_tokens``), where megatron's are an ``index_select`` whose
    backward is an atomic ``index_add`` and a zero-fill plus atomic ``scatter_add``; same row order, same
    probabilities, and each token's k expert outputs are added in the same (expert) order, in fp32.
    Any other layout (EP > 1 or TP > 1: the all-to-all needs host split sizes, and the sort is real), token
    dropping or padding takes megatron's path unchanged. The sequential fallback of ``GroupedExperts`` still
    accepts the device counts (its ``.tolist()`` syncs there, as before)."""

    @classmethod
    def adopt(cls, dispatcher: MoEAlltoAllTokenDispatcher) -> MoEAlltoAllTokenDispatcher:
        """Turn the dispatcher megatron's ``MoELayer`` built into this class in place (it adds methods and
        one flag, no state), keeping its process groups and streams."""
        dispatcher.__class__ = cls
        dispatcher.k3_local = dispatcher.ep_size == 1 and dispatcher.tp_size == 1 and not dispatcher.drop_and_pad
        return dispatcher

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if self.k3_local:
            return tokens_per_expert
        return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.k3_perm = None
        c = self.config
        if (not self.k3_local or self.shared_experts is not None or c.moe_router_padding_for_quantization
                or c.moe_permute_fusion or c.moe_expert_capacity_factor is not None):
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        x = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        self.hidden_shape_before_permute = x.shape
        n, k = x.shape[0], c.moe_router_topk
        assert self.num_out_tokens == n * k, (self.num_out_tokens, n, k)  # dropless: static, host ints
        # megatron's order: experts ascending, tokens ascending within each (moe_utils.permute)
        flat = routing_map.bool().T.contiguous().reshape(-1).argsort(descending=True, stable=True)[: n * k]
        src = flat % n
        self.k3_perm = (src, token_permutation(src, n, k))
        self.reversed_local_input_permutation_mapping = src
        return permute_tokens(x, *self.k3_perm), probs.T.contiguous().reshape(-1)[flat]

    def combine_postprocess(self, hidden_states):
        if getattr(self, "k3_perm", None) is None:
            return super().combine_postprocess(hidden_states)
        out = unpermute_tokens(hidden_states, *self.k3_perm)
        self.k3_perm = None
        return out.view(self.hidden_shape)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if not self.k3_local:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if not self.k3_local:
            return super().combine_preprocess(hidden_states)
        return hidden_states
