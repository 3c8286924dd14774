"""Patch 1-6, CPU mode: megatron-core 0.19.2 on a machine without CUDA, the CPU playing the CUDA device.

Fixes: megatron-core assumes CUDA in many places (device arguments, RNG, streams, type-name checks, MoE
split sizes), so it cannot run on a CPU-only machine with gloo. Written against megatron-core 0.19.2
(``patches.TESTED``). Applied by ``compat.setup_device()`` only when ``torch.cuda.is_available()`` is False;
process-wide and idempotent. megatron-core itself is not modified.

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
"""
from __future__ import annotations

import contextlib
import functools

import torch

_CPU_MODE = False


def enabled() -> bool:
    return _CPU_MODE


def _is_cuda_device(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


_STAND_IN = "cpu"  # the device that plays CUDA in CPU mode ("meta" under ``simulate``: nothing is allocated)


def play_cuda_on(device: str) -> None:
    """CPU mode: let ``device`` ("cpu", or "meta" for ``megatron_k3.plan.simulate``) play the CUDA device."""
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


def enable():
    """Patch torch so megatron-core's CUDA assumptions resolve to the CPU (see the module docstring)."""
    global _CPU_MODE
    if _CPU_MODE:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_mode.enable() on a machine with CUDA: use compat.setup_device() instead")

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
