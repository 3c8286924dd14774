"""FP8 policy: which recipe, whether this machine can run it, and which GEMMs run in FP8.

Decided here, from the config and the flags, and nowhere else (``tconfig.py`` puts the result into
megatron-core's ``TransformerConfig`` under megatron's names ``fp8`` / ``fp8_recipe``; the layers never look).

Recipes (megatron-core / Transformer Engine):

=============  ============================================  ===================================
``delayed``     ``DelayedScaling``: per-tensor scale from an   compute capability >= 8.9
                amax history (state carried between steps)
``tensorwise``  ``Float8CurrentScaling``: per-tensor scale     compute capability >= 8.9
                from the current tensor
``blockwise``   ``Float8BlockScaling``: 1x128 / 128x128        compute capability >= 9.0 (Hopper)
                block scales (DeepSeek-V3 style)
``mxfp8``       ``MXFP8BlockScaling``: 1x32 blocks, E8M0       compute capability >= 10.0
                scales                                         (Blackwell)
=============  ============================================  ===================================

What runs in FP8: inside each decoder layer (megatron's ``get_fp8_context`` around the layer, re-entered when
``--recompute-granularity full`` recomputes it), every projection that is a golden ``Linear`` with both
dimensions multiples of 16 (Transformer Engine's FP8 GEMM requirement): KDA's q/k/v/gate/beta/output
projections, MLA's low-rank and output projections, the dense and shared-expert SiTU-GLU MLPs and the latent
MoE down/up projections. They call ``transformer_engine.pytorch.Linear`` holding *the same* weight
``Parameter`` (:class:`TELinear`), so names, DDP buffers, the optimizer and checkpoints do not change.
bf16 stays: the embedding, the LM head and cross-entropy, the router, the routed experts' grouped GEMMs
(``torch._grouped_mm``), the attention and KDA cores, norms, Attention Residuals, and the MTP layers.
Delayed scaling's amax history is not checkpointed (a resume restarts it); the other recipes keep no state.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..cli import UsageError
from ..model.common import Linear

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP8_FORMATS = ("e4m3", "hybrid")
MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
FP8_DIM_MULTIPLE = 16


def te_version() -> str | None:
    try:
        import transformer_engine
    except ImportError:
        return None
    return getattr(transformer_engine, "__version__", "unknown")


def check_fp8(recipe: str | None, fmt: str | None, *, capability: tuple[int, int] | None, te: str | None,
              recompute: str = "none") -> None:
    """Refuse an FP8 request this machine or run cannot honour, before anything is built.

    ``capability`` is the GPU's (major, minor) or None without CUDA; ``te`` the Transformer Engine version or
    None when it does not import."""
    if recipe is None and fmt is None:
        return
    if recipe is not None and recipe not in FP8_RECIPES:
        raise UsageError(f"--fp8-recipe {recipe}: choose from {', '.join(FP8_RECIPES)}")
    if fmt is not None and fmt not in FP8_FORMATS:
        raise UsageError(f"--fp8-format {fmt}: choose from {', '.join(FP8_FORMATS)}")
    recipe = recipe or "delayed"
    if capability is None:
        raise UsageError(f"--fp8-recipe {recipe} needs a CUDA GPU (FP8 GEMMs are Transformer Engine kernels); "
                         "drop the FP8 flags to train in bf16")
    if te is None:
        raise UsageError(f"--fp8-recipe {recipe} needs Transformer Engine, which does not import here "
                         "(pip install transformer-engine[pytorch]); drop the FP8 flags to train in bf16")
    need = MIN_CAPABILITY[recipe]
    if tuple(capability) < need:
        have = f"{capability[0]}.{capability[1]}"
        hint = {"mxfp8": "on Hopper use --fp8-recipe blockwise",
                "blockwise": "on Ada use --fp8-recipe tensorwise or delayed"}.get(recipe, "train in bf16")
        raise UsageError(f"--fp8-recipe {recipe} is not supported on this GPU (compute capability {have}): "
                         f"Transformer Engine requires compute capability {need[0]}.{need[1]} or higher "
                         f"for it; {hint}")
    if recipe in ("blockwise", "mxfp8") and fmt == "hybrid":
        raise UsageError(f"--fp8-recipe {recipe} uses E4M3 for all tensors; use --fp8-format e4m3")
    if recipe == "delayed" and recompute == "full":
        raise UsageError("--fp8-recipe delayed with --recompute-granularity full would update the amax history "
                         "twice per layer (forward and recompute); use tensorwise or blockwise, or selective")


def resolve(recipe: str | None, fmt: str | None) -> dict:
    """megatron TransformerConfig fields for the request (``{}`` for bf16)."""
    if recipe is None and fmt is None:
        return {}
    return {"fp8": fmt or "e4m3", "fp8_recipe": recipe or "delayed"}


def check_fp8_here(recipe: str | None, fmt: str | None, recompute: str = "none") -> None:
    """``check_fp8`` for this process's GPU and Transformer Engine."""
    if recipe is None and fmt is None:
        return
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    check_fp8(recipe, fmt, capability=cap, te=te_version(), recompute=recompute)


# ---------------------------------------------------------------------------------------------------------
class TELinear(Linear):
    """A golden ``Linear`` whose GEMM is ``transformer_engine.pytorch.Linear`` (FP8 inside an FP8 autocast,
    bf16 outside) on the same weight ``Parameter``. The TE module is kept out of the module tree, so the
    parameter keeps its one name and ``state_dict`` its keys."""

    @classmethod
    def adopt(cls, lin: Linear, make_te=None) -> "TELinear":
        if make_te is None:
            import transformer_engine.pytorch as te

            def make_te(i, o, dtype, device):  # its own weight is a placeholder, replaced below
                return te.Linear(i, o, bias=False, params_dtype=dtype, device=device)
        inner = make_te(lin.in_features, lin.out_features, lin.weight.dtype, lin.weight.device)
        inner.weight = lin.weight  # share the Parameter (replaces the placeholder)
        object.__setattr__(lin, "_te", inner)  # not a submodule
        lin.__class__ = cls
        return lin

    def forward(self, x):
        return self._te(x)

    def train(self, mode: bool = True):
        self._te.train(mode)
        return super().train(mode)


def use_te_linears(model: nn.Module, make_te=None, multiple: int = FP8_DIM_MULTIPLE) -> list[str]:
    """Route the eligible projections of ``model.layers`` through Transformer Engine; returns their names."""
    done = []
    for name, m in model.named_modules():
        if not name.startswith("layers.") or type(m) is not Linear:
            continue
        if m.in_features % multiple or m.out_features % multiple:
            continue
        TELinear.adopt(m, make_te)
        done.append(name)
    return done


def layer_context(config, layer_no: int):
    """The FP8 autocast of one decoder layer (megatron's ``get_fp8_context``), or a null context for bf16."""
    if not getattr(config, "fp8", None):
        return contextlib.nullcontext()
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(config, layer_no)
