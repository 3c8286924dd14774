"""Patch 10: megatron's all-to-all token dispatcher without its per-layer host sync when every expert is local.

Written against megatron-core 0.19.2 (``patches.TESTED``): ``MoEAlltoAllTokenDispatcher`` and its private
``_maybe_dtoh_and_synchronize``, ``dispatch_preprocess``/``dispatch_postprocess``/``combine_preprocess``/
``combine_postprocess`` and attribute names (``tokens_per_expert``, ``hidden_shape_before_permute``,
``reversed_local_input_permutation_mapping``, ``num_out_tokens``). ``parallel.layers`` turns the dispatcher
megatron's ``MoELayer`` built into this class (``adopt``: a ``__class__`` swap, no new state), so megatron's
MoE layer, its process groups and streams are unchanged. tests/helpers/dispatch_check.py pins it to megatron's
dispatcher (same outputs and gradients).
"""
from __future__ import annotations

from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from ..model.moe import permute_tokens, token_permutation, unpermute_tokens


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
