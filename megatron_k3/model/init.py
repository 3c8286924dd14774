r"""Seeded initialisation that any rank can reproduce for any single tensor, without the rest of the model.

Rule: the module named ``name`` (its official HF name, e.g. ``model.layers.3.self_attn.q_proj``) draws its
initial values from its own generator,

    gen(seed, name) = torch.Generator().manual_seed(first 63 bits of sha256(f"k3-init/{seed}/{name}"))

through its ``reset_parameters(gen)`` (normal(0, std) for projections and embeddings, U(-1/2, 1/2) for the
short convolutions, ones for norm gains, zeros for AttnRes pseudo-queries and the router bias, the KDA
``A_log``/``dt_bias`` rule of ``kda.py``). A module's values therefore depend on (seed, its name, its
shape) only, not on what else the model holds or in what order it is built. That is what lets a rank of a
split model initialise its shards directly (``GoldenSkeleton.initial_value`` + the weight adapter) and get,
for every layout, exactly the slices of ``K3ForCausalLM(cfg, seed=seed)``: the full tensor of one
parameter is generated on the host, sliced, and dropped, so a rank never holds more than its shards plus
one full parameter (``megatron_k3/megatron/init.py``; tests/test_init.py measures it).

``GoldenSkeleton`` holds the golden model's modules on the meta device one decoder layer at a time (the
top-level embedding, final norms, head and MTP heads always), so even k3-full (332,424 modules, 12.7 s and
1.5 GB of host memory as a whole meta model) is never built whole by a rank.
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


class GoldenSkeleton:
    """The golden model's structure on the meta device, built lazily: one decoder layer at a time plus the
    top-level modules. ``shapes`` is a mapping HF name -> shape for the weight adapter; ``initial_value(hf,
    seed)`` is that tensor as ``K3ForCausalLM(cfg, seed=seed)`` initialises it (CPU)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._built: tuple[int | None, nn.Module] | None = None
        self._last: tuple[str, int, dict] | None = None
        self.shapes = _LazyShapes(self)

    def _layer_of(self, hf_name: str) -> int | None:
        parts = hf_name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
            return int(parts[2])
        return None

    def model_for(self, hf_name: str) -> nn.Module:
        """A meta ``K3ForCausalLM`` holding (at least) the module of ``hf_name``."""
        from .k3 import K3ForCausalLM

        layer = self._layer_of(hf_name)
        if self._built is None or self._built[0] != layer:
            with torch.device("meta"):
                self._built = (layer, K3ForCausalLM(self.cfg, init=False, only_layers=() if layer is None else (layer,)))
        return self._built[1]

    def tensor(self, hf_name: str) -> torch.Tensor:
        model = self.model_for(hf_name)
        mod_name, _, leaf = hf_name.rpartition(".")
        return getattr(model.get_submodule(mod_name), leaf)

    def initial_value(self, hf_name: str, seed: int) -> torch.Tensor:
        """The full initial tensor of ``hf_name`` (fp32, or the parameter's own dtype), on the CPU."""
        mod_name, _, leaf = hf_name.rpartition(".")
        if self._last is not None and self._last[0] == mod_name and self._last[1] == seed:
            return self._last[2][leaf]
        module = self.model_for(hf_name).get_submodule(mod_name)
        if not hasattr(module, "reset_parameters"):
            raise RuntimeError(f"{mod_name} ({type(module).__name__}) has no reset_parameters: '{hf_name}' would "
                               "stay uninitialised")
        m = materialised_copy(module)
        init_module_(m, mod_name, seed)
        values = {k: v.detach() for k, v in list(m._parameters.items()) + list(m._buffers.items()) if v is not None}
        self._last = (mod_name, seed, values)
        return values[leaf]


class _LazyShapes:
    """``{hf_name: shape}`` answered from the skeleton (the adapter asks for the shapes of TP-split tensors)."""

    def __init__(self, skeleton: GoldenSkeleton):
        self.sk = skeleton
        self.cache: dict = {}

    def __getitem__(self, hf_name: str):
        s = self.cache.get(hf_name)
        if s is None:
            s = self.cache[hf_name] = self.sk.tensor(hf_name).shape
        return s

    def __contains__(self, hf_name: str) -> bool:
        try:
            self.sk.tensor(hf_name)
            return True
        except AttributeError:
            return False
