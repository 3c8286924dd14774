"""The golden model's structure on the meta device, one decoder layer at a time: shapes of HF-named tensors
and single tensors' initial values (``init.py``) without building the whole model.

The top-level embedding, final norms, head and MTP heads are always built; decoder layers one at a time (the
last one is kept), so a rank of k3-full never holds more than one meta layer's modules.
"""
from __future__ import annotations

import torch
from torch import nn

from .init import init_module_, materialised_copy
from .k3 import K3ForCausalLM


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
        layer = self._layer_of(hf_name)
        if self._built is None or self._built[0] != layer:
            with torch.device("meta"):
                self._built = (layer, K3ForCausalLM(self.cfg, init=False, only_layers=() if layer is None else (layer,)))
        return self._built[1]

    def tensor(self, hf_name: str) -> torch.Tensor:
        model = self.model_for(hf_name)
        mod_name, _, leaf = hf_name.rpartition(".")
        return getattr(model.get_submodule(mod_name), leaf)

    def module_of(self, hf_name: str) -> tuple[str, nn.Module]:
        """(module name, the meta module) that generates ``hf_name``; an error if it cannot initialise itself."""
        mod_name = hf_name.rpartition(".")[0]
        module = self.model_for(hf_name).get_submodule(mod_name)
        if not hasattr(module, "reset_parameters"):
            raise RuntimeError(f"{mod_name} ({type(module).__name__}) has no reset_parameters: '{hf_name}' would "
                               "stay uninitialised")
        return mod_name, module

    def initial_value(self, hf_name: str, seed: int) -> torch.Tensor:
        """The full initial tensor of ``hf_name`` (fp32, or the parameter's own dtype), on the CPU."""
        mod_name, _, leaf = hf_name.rpartition(".")
        if self._last is not None and self._last[0] == mod_name and self._last[1] == seed:
            return self._last[2][leaf]
        values = initial_values(*self.module_of(hf_name), seed)
        self._last = (mod_name, seed, values)
        return values[leaf]


def initial_values(mod_name: str, module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The initial values of the (meta) ``module``'s own parameters and buffers, by leaf name, on the CPU. It
    touches only a private copy of the module, so threads may call it for different modules at once."""
    m = materialised_copy(module)
    init_module_(m, mod_name, seed)
    return {k: v.detach() for k, v in list(m._parameters.items()) + list(m._buffers.items()) if v is not None}


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
