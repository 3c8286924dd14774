"""K3 model configuration: one dataclass, the presets, and up-front validation.

Field names follow the released HF ``text_config`` (``model_type = "kimi_linear"``) wherever a field
exists there, so a config maps to ``config.json`` one to one (see ``to_hf_dict``).

Presets
-------
``k3-tiny``          CPU tests: hidden 64, 8 layers, KDA 4x16, MLA 4 heads, AttnRes blocks of 2 layers, 8 experts
                     top-2 + 1 shared, latent 32, vocab 512 (heads divide TP x CP = 4).
``k3-mini``          the ~1.26B benchmark model (exact count: ``tools/model_info.py --preset k3-mini``).
``k3-full``          the released 2.8T K3 text config (``shared/K3_ARCHITECTURE.md`` section 1).
``kimi-linear-48b``  the predecessor (Kimi Linear 48B-A3B): SiLU, unbounded KDA gate, low-rank output gate,
                     no AttnRes, no latent MoE, no MLA output gate, plain q projection.

Layer rule: 1-indexed layer ``n`` is KDA iff ``n % 4 != 0 and n <= L - 2`` (K3); everything else is MLA.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot describe a valid K3 model (reported as one line, no traceback)."""


def k3_kda_layers(num_layers: int) -> list[int]:
    """K3's layer rule, 1-indexed: layer n is KDA iff n % 4 != 0 and n <= L - 2."""
    return [n for n in range(1, num_layers + 1) if n % 4 != 0 and n <= num_layers - 2]


@dataclass
class K3Config:
    # ---- trunk -------------------------------------------------------------------------------
    hidden_size: int = 64
    num_hidden_layers: int = 8
    vocab_size: int = 512
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # ---- layer kinds (1-indexed lists, as in the HF linear_attn_config); None -> K3's rule -----
    kda_layers: list[int] | None = None
    # ---- KDA ----------------------------------------------------------------------------------
    kda_num_heads: int = 2
    kda_head_dim: int = 32
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0  # None: Kimi Linear's unbounded gate -exp(A)*softplus(.)
    use_full_rank_gate: bool = True  # K3: g_proj D->P; Kimi Linear: g_b_proj(g_a_proj(x)), rank head_dim
    kda_chunk_size: int = 64
    # ---- MLA ----------------------------------------------------------------------------------
    num_attention_heads: int = 4
    q_lora_rank: int | None = 32  # None: a plain q_proj (Kimi Linear)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    mla_norm_eps: float = 1e-6
    # ---- FFN / MoE ----------------------------------------------------------------------------
    intermediate_size: int = 192  # dense layers
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 1
    moe_intermediate_size: int = 32
    routed_expert_hidden_size: int | None = 32  # the latent width L; None -> experts act on D (no latent)
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    # ---- activation ---------------------------------------------------------------------------
    hidden_act: str = "situ"  # "situ" (K3) or "silu" (Kimi Linear)
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # ---- Attention Residuals ------------------------------------------------------------------
    attn_res_block_size: int | None = 2  # layers per block; None -> plain residual stream
    # ---- MTP ----------------------------------------------------------------------------------
    num_nextn_predict_layers: int = 0
    # ---- training-side defaults (not part of the released architecture) -----------------------
    init_std: float = 0.02
    seq_length: int = 128
    name: str = field(default="custom", compare=False)

    # ---------------------------------------------------------------------------------------------
    def __post_init__(self):
        if self.kda_layers is None:
            self.kda_layers = k3_kda_layers(self.num_hidden_layers)
        else:
            self.kda_layers = sorted(int(n) for n in self.kda_layers)

    # derived -------------------------------------------------------------------------------------
    @property
    def full_attn_layers(self) -> list[int]:
        kda = set(self.kda_layers)
        return [n for n in range(1, self.num_hidden_layers + 1) if n not in kda]

    def is_kda_layer(self, i: int) -> bool:
        """0-indexed layer i is KDA iff (i + 1) is in kda_layers."""
        return (i + 1) in self.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_width(self) -> int:
        """Width the routed experts act on: the latent L with LatentMoE, else the hidden size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def layer_kinds(self) -> list[str]:
        return ["kda" if self.is_kda_layer(i) else "mla" for i in range(self.num_hidden_layers)]

    # validation ----------------------------------------------------------------------------------
    def validate(self) -> "K3Config":
        """Raise ConfigError with one clear sentence for the first problem found."""

        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(f"config '{self.name}': {msg}")

        L = self.num_hidden_layers
        for f in ("hidden_size", "num_hidden_layers", "vocab_size", "kda_num_heads", "kda_head_dim",
                  "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                  "intermediate_size", "short_conv_kernel_size", "kda_chunk_size", "seq_length"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{f} must be a positive integer (got {v!r})")
        need(self.qk_rope_head_dim >= 0, f"qk_rope_head_dim must be >= 0 (got {self.qk_rope_head_dim})")
        need(self.rms_norm_eps > 0 and self.mla_norm_eps > 0, "norm eps values must be > 0")
        need(all(1 <= n <= L for n in self.kda_layers),
             f"kda_layers must be 1-indexed layer numbers in [1, {L}] (got {self.kda_layers})")
        need(len(set(self.kda_layers)) == len(self.kda_layers), "kda_layers has duplicates")
        need(self.mla_use_nope, "mla_use_nope=False (RoPE in MLA) is not supported: K3 and Kimi Linear use NoPE MLA")
        if self.q_lora_rank is not None:
            need(self.q_lora_rank > 0, f"q_lora_rank must be positive or null (got {self.q_lora_rank})")
        if self.gate_lower_bound is not None:
            need(-5.0 <= self.gate_lower_bound < 0.0,
                 f"gate_lower_bound must lie in [-5, 0) (fla's safe gate; got {self.gate_lower_bound})")
        need(self.hidden_act in ("situ", "silu"), f"hidden_act must be 'situ' or 'silu' (got {self.hidden_act!r})")
        if self.hidden_act == "situ":
            need(self.activation_situ_beta > 0 and self.activation_situ_linear_beta > 0, "SiTU betas must be > 0")
        need(self.moe_router_activation_func == "sigmoid",
             f"moe_router_activation_func must be 'sigmoid' (got {self.moe_router_activation_func!r})")
        need(0 <= self.first_k_dense_replace <= L,
             f"first_k_dense_replace must be in [0, {L}] (got {self.first_k_dense_replace})")
        need(self.moe_layer_freq >= 1, f"moe_layer_freq must be >= 1 (got {self.moe_layer_freq})")
        need(self.num_experts >= 0, f"num_experts must be >= 0 (got {self.num_experts})")
        if self.num_experts > 0:
            need(1 <= self.num_experts_per_token <= self.num_experts,
                 f"num_experts_per_token ({self.num_experts_per_token}) must be in [1, num_experts={self.num_experts}]")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be positive")
            need(self.num_shared_experts >= 0, "num_shared_experts must be >= 0")
            if self.routed_expert_hidden_size is not None:
                need(0 < self.routed_expert_hidden_size,
                     f"routed_expert_hidden_size must be positive or null (got {self.routed_expert_hidden_size})")
            need(self.routed_scaling_factor > 0, "routed_scaling_factor must be > 0")
        if self.attn_res_block_size is not None:
            need(isinstance(self.attn_res_block_size, int) and self.attn_res_block_size >= 1,
                 f"attn_res_block_size must be a positive number of layers or null (got {self.attn_res_block_size})")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers must be >= 0")
        for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, tok)
            need(v is None or 0 <= v < self.vocab_size, f"{tok}={v} is outside the vocabulary [0, {self.vocab_size})")
        need(self.init_std > 0, "init_std must be > 0")
        need(not self.tie_word_embeddings, "tie_word_embeddings=True is not supported (K3 unties embeddings and lm_head)")
        return self

    # (de)serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str | None = None) -> "K3Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        cfg = cls(**d)
        if name:
            cfg.name = name
        return cfg

    def replace(self, **overrides) -> "K3Config":
        d = self.to_dict()
        d.update(overrides)
        if "num_hidden_layers" in overrides and "kda_layers" not in overrides:
            d["kda_layers"] = None  # re-derive from the layer rule
        return K3Config.from_dict(d)


# ------------------------------------------------------------------------------------------------
# Presets
# ------------------------------------------------------------------------------------------------
def _k3_tiny() -> K3Config:
    return K3Config(
        name="k3-tiny", hidden_size=64, num_hidden_layers=8, vocab_size=512,
        kda_num_heads=4, kda_head_dim=16,
        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, intermediate_size=192,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
        routed_expert_hidden_size=32, attn_res_block_size=2, seq_length=128, kda_chunk_size=16,
    )


def _k3_mini() -> K3Config:
    # The ~1.26B benchmark model (field report's 1.27B model, K3's layer rule at 24 layers).
    return K3Config(
        name="k3-mini", hidden_size=1024, num_hidden_layers=24, vocab_size=163840,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
        kda_num_heads=8, kda_head_dim=128,
        num_attention_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, intermediate_size=4864,
        num_experts=40, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=512,
        routed_expert_hidden_size=512, attn_res_block_size=6, seq_length=4096,
    )


def _k3_full() -> K3Config:
    return K3Config(
        name="k3-full", hidden_size=7168, num_hidden_layers=93, vocab_size=163840,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, rms_norm_eps=1e-5,
        kda_num_heads=96, kda_head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
        use_full_rank_gate=True,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True,
        intermediate_size=33792, first_k_dense_replace=1, moe_layer_freq=1,
        num_experts=896, num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
        routed_expert_hidden_size=3584, latent_moe_use_norm=True, routed_scaling_factor=1.0, moe_renormalize=True,
        hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        attn_res_block_size=12, num_nextn_predict_layers=0, seq_length=4096,
    )


def _kimi_linear_48b() -> K3Config:
    # Kimi Linear 48B-A3B: 27 layers, MLA at 4, 8, ..., 24 and 27.
    return K3Config(
        name="kimi-linear-48b", hidden_size=2304, num_hidden_layers=27, vocab_size=163840,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
        kda_layers=[n for n in range(1, 28) if n % 4 != 0 and n != 27],
        kda_num_heads=32, kda_head_dim=128, gate_lower_bound=None, use_full_rank_gate=False,
        num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_output_gate=False,
        intermediate_size=9216, first_k_dense_replace=1,
        num_experts=256, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=1024,
        routed_expert_hidden_size=None, latent_moe_use_norm=False, routed_scaling_factor=2.446,
        hidden_act="silu", attn_res_block_size=None, seq_length=4096,
    )


PRESETS = {
    "k3-tiny": _k3_tiny,
    "k3-mini": _k3_mini,
    "k3-full": _k3_full,
    "kimi-linear-48b": _kimi_linear_48b,
}


def get_preset(name: str, **overrides) -> K3Config:
    """A validated preset, optionally with field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}' (choose from: {', '.join(PRESETS)})")
    cfg = PRESETS[name]()
    if overrides:
        cfg = cfg.replace(**overrides)
        cfg.name = name + "+overrides"
    return cfg.validate()


def load_config(path: str | Path) -> K3Config:
    """Load a model config file (.yaml/.yml/.json/.toml). ``preset: NAME`` picks a base; other keys override it.

    A training config may keep the model fields under a ``model:`` section; that section is used if present.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            raise ConfigError(f"{path}: unsupported config format '{path.suffix}' (use .yaml, .json or .toml)")
    except ConfigError:
        raise
    except Exception as e:  # parse errors -> one line
        raise ConfigError(f"{path}: cannot parse: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    if isinstance(data.get("model"), dict):
        data = data["model"]
    data = dict(data)
    preset = data.pop("preset", None)
    if preset is not None:
        cfg = get_preset(preset, **data) if data else get_preset(preset)
        cfg.name = f"{path.name}({preset})"
        return cfg.validate()
    return K3Config.from_dict(data, name=path.name).validate()
