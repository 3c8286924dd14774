"""The process-wide kernel and fast-path choices: typed settings instead of environment variables.

The trainer sets them once from its configuration's ``perf`` section (``--compile``, ``--short-conv-impl``,
... in ``python -m megatron_k3 train --help``) before it builds anything, and records them with the run;
the layers read the current value where they choose a kernel (``current().short_conv``), which costs an
attribute lookup. Tests and tools that run layers directly use ``using(...)`` or ``configure(...)``.

- ``compile``: ``auto`` compiles the element-wise glue (``model/common.py``) for CUDA tensors with autograd
  on; ``off`` never; ``all`` always, on every device (tests pin the compiled graphs to eager on the CPU).
- ``compile_backend``: torch.compile backend (``inductor``; tests use ``aot_eager``).
- ``attn_res``: Attention-Residual mixer on CUDA: ``triton`` (``model/attn_res_triton.py``) or ``compiled``.
- ``short_conv``: KDA's short convolutions on CUDA: ``fla`` (flash-linear-attention's ``causal_conv1d``),
  ``compiled`` (the reference, compiled) or ``triton`` (``model/short_conv_triton.py``).
- ``sdpa_backend``: MLA's SDPA kernel order on CUDA: ``auto`` (torch's choice) or ``cudnn`` first.
- ``cross_entropy``: the LM head's cross-entropy chunks on CUDA (``linear_cross_entropy``): ``triton``
  (``model/ce_triton.py``: each logits row read twice) or ``compiled`` (``ce_sum_and_grad`` compiled).
- ``graph_shared_inputs`` / ``graph_main_grad``: layer CUDA graphs read the AttnRes snapshots from the
  snapshot layer's static input, and add the parameters' gradients to ``main_grad`` inside the backward
  graph (``megatron/graphs.py``).
- ``lean_grad_clip`` / ``lean_adamw``: the optimizer-step patches ``patches/lean_grad_clip.py`` and ``patches/foreach_kernels.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

CHOICES = {
    "compile": ("auto", "off", "all"),
    "attn_res": ("triton", "compiled"),
    "short_conv": ("fla", "compiled", "triton"),
    "sdpa_backend": ("auto", "cudnn"),
    "cross_entropy": ("triton", "compiled"),
}


@dataclass(frozen=True)
class Kernels:
    compile: str = "auto"
    compile_backend: str = "inductor"
    attn_res: str = "triton"
    short_conv: str = "fla"
    sdpa_backend: str = "auto"
    cross_entropy: str = "triton"
    graph_shared_inputs: bool = True
    graph_main_grad: bool = True
    lean_grad_clip: bool = True
    lean_adamw: bool = True

    def __post_init__(self):
        from .config import ConfigError

        for name, allowed in CHOICES.items():
            v = getattr(self, name)
            if v not in allowed:
                raise ConfigError(f"perf.{name} = {v!r}: choose one of {', '.join(allowed)}")


_CURRENT = Kernels()


def current() -> Kernels:
    return _CURRENT


def configure(**changes) -> Kernels:
    """Replace the named settings (validated); returns the previous settings."""
    global _CURRENT
    prev = _CURRENT
    _CURRENT = dataclasses.replace(_CURRENT, **changes)
    return prev


@contextlib.contextmanager
def using(**changes):
    """The named settings inside the block, the previous ones after it."""
    global _CURRENT
    prev = configure(**changes)
    try:
        yield _CURRENT
    finally:
        _CURRENT = prev


def fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Kernels))
