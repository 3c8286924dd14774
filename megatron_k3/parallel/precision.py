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

torchao recipes (``torchao.float8``, the float8 training of the PyTorch ecosystem; no Transformer Engine):

=========================  ============================================  ============================
``torchao-tensorwise``      one dynamic scale per tensor; e4m3 forward,   compute capability >= 8.9
                            e5m2 gradients
``torchao-rowwise``         one scale per row (per column of the other    compute capability >= 9.0
                            operand), power-of-2 scales, e4m3 everywhere
``torchao-rowwise-gw-hp``   rowwise, but the weight-gradient GEMM in      compute capability >= 9.0
                            bf16
=========================  ============================================  ============================

They route the same projections (:class:`Float8Linear`: the golden ``Linear`` keeps its class's parameter and
names, only its GEMM changes) through torchao's ``matmul_with_hp_or_float8_args`` (quantize both operands
from the bf16 tensors, ``torch._scaled_mm``, the two backward GEMMs likewise), compiled with the rest of the
glue (``model/common.py: fast``) so the amax, scale and cast of each operand are one or two fused kernels.
Unlike Transformer Engine's modules they keep no state and do no host work per call, so they run inside the
layer CUDA graphs (``--cuda-graph-impl local``), and KDA's six projections of x stay one GEMM
(``parallel/layers.py: fused_linears``) on the concatenated weight.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..cli import UsageError
from ..model.common import Linear

TE_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
TORCHAO_RECIPES = {"torchao-tensorwise": "tensorwise", "torchao-rowwise": "rowwise",
                   "torchao-rowwise-gw-hp": "rowwise_with_gw_hp"}  # ours -> torchao's recipe name
FP8_RECIPES = TE_RECIPES + tuple(TORCHAO_RECIPES)
FP8_FORMATS = ("e4m3", "hybrid")
MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0),
                  "torchao-tensorwise": (8, 9), "torchao-rowwise": (9, 0), "torchao-rowwise-gw-hp": (9, 0)}
FP8_DIM_MULTIPLE = 16


def te_version() -> str | None:
    try:
        import transformer_engine
    except ImportError:
        return None
    return getattr(transformer_engine, "__version__", "unknown")


def torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return getattr(torchao, "__version__", "unknown")


def is_torchao(recipe: str | None) -> bool:
    return recipe in TORCHAO_RECIPES


def uses_te(recipe: str | None, fmt: str | None = None) -> bool:
    """Whether the request runs FP8 through Transformer Engine (megatron's fp8 fields, TE modules)."""
    return (recipe is not None or fmt is not None) and not is_torchao(recipe)


def check_fp8(recipe: str | None, fmt: str | None, *, capability: tuple[int, int] | None, te: str | None,
              recompute: str = "none", torchao: str | None = None) -> None:
    """Refuse an FP8 request this machine or run cannot honour, before anything is built.

    ``capability`` is the GPU's (major, minor) or None without CUDA; ``te`` / ``torchao`` the Transformer
    Engine / torchao version or None when it does not import."""
    if recipe is None and fmt is None:
        return
    if recipe is not None and recipe not in FP8_RECIPES:
        raise UsageError(f"--fp8-recipe {recipe}: choose from {', '.join(FP8_RECIPES)}")
    if fmt is not None and fmt not in FP8_FORMATS:
        raise UsageError(f"--fp8-format {fmt}: choose from {', '.join(FP8_FORMATS)}")
    recipe = recipe or "delayed"
    if is_torchao(recipe):
        if fmt is not None:
            raise UsageError(f"--fp8-recipe {recipe} fixes its own formats (torchao: tensorwise e4m3 forward and "
                             "e5m2 gradients, rowwise e4m3); drop --fp8-format")
        if capability is None:
            raise UsageError(f"--fp8-recipe {recipe} needs a CUDA GPU (torch._scaled_mm FP8 GEMMs); drop the FP8 "
                             "flags to train in bf16")
        if torchao is None:
            raise UsageError(f"--fp8-recipe {recipe} needs torchao, which does not import here (pip install "
                             "torchao); drop the FP8 flags to train in bf16")
        need = MIN_CAPABILITY[recipe]
        if tuple(capability) < need:
            raise UsageError(f"--fp8-recipe {recipe} is not supported on this GPU (compute capability "
                             f"{capability[0]}.{capability[1]}): its FP8 GEMMs need compute capability "
                             f"{need[0]}.{need[1]} or higher; on Ada use --fp8-recipe torchao-tensorwise")
        return
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
    """``build_model_chunks`` keywords for the request: megatron TransformerConfig fields for Transformer
    Engine, ``torchao_float8`` for a torchao recipe, ``{}`` for bf16."""
    if recipe is None and fmt is None:
        return {}
    if is_torchao(recipe):
        return {"torchao_float8": recipe}
    return {"fp8": fmt or "e4m3", "fp8_recipe": recipe or "delayed"}


def check_fp8_here(recipe: str | None, fmt: str | None, recompute: str = "none") -> None:
    """``check_fp8`` for this process's GPU and Transformer Engine."""
    if recipe is None and fmt is None:
        return
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    check_fp8(recipe, fmt, capability=cap, te=te_version() if uses_te(recipe, fmt) else None,
              recompute=recompute, torchao=torchao_version() if is_torchao(recipe) else None)


# ---------------------------------------------------------------------------------------------------------
class TELinear(Linear):
    """A golden ``Linear`` whose GEMM is ``transformer_engine.pytorch.Linear`` (FP8 inside an FP8 autocast,
    bf16 outside) on the same weight ``Parameter``. The TE module is kept out of the module tree, so the
    parameter keeps its one name and ``state_dict`` its keys."""

    fusable = False  # TE's module owns the GEMM: fused_linears runs these one by one

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


def eligible_linears(model: nn.Module, multiple: int = FP8_DIM_MULTIPLE) -> list[tuple[str, Linear]]:
    """The projections an FP8 recipe takes: golden ``Linear``s inside ``model.layers`` with both sizes multiples
    of ``multiple`` (the FP8 GEMMs' requirement), as (name, module)."""
    return [(name, m) for name, m in model.named_modules()
            if name.startswith("layers.") and type(m) is Linear
            and not (m.in_features % multiple or m.out_features % multiple)]


def use_te_linears(model: nn.Module, make_te=None, multiple: int = FP8_DIM_MULTIPLE) -> list[str]:
    """Route the eligible projections of ``model.layers`` through Transformer Engine; returns their names."""
    done = eligible_linears(model, multiple)
    for _, m in done:
        TELinear.adopt(m, make_te)
    return [name for name, _ in done]


# ---------------------------------------------------------------------------------------------------------
# torchao float8 training
_AO_GEMMS: dict = {}


def _ao_gemm_fn(recipe: str):
    """``(x, w) -> x @ w.T`` through torchao's float8 matmul for one of ``TORCHAO_RECIPES`` (one function object
    per recipe, so ``model/common.py: compiled`` compiles it once and keys its graphs by shape)."""
    if recipe not in _AO_GEMMS:
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        config = Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe])
        # the three GEMMs' settings, as torchao's own Float8Linear derives them from its config
        mm = LinearMMConfig(*(ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)
                              for g in (config.gemm_config_output, config.gemm_config_grad_input,
                                        config.gemm_config_grad_weight)))

        def gemm(x, w):
            return matmul_with_hp_or_float8_args.apply(x, w.t(), mm, config)

        gemm.__name__ = gemm.__qualname__ = "float8_gemm_" + TORCHAO_RECIPES[recipe]
        _AO_GEMMS[recipe] = gemm
    return _AO_GEMMS[recipe]


def float8_gemm(x: torch.Tensor, w: torch.Tensor, recipe: str) -> torch.Tensor:
    """``F.linear(x, w)`` with the GEMMs of forward and backward in FP8 (torchao ``recipe``): the quantisation
    of both operands is compiled with the GEMM call on CUDA (``fast``: amax, scale and cast fused)."""
    from ..model.common import fast

    fn = _ao_gemm_fn(recipe)
    return fast(fn, x)(x, w)


class Float8Linear(Linear):
    """A golden ``Linear`` whose GEMMs run in FP8 through torchao (``float8_gemm``); same ``Parameter``, name
    and ``state_dict`` key. ``fusable``: ``fused_linears`` may run several of them (same recipe) as one FP8
    GEMM on their concatenated weights."""

    fusable = True

    @classmethod
    def adopt(cls, lin: Linear, recipe: str) -> "Float8Linear":
        if recipe not in TORCHAO_RECIPES:
            raise ValueError(f"not a torchao recipe: {recipe}")
        lin.__class__ = cls
        lin.fp8_recipe = recipe
        return lin

    def gemm(self, x, w):
        return float8_gemm(x, w, self.fp8_recipe)

    def forward(self, x):
        return self.gemm(x, self.weight)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8_recipe={self.fp8_recipe}"


def use_torchao_linears(model: nn.Module, recipe: str, multiple: int = FP8_DIM_MULTIPLE) -> list[str]:
    """Route the eligible projections of ``model.layers`` (``eligible_linears``, as for Transformer Engine)
    through torchao's float8 GEMMs; returns their names."""
    done = eligible_linears(model, multiple)
    for _, m in done:
        Float8Linear.adopt(m, recipe)
    return [name for name, _ in done]


def layer_context(config, layer_no: int):
    """The FP8 autocast of one decoder layer (megatron's ``get_fp8_context``), or a null context for bf16."""
    if not getattr(config, "fp8", None):
        return contextlib.nullcontext()
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(config, layer_no)
