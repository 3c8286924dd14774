"""Patch 8: megatron's per-step walks over every module to find the MoE routers, done once per model chunk.

Written against megatron-core 0.19.2 (``patches.TESTED``: ``reset_model_temporary_tensors`` and
``_update_router_expert_bias`` in ``distributed/finalize_model_grads.py``). Applied by ``compat.setup_device()``.

8. megatron's gradient finalisation walks every module of the model twice per step to find the MoE routers
   (``_update_router_expert_bias`` and ``reset_model_temporary_tensors`` in
   ``distributed/finalize_model_grads.py``, three ``hasattr`` per module): 4,396 modules for k3-mini (one per
   expert projection). With ``runtime.moe_routers`` finding its routers once too, the finalisation of a k3-mini
   step went from 85.5 to 6.9 ms of host time on the 2-core development VM (``benchmarks/bench_host.py``).
   The same two functions now receive, for each model chunk, a stand-in whose ``modules()`` lists only that
   chunk's modules carrying the attributes those functions look for (``expert_bias``,
   ``reset_global_aux_loss_tracker``, ``qb_beta_accum``), found once per chunk. megatron's own function bodies
   run unchanged on them (every condition they test is re-evaluated each step); the module tree of a built
   model does not change. tests/parallel/test_patches.py checks the expert-bias update and the reset against the
   unpatched functions.
"""
from __future__ import annotations

import functools

ROUTER_ATTRS = ("expert_bias", "reset_global_aux_loss_tracker", "qb_beta_accum")  # what item 8's functions test


class _RouterModules:
    """What megatron's finalisation walks see of one model chunk (item 8): its router-state modules."""

    def __init__(self, mods):
        self.mods = mods

    def modules(self):
        return iter(self.mods)


def use_cached_router_walks() -> None:
    """Apply item 8 (idempotent)."""
    import importlib
    import weakref

    from megatron.core.utils import get_attr_wrapped_model

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    if getattr(fmg, "k3_cached_router_walks", False):
        return
    reset, update = fmg.reset_model_temporary_tensors, fmg._update_router_expert_bias
    found = weakref.WeakKeyDictionary()  # model chunk -> _RouterModules

    def routers_only(model):
        out = []
        for chunk in model:
            if chunk not in found:
                found[chunk] = _RouterModules([m for m in get_attr_wrapped_model(chunk, "modules")()
                                               if any(hasattr(m, a) for a in ROUTER_ATTRS)])
            out.append(found[chunk])
        return out

    @functools.wraps(reset)
    def reset_model_temporary_tensors(config, model):
        return reset(config, routers_only(model))

    @functools.wraps(update)
    def _update_router_expert_bias(model, config, tp_dp_cp_group=None):
        return update(routers_only(model), config, tp_dp_cp_group=tp_dp_cp_group)

    fmg.reset_model_temporary_tensors = reset_model_temporary_tensors
    fmg._update_router_expert_bias = _update_router_expert_bias
    fmg.k3_cached_router_walks = True
    fmg.k3_unpatched = {"reset_model_temporary_tensors": reset, "_update_router_expert_bias": update}  # tests
