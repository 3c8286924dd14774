"""Build a rank's model chunks without ever building the whole model: parameters on the meta device first,
then this rank's shards allocated on its device and initialised piece by piece.

``meta_parameters()`` makes every ``nn.Parameter`` registered inside it a meta tensor (shape, dtype and the
attributes the layers set: ``tensor_model_parallel``, ``partition_dim``, ``allreduce``, ...), while buffers
(router counts, expert bias) are built as usual: they are small and several are initialised by their
constructors. ``materialize_(chunks, device, dtype)`` then gives each parameter real, uninitialised storage
on ``device`` (``torch.utils.swap_tensors``: the same Parameter objects, so the attributes stay) and moves
the buffers, with the dtype rules of ``Module.to(device, dtype)``; the spec's fp32 parameters (modules'
``fp32_params``) and the routers' correction bias stay fp32 (megatron's router restores its bias to fp32
only at its first forward: a checkpoint loaded before that would be rounded to bf16).

``init_chunks_(chunks, cfg, seed, tp_rank)`` writes the golden initialisation into the shards: for each
local tensor the weight adapter's pieces name the HF tensor and the slice it holds; the full HF tensor is
generated alone on the host (``model/init.py``: a per-module generator, so the values are those of
``K3ForCausalLM(cfg, seed=seed)`` whatever the layout), sliced, copied and dropped. Peak host memory is one
full parameter (plus the module it belongs to: KDA's ``A_log`` and ``dt_bias`` are generated together);
the device holds only the shards. Left on the meta device (``simulate``), the chunks cost nothing.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def meta_parameters():
    """Inside: parameters are created on the meta device (the values any constructor gave them are dropped)."""
    orig = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        orig(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


def fp32_parameter_ids(chunks) -> set[int]:
    """ids of the parameters the spec keeps in fp32 (modules' ``fp32_params``: KDA A_log/dt_bias/convs/o_norm)."""
    out = set()
    for c in chunks:
        for m in c.modules():
            for pname in getattr(m, "fp32_params", ()):
                out.add(id(m.get_parameter(pname)))
    return out


def materialize_(chunks, device, dtype: torch.dtype) -> None:
    """Allocate every meta parameter on ``device`` (``dtype``, fp32 for the spec's fp32 parameters) in place,
    keeping the Parameter objects; move and cast buffers as ``Module.to(device, dtype)`` would. With
    ``device`` "meta" nothing is allocated: the parameters only get their dtypes."""
    keep32 = fp32_parameter_ids(chunks)
    for c in chunks:
        for m in c.modules():
            for k, p in m._parameters.items():
                if p is None or (p.device.type != "meta" and p.device == device):
                    continue
                real = nn.Parameter(torch.empty(p.shape, dtype=torch.float32 if id(p) in keep32 else dtype,
                                                device=device), requires_grad=p.requires_grad)
                attrs = dict(p.__dict__)
                torch.utils.swap_tensors(p, real)  # swaps the Python attributes too: put ours back
                p.__dict__.update(attrs)
            for k, b in m._buffers.items():
                if b is not None:
                    m._buffers[k] = b.to(device=device, dtype=dtype if b.is_floating_point() else None)
        for m in c.modules():  # the routers' correction bias stays fp32
            if getattr(m, "expert_bias", None) is not None and m.expert_bias.dtype != torch.float32:
                m.expert_bias.data = m.expert_bias.data.float()


def init_chunks_(chunks, cfg, seed: int, tp_rank: int) -> int:
    """Golden initialisation of this rank's shards (module docstring). Returns the number of elements written."""
    from ..model.skeleton import GoldenSkeleton
    from .adapter import _named_tensors, pieces

    sk = GoldenSkeleton(cfg)
    n = 0
    with torch.no_grad():
        for c in chunks:
            for name, t in _named_tensors(c).items():
                for hf, hidx, lidx in pieces(c, name, t, tp_rank, sk.shapes):
                    dst = t[lidx]
                    dst.copy_(sk.initial_value(hf, seed)[hidx].to(t.dtype))
                    n += dst.numel()
    return n
