r"""Seeded initialisation that any rank can reproduce for any single tensor, without the rest of the model.

Rule: the module named ``name`` (its official HF name, e.g. ``model.layers.3.self_attn.q_proj``) draws its
initial values from its own generator,

    gen(seed, name) = torch.Generator().manual_seed(first 63 bits of sha256(f"k3-init/{seed}/{name}"))

through its ``reset_parameters(gen)`` (normal(0, std) for projections and embeddings, U(-1/2, 1/2) for the
short convolutions, ones for norm gains, zeros for AttnRes pseudo-queries and the router bias, the KDA
``A_log``/``dt_bias`` rule of ``kda.py``). A module's values therefore depend on (seed, its name, its
shape) only, not on what else the model holds or in what order it is built. That is what lets a rank of a
split model initialise its shards directly (``skeleton.GoldenSkeleton.initial_value`` + the weight adapter) and get,
for every layout, exactly the slices of ``K3ForCausalLM(cfg, seed=seed)``: the full tensor of one
parameter is generated on the host, sliced, and dropped, so a rank never holds more than its shards plus
one full parameter (``megatron_k3/parallel/rank_init.py``; tests/parallel/test_init.py measures it).

``skeleton.GoldenSkeleton`` holds the golden model's modules on the meta device one decoder layer at a time,
so even k3-full (332,424 modules, 12.7 s and 1.5 GB of host memory as a whole meta model) is never built
whole by a rank. This module imports no model (``k3.py`` uses it).
"""
from __future__ import annotations

import copy
import hashlib

import torch
from torch import nn


def module_seed(seed: int, name: str) -> int:
    """The generator seed of the module called ``name`` (63 bits of sha256: independent streams per module)."""
    h = hashlib.sha256(f"k3-init/{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def module_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(module_seed(seed, name))


def init_module_(module: nn.Module, name: str, seed: int) -> None:
    """Run ``module.reset_parameters`` with the generator of ``name``; it touches only the module's own tensors."""
    module.reset_parameters(module_generator(seed, name))


def materialised_copy(module: nn.Module, device="cpu") -> nn.Module:
    """A shallow copy of a (meta) module whose *own* parameters and buffers are fresh, uninitialised tensors on
    ``device`` (children stay shared and untouched): enough to run its ``reset_parameters``."""
    m = copy.copy(module)
    m._parameters = {k: (None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                              requires_grad=p.requires_grad))
                     for k, p in module._parameters.items()}
    m._buffers = {k: (None if b is None else torch.empty(b.shape, dtype=b.dtype, device=device))
                  for k, b in module._buffers.items()}
    return m
