"""Patch 7: torch ``_foreach`` stand-ins for apex's multi-tensor kernels, and torch's fused AdamW.

Written against megatron-core 0.19.2 (``patches.TESTED``: ``clip_grads.l2_norm_impl``,
``multi_tensor_scale_impl``, the ``torch.optim.AdamW`` fallback of ``get_megatron_optimizer``). Applied by
``compat.setup_device()``; ``fuse_torch_adamw`` by ``parallel.runtime.build_optimizer``.

Applies on every machine, CPU or GPU, and only when neither Transformer Engine nor apex is importable.

7. megatron's local stand-ins for apex's multi-tensor kernels loop over parameters in Python, and its L2
   norm stand-in reads every per-tensor norm back to the host (``torch.tensor(list_of_cuda_scalars)``: one
   device sync per parameter tensor, ~2,600 per step for k3-mini). They are replaced by ``torch._foreach_*``
   versions with the same results (``_foreach_norm``, ``_foreach_mul_``/``_foreach_copy_``; no host sync).
   ``fuse_torch_adamw`` (called by ``runtime.build_optimizer``) switches megatron's fallback
   ``torch.optim.AdamW`` to torch's fused kernel when its fp32 parameters are on CUDA, stepped by
   ``LeanFusedAdamWStep``: torch's two launches per group from the lists of its last step, without rebuilding
   them per parameter each step (bit-identical; checked by identity each step, torch's own step otherwise).
   tests/parallel/test_patches.py pins the stand-ins to megatron's.
"""
from __future__ import annotations

import torch

from ..perf import current as current_kernels

_FOREACH = False


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm`` (total norm only): the 2-norm of all tensors of ``tensor_lists[0]``,
    a 1-element fp32 tensor on their device; one ``_foreach_norm``, no host sync."""
    ts = [t for t in tensor_lists[0] if t.numel()]
    if not ts:
        dev = tensor_lists[0][0].device if tensor_lists[0] else "cuda"
        return torch.zeros(1, dtype=torch.float32, device=dev), None
    norms = torch._foreach_norm(ts, 2, dtype=torch.float32)  # accumulate in fp32, as apex's kernel does
    total = torch.linalg.vector_norm(torch.stack(norms))
    return total.reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale``: ``dst = src * scale`` (in src's dtype, then cast, as megatron's loop); and,
    with ``scale`` a one-element device tensor, Transformer Engine's ``multi_tensor_scale_tensor`` (megatron's
    clip coefficient kept on the device, item 9: no host sync)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    on_device = torch.is_tensor(scale)
    if on_device:
        scale = scale.reshape(())
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, src if not on_device and scale == 1.0 else torch._foreach_mul(src, scale))


def fuse_torch_adamw(optimizer, device_types=("cuda",)) -> int:
    """Switch every plain ``torch.optim.AdamW`` inside a megatron optimizer (its no-TE/no-apex fallback) whose
    parameters all live on a device of ``device_types`` (CUDA; the CPU too for tests and ``bench_host``) to
    torch's fused kernel, driven by ``LeanFusedAdamWStep``; a pre-step hook moves ``step`` counters restored on
    the host to the parameters' device (the fused kernel wants them there). Returns how many were switched."""
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    n = 0
    for o in inners:
        inner = getattr(o, "optimizer", None)
        if type(inner) is not torch.optim.AdamW:
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or not all(p.device.type in device_types and p.dtype == torch.float32 for p in params):
            continue
        for g in inner.param_groups:
            g["fused"], g["foreach"] = True, False

        def _steps_to_device(opt, args, kwargs):
            for p, st in opt.state.items():
                s = st.get("step")
                if torch.is_tensor(s) and s.device != p.device:
                    st["step"] = s.to(device=p.device, dtype=torch.float32)

        inner.register_step_pre_hook(_steps_to_device)
        if current_kernels().lean_adamw:
            inner.step = LeanFusedAdamWStep(inner)
        n += 1
    return n


class LeanFusedAdamWStep:
    """``step`` of a fused ``torch.optim.AdamW`` without torch's per-parameter Python after the first step.

    torch's ``Adam.step`` rebuilds six lists per parameter group every step (``_init_group``: a state lookup,
    six appends and checks per parameter; 2,447 parameters in k3-mini) before its one fused kernel launch.
    This keeps the lists of the last torch step and launches the same two calls torch makes
    (``_foreach_add_(steps, 1)``, ``_fused_adamw_``) with the group's current ``lr``, betas, ``eps`` and
    ``weight_decay``: bit-identical results. Each step first checks, by identity, that every parameter's
    ``.grad`` and every state tensor (moments, ``step``) is still the listed one and that the options are
    the ones this path supports (fused, decoupled decay, no amsgrad/maximize/differentiable/capturable, float
    lr, no grad scaler, no step hooks but ``fuse_torch_adamw``'s); otherwise, and for a closure, it runs
    torch's own step (which also creates the state on the first step) and lists again. A checkpoint restore
    that replaces state tensors therefore falls back for one step. ``perf.lean_adamw = False`` keeps torch's step."""

    def __init__(self, opt):
        self.opt, self.torch_step, self.lists = opt, opt.step, None
        self.lean_steps = 0  # steps taken by this path (tests)

    def _supported(self) -> bool:
        o = self.opt
        if getattr(o, "grad_scale", None) is not None or getattr(o, "found_inf", None) is not None:
            return False
        from torch.optim import optimizer as topt

        if len(o._optimizer_step_pre_hooks) > 1 or o._optimizer_step_post_hooks \
                or topt._global_optimizer_pre_hooks or topt._global_optimizer_post_hooks:
            return False
        return all(g["fused"] and g["decoupled_weight_decay"] and not (g["amsgrad"] or g["maximize"]
                   or g["differentiable"] or g["capturable"]) and not torch.is_tensor(g["lr"])
                   for g in o.param_groups)

    def _relist(self):
        o = self.opt
        lists = []
        for g in o.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            sts = [o.state[p] for p in ps]
            if any(len(st) == 0 or "max_exp_avg_sq" in st for st in sts) \
                    or len({(p.device, p.dtype) for p in ps} | {(p.grad.device, p.grad.dtype) for p in ps}) > 1:
                self.lists = None
                return
            lists.append((g["params"], len(g["params"]), ps, [p.grad for p in ps], [st["exp_avg"] for st in sts],
                          [st["exp_avg_sq"] for st in sts], [st["step"] for st in sts]))
        self.lists = lists

    def _listed(self) -> bool:
        import operator

        if self.lists is None or len(self.lists) != len(self.opt.param_groups):
            return False
        state = self.opt.state
        for g, (plist, n, ps, grads, m, v, steps) in zip(self.opt.param_groups, self.lists):
            if g["params"] is not plist or len(plist) != n or len(ps) != sum(p.grad is not None for p in plist):
                return False
            sts = [state.get(p) for p in ps]
            if None in sts or not (all(map(operator.is_, grads, [p.grad for p in ps]))
                                   and all(map(operator.is_, m, [st.get("exp_avg") for st in sts]))
                                   and all(map(operator.is_, v, [st.get("exp_avg_sq") for st in sts]))
                                   and all(map(operator.is_, steps, [st.get("step") for st in sts]))):
                return False
        return True

    @torch.no_grad()
    def __call__(self, closure=None):
        if closure is not None or not self._supported() or not self._listed():
            loss = self.torch_step(closure)
            self._relist()
            return loss
        for g, (_, _, ps, grads, m, v, steps) in zip(self.opt.param_groups, self.lists):
            if not ps:
                continue
            b1, b2 = g["betas"]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(ps, grads, m, v, [], steps, amsgrad=False, lr=g["lr"], beta1=b1, beta2=b2,
                                weight_decay=g["weight_decay"], eps=g["eps"], maximize=False, grad_scale=None,
                                found_inf=None)
        self.lean_steps += 1
        return None


def use_foreach_fallbacks() -> bool:
    """Apply item 7 (idempotent). Returns whether megatron uses the foreach stand-ins."""
    global _FOREACH
    if _FOREACH:
        return True
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer as mopt_optimizer

    if clip_grads.l2_norm_impl is not mutils.local_multi_tensor_l2_norm:
        return False  # Transformer Engine or apex provides the real multi-tensor kernels
    clip_grads.l2_norm_impl = foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = foreach_scale
    if mopt_optimizer.multi_tensor_scale_impl is mutils.local_multi_tensor_scale:
        mopt_optimizer.multi_tensor_scale_impl = foreach_scale
    _FOREACH = True
    return True
