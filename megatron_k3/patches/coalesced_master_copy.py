"""Patch 11: one copy kernel for megatron's fp32 master -> bf16 model parameter copy after each step.

Written against megatron-core 0.19.2 (``patches.TESTED``): ``Float16OptimizerWithFloat16Params``, its
``float16_groups``/``fp32_from_float16_groups`` and the private ``_copy_main_params_to_model_params`` /
``_copy_model_params_to_main_params``, which are replaced per optimizer instance (not on the class). Applied
by ``parallel.runtime.build_optimizer`` (``coalesce=True``). tests/parallel/test_patches.py (coalesce_check) pins it to
megatron's own copy: same weights after steps, bit for bit.
"""
from __future__ import annotations

import functools

import torch


def coalesce_float16_params(optimizer, align: int = 64) -> int:
    """Move the bf16/fp16 model parameters and their fp32 main copies of every megatron
    ``Float16OptimizerWithFloat16Params`` inside ``optimizer`` into two flat buffers laid out alike (each
    tensor at a multiple of ``align`` elements), so that the copy main -> model after each step (and model ->
    main on load) is one kernel instead of one per tensor. Measured: k3-mini has 2,454 such tensors, and
    without apex/TE megatron's copy is torch's ``_foreach_copy_``, which across dtypes falls back to one copy
    per tensor (2,454 launches of ~3.4 us on the H200, ``benchmarks/README.md``). Values, parameter objects,
    attributes and the optimizer's bookkeeping are unchanged (``.data`` is re-pointed, as megatron's DDP does
    with its parameter buffer under the distributed optimizer). Skips optimizers whose tensors do not share
    one device and model dtype (e.g. host-resident masters). Call it before CUDA graphs capture the
    parameters' addresses. Returns how many optimizers were coalesced."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    n = 0
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        if type(o) is not Float16OptimizerWithFloat16Params or o.is_stub_optimizer:
            continue
        pairs = [(m, f) for mg, fg in zip(o.float16_groups, o.fp32_from_float16_groups) for m, f in zip(mg, fg)]
        if not pairs or len({m.dtype for m, _ in pairs}) != 1 or len({t.device for pr in pairs for t in pr}) != 1 \
                or any(f.dtype != torch.float32 for _, f in pairs):
            continue
        starts, total = [], 0
        for m, _ in pairs:
            starts.append(total)
            total += -(-m.numel() // align) * align
        dev = pairs[0][0].device
        flat16 = torch.zeros(total, dtype=pairs[0][0].dtype, device=dev)
        flat32 = torch.zeros(total, dtype=torch.float32, device=dev)
        with torch.no_grad():
            for (m, f), a in zip(pairs, starts):
                for t, flat in ((m, flat16), (f, flat32)):
                    view = flat[a:a + t.numel()].view_as(t)
                    view.copy_(t.data)
                    t.data = view
        o.k3_flat_params = (flat16, flat32)
        o._copy_main_params_to_model_params = functools.partial(_flat_copy, flat16, flat32)
        o._copy_model_params_to_main_params = functools.partial(_flat_copy, flat32, flat16)
        n += 1
    return n


def _flat_copy(dst, src, state_dict=None):
    assert state_dict is None, "initialising main params from a state dict is not supported (as in megatron)"
    dst.copy_(src)
