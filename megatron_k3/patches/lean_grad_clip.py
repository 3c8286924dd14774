"""Patch 9: the gradient norm and clip of megatron's optimizer step without a host sync or per-step filters.

Written against megatron-core 0.19.2 (``patches.TESTED``: ``MegatronOptimizer.get_grads_for_grad_norm``,
``clip_grads.to_local_if_dtensor``/``get_data_parallel_group_if_dtensor``/``multi_tensor_scale_tensor_impl``,
the private ``optimizer._get_param_grad_norm_group``/``_is_separate_grad_norm_group``). Applied by
``compat.setup_device()``.

9. megatron's optimizer step filters the gradients for the norm anew every step (five predicates per
   parameter, each asking ``parallel_state`` for ranks), wraps each gradient in ``to_local_if_dtensor``
   (a ``torch.no_grad()`` context per tensor, twice per step) and, without Transformer Engine, reads the norm
   back to the host (``total_norm.item()``) before it can clip: the host stops until the device has finished
   the backward pass, then does the per-parameter work with the device idle (14-21 ms per k3-mini step on the
   H200, ``breakdown.idle_gaps`` in benchmarks/README.md). Now: the selection of parameters whose gradients
   enter the norm is made once per optimizer with megatron's own predicates (they are static for a built
   model; rebuilt if the optimizer's parameter list changes) and only ``p.grad`` is read per step; the DTensor
   helpers return plain tensors at once; and, where Transformer Engine does not provide it, megatron's
   ``multi_tensor_scale_tensor_impl`` is ``foreach_scale``, so megatron takes its own device-tensor path
   (the one it runs with Transformer Engine): the norm stays a one-element device tensor and the clip
   coefficient ``min(1, clip / (norm + 1e-6))`` multiplies the gradients on the device. The returned grad norm
   is then a tensor (callers take ``float()`` when they log it). The coefficient rounds in fp32 instead of
   fp64. tests/parallel/test_patches.py checks the selection, the absence of host reads in the step, bit-identity with
   megatron's tensor path and one step against its float path. ``perf.lean_grad_clip = False`` (``--no-lean-grad-clip``)
   turns item 9 off (A/B).
"""
from __future__ import annotations

import torch

from ..perf import current as current_kernels
from .foreach_kernels import foreach_scale

# 9. the gradient norm and clip of megatron's optimizer step without a host sync and without per-step filters
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def counts_in_grad_norm(p, tp_group=None, expert_tp_group=None) -> bool:
    """megatron's ``_filter_grads_for_norm`` predicates on a parameter itself (not shared, not a tensor- or
    generalized-tensor-parallel duplicate), all static for a built model; item 9's cached selection and the
    host-streamed optimizer's norm lists (``offload.py``) use this one test."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    return (param_is_not_shared(p) and tensor_parallel.param_is_not_gtp_duplicate(p)
            and tensor_parallel.param_is_not_tensor_parallel_duplicate(p, tp_group=tp_group,
                                                                       expert_tp_group=expert_tp_group))


def _static_norm_params(opt, params, grad_norm_group):
    """The parameters whose gradients megatron's ``get_grads_for_grad_norm`` keeps: in the norm group and
    ``counts_in_grad_norm`` with the optimizer's groups."""
    from megatron.core.optimizer import optimizer as mopt

    def in_group(p):
        g = mopt._get_param_grad_norm_group(p)
        return g == grad_norm_group if grad_norm_group is not None else not mopt._is_separate_grad_norm_group(g)

    tp, etp = getattr(opt, "tp_group", None), getattr(opt, "expert_tp_group", None)
    return [p for p in params if in_group(p) and counts_in_grad_norm(p, tp, etp)]


def use_lean_grad_clipping() -> None:
    """Apply item 9 (idempotent; ``perf.lean_grad_clip = False`` leaves megatron's functions as they are)."""
    import operator

    from megatron.core.optimizer import clip_grads, optimizer as mopt

    if getattr(clip_grads, "k3_lean_clipping", False) or not current_kernels().lean_grad_clip:
        return
    unpatched = {"multi_tensor_scale_tensor_impl": clip_grads.multi_tensor_scale_tensor_impl,
                 "to_local_if_dtensor": clip_grads.to_local_if_dtensor,
                 "get_data_parallel_group_if_dtensor": clip_grads.get_data_parallel_group_if_dtensor,
                 "get_grads_for_grad_norm": mopt.MegatronOptimizer.get_grads_for_grad_norm}
    if clip_grads.multi_tensor_scale_tensor_impl is None:  # Transformer Engine's kernel is used when present
        clip_grads.multi_tensor_scale_tensor_impl = foreach_scale
    to_local, dp_group = unpatched["to_local_if_dtensor"], unpatched["get_data_parallel_group_if_dtensor"]

    def to_local_if_dtensor(t):
        return t if type(t) in _PLAIN_TENSORS else to_local(t)

    def get_data_parallel_group_if_dtensor(t, data_parallel_group=None):
        return None if type(t) in _PLAIN_TENSORS else dp_group(t, data_parallel_group)

    clip_grads.to_local_if_dtensor = to_local_if_dtensor
    clip_grads.get_data_parallel_group_if_dtensor = get_data_parallel_group_if_dtensor
    orig_get = unpatched["get_grads_for_grad_norm"]

    def get_grads_for_grad_norm(self, grad_norm_group=None):
        params = self.get_parameters()
        if self.config.use_precision_aware_optimizer or (params and getattr(params[0], "__fsdp_param__", False)):
            return orig_get(self, grad_norm_group)  # decoupled or DTensor gradients: megatron's own walk
        cache = self.__dict__.setdefault("_k3_norm_params", {})
        hit = cache.get(grad_norm_group)
        if hit is None or len(hit[0]) != len(params) or not all(map(operator.is_, hit[0], params)):
            hit = cache[grad_norm_group] = (params, _static_norm_params(self, params, grad_norm_group))
        return [g for g in (p.grad for p in hit[1]) if g is not None]

    mopt.MegatronOptimizer.get_grads_for_grad_norm = get_grads_for_grad_norm
    clip_grads.k3_lean_clipping = True
    clip_grads.k3_unpatched = unpatched  # tests compare against these
