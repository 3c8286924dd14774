"""The one place that knows whether a GPU exists: device selection, and megatron-core on CPU with gloo.

megatron-core 0.19.2 assumes CUDA in many places. On a machine without CUDA, ``setup_device()`` calls
``enable_cpu_mode()``, which makes *the CPU play the role of the CUDA device* for megatron-core, by
patching a few torch entry points (process-wide, idempotent, only when ``torch.cuda.is_available()`` is
False). Nothing else in the project branches on CPU vs GPU, and megatron-core itself is not modified.

What is patched and why (all measured on megatron-core 0.19.2, torch 2.14, see shared/notes):

1. ``torch.cuda.current_device()`` -> 0. Used ~200 times as a device (``device=torch.cuda.current_device()``,
   ``f"cuda:{...}"``); 0 keeps those expressions valid and item 2 maps them to the CPU.
2. ``device=`` arguments naming CUDA (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, an int) in torch
   factory functions (``torch.empty/zeros/ones/full/tensor/arange/...``), ``Tensor.new_*``, ``Tensor.to`` and
   ``Tensor.cuda``
   map to the CPU; ``pin_memory=True`` is dropped (pinning needs CUDA). Covers the ~68 ``device="cuda"``
   literals (optimizer, grad-norm/clip, distributed buffers, pipeline schedules, MoE dispatcher).
3. RNG: ``torch.cuda.get_rng_state/set_rng_state/manual_seed`` and megatron's ``_set_cuda_rng_state`` use the
   CPU default generator. The stock ``_set_cuda_rng_state`` goes through ``torch.cuda._lazy_call``, which
   on CPU would silently never run, so the tensor-parallel RNG tracker (dropout, init) would not fork.
4. Streams/events: ``torch.cuda.Stream/Event/current_stream/stream/synchronize`` become no-op stand-ins
   (the all-to-all dispatcher creates a side stream; dist-ckpt preload synchronises).
5. ``Tensor.type()`` with no argument reports ``torch.cuda.*Tensor`` for CPU tensors: the optimizer and
   grad clipping check ``param.type() == 'torch.cuda.FloatTensor'``.
6. ``moe_utils.maybe_move_tensor_to_cpu(as_numpy=True)`` converts only CUDA tensors, so all-to-all split
   sizes stay tensors on CPU and ``all_to_all_single`` rejects them: convert CPU tensors too.

Process groups use gloo on CPU and NCCL on GPU (``backend()``).

One more patch applies on every machine, CPU or GPU, and only when neither Transformer Engine nor apex is
importable (``use_foreach_fallbacks()``, called by ``setup_device``):

7. megatron's local stand-ins for apex's multi-tensor kernels loop over parameters in Python, and its L2
   norm stand-in reads every per-tensor norm back to the host (``torch.tensor(list_of_cuda_scalars)``: one
   device sync per parameter tensor, ~2,600 per step for k3-mini). They are replaced by ``torch._foreach_*``
   versions with the same results (``_foreach_norm``, ``_foreach_mul_``/``_foreach_copy_``; no host sync).
   ``fuse_torch_adamw`` (called by ``runtime.build_optimizer``) switches megatron's fallback
   ``torch.optim.AdamW`` to torch's fused kernel when its fp32 parameters are on CUDA, stepped by
   ``LeanFusedAdamWStep``: torch's two launches per group from the lists of its last step, without rebuilding
   them per parameter each step (bit-identical; checked by identity each step, torch's own step otherwise).
   tests/test_compat.py pins the stand-ins to megatron's.

And one on every machine (``use_cached_router_walks()``, called by ``setup_device``):

8. megatron's gradient finalisation walks every module of the model twice per step to find the MoE routers
   (``_update_router_expert_bias`` and ``reset_model_temporary_tensors`` in
   ``distributed/finalize_model_grads.py``, three ``hasattr`` per module): 4,396 modules for k3-mini (one per
   expert projection). With ``runtime.moe_routers`` finding its routers once too, the finalisation of a k3-mini
   step went from 85.5 to 6.9 ms of host time on the 2-core development VM (``tools/bench_host.py``).
   The same two functions now receive, for each model chunk, a stand-in whose ``modules()`` lists only that
   chunk's modules carrying the attributes those functions look for (``expert_bias``,
   ``reset_global_aux_loss_tracker``, ``qb_beta_accum``), found once per chunk. megatron's own function bodies
   run unchanged on them (every condition they test is re-evaluated each step); the module tree of a built
   model does not change. tests/test_compat.py checks the expert-bias update and the reset against the
   unpatched functions.

And one on every machine (``use_lean_grad_clipping()``, called by ``setup_device``):

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
   fp64. tests/test_compat.py checks the selection, the absence of host reads in the step, bit-identity with
   megatron's tensor path and one step against its float path. ``perf.lean_grad_clip = False`` (``--no-lean-grad-clip``)
   turns item 9 off (A/B).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from .perf import current as current_kernels

_CPU_MODE = False


def has_gpu() -> bool:
    return torch.cuda.is_available()


def backend() -> str:
    return "nccl" if has_gpu() else "gloo"


def setup_device(local_rank: int | None = None) -> torch.device:
    """Pick this process's device: ``cuda:local_rank`` when CUDA exists, else the CPU (with CPU mode on).
    Refuses (one ``ConfigError`` line) a megatron-core outside the versions the patches were tested with
    (``megatron_k3/patches``) before patching anything."""
    from .patches import check_megatron_core

    check_megatron_core()
    if has_gpu():
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        use_foreach_fallbacks()
        use_cached_router_walks()
        use_lean_grad_clipping()
        return torch.device("cuda", local_rank)
    enable_cpu_mode()
    use_foreach_fallbacks()
    use_cached_router_walks()
    use_lean_grad_clipping()
    return torch.device("cpu")


def cpu_mode_enabled() -> bool:
    return _CPU_MODE


# ---------------------------------------------------------------------------------------------------------
def _is_cuda_device(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


_STAND_IN = "cpu"  # the device that plays CUDA in CPU mode ("meta" under ``simulate``: nothing is allocated)


def play_cuda_on(device: str) -> None:
    """CPU mode: let ``device`` ("cpu", or "meta" for ``megatron_k3.simulate``) play the CUDA device."""
    global _STAND_IN
    _STAND_IN = device


def _map_device_kwargs(kwargs):
    d = kwargs.get("device")
    if d is not None and _is_cuda_device(d):
        kwargs["device"] = _STAND_IN
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
              "randperm", "empty_strided", "eye", "linspace", "zeros_like", "ones_like", "empty_like",
              "full_like", "rand_like", "randn_like")


class _NullStream:
    """Stand-in for torch.cuda.Stream / Event on CPU: every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):  # record_event() returns an event: another stand-in
        return lambda *a, **k: (True if name == "query" else _NullStream())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def enable_cpu_mode():
    """Patch torch so megatron-core's CUDA assumptions resolve to the CPU (see the module docstring)."""
    global _CPU_MODE
    if _CPU_MODE:
        return
    if has_gpu():
        raise RuntimeError("enable_cpu_mode() on a machine with CUDA: use setup_device() instead")

    # 1. current device
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 0

    # 2. factories, Tensor.to, Tensor.cuda
    for name in _FACTORIES:
        orig = getattr(torch, name)

        def wrapped(*args, __orig=orig, **kwargs):
            return __orig(*args, **_map_device_kwargs(kwargs))

        functools.update_wrapper(wrapped, orig)
        setattr(torch, name, wrapped)

    for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"):
        orig_new = getattr(torch.Tensor, name)

        def new(self, *args, __orig=orig_new, **kwargs):
            return __orig(self, *args, **_map_device_kwargs(kwargs))

        setattr(torch.Tensor, name, new)

    orig_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = (_STAND_IN,) + args[1:]
        return orig_to(self, *args, **_map_device_kwargs(kwargs))

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *a, **k: self
    orig_pin = torch.Tensor.pin_memory
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.Tensor._k3_orig_pin_memory = orig_pin

    # 3. RNG
    torch.cuda.get_rng_state = lambda device=None: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    torch.cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls this after seeding the CPU
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    torch.cuda.set_rng_state_all = lambda states: torch.set_rng_state(states[0])

    # 4. streams and events
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None

    # 5. Tensor.type() type-name checks
    orig_type = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return orig_type(self, *args, **kwargs)
        t = orig_type(self).replace("torch.meta.", "torch.", 1)
        return t.replace("torch.", "torch.cuda.", 1) if not t.startswith("torch.cuda.") else t

    torch.Tensor.type = type_

    _patch_megatron()
    _CPU_MODE = True


def _patch_megatron():
    """Megatron-side pieces that cannot be reached through torch (items 3 and 6)."""
    from megatron.core.tensor_parallel import random as tp_random

    def _set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    tp_random._set_cuda_rng_state = _set_rng_state

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# ---------------------------------------------------------------------------------------------------------
# 7. foreach stand-ins for apex's multi-tensor kernels (only where megatron fell back to its local loops)
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


# ---------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------
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
