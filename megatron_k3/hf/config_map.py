"""K3Config <-> HF ``config.json``, for the two directory layouts the exporter writes.

* **K3 release layout** (``layout="k3"``): a wrapper ``config.json`` with ``model_type: kimi_k3``,
  ``architectures: [KimiK3ForConditionalGeneration]``, an ``auto_map`` to the remote code shipped in the
  directory and the language model under ``text_config`` (``model_type: kimi_linear``) with the release's
  K3 fields: ``linear_attn_config`` (``kda_layers``, ``full_attn_layers``, ``num_heads``, ``head_dim``,
  ``short_conv_kernel_size``, ``gate_lower_bound``, ``use_full_rank_gate``), ``mla_use_nope``,
  ``mla_use_output_gate``, ``routed_expert_hidden_size``, ``latent_moe_use_norm``, ``hidden_act: situ``
  with ``activation_situ_beta`` / ``activation_situ_linear_beta``, ``attn_res_block_size``, router fields
  (``moe_router_activation_func``, ``topk_method: noaux_tc``, one expert group), ...
* **Kimi Linear layout** (``layout="kimi_linear"``): the flat ``config.json`` of Kimi-Linear-48B-A3B
  (``model_type: kimi_linear``, ``architectures: [KimiLinearForCausalLM]``, no ``auto_map``), which
  transformers >= 5 loads with its native classes. Only configs that Kimi Linear can express qualify
  (:func:`native_kimi_linear_problems`).

Fields that only this project uses (``mla_norm_eps``, ``kda_chunk_size``, ``seq_length``) travel in the
text config too, so an import gives back exactly the exported ``K3Config``. ``init_std`` is HF's
``initializer_range``.

This module is also copied verbatim into every exported K3 directory (as ``k3_hf_config.py``, with its one
relative import rewritten) so the remote code reads the config with the same function.
"""
from __future__ import annotations

from ..config import K3Config

K3_WRAPPER_TYPE = "kimi_k3"
K3_ARCH = "KimiK3ForConditionalGeneration"
K3_AUTO_MAP = {
    "AutoConfig": "configuration_k3.KimiK3Config",
    "AutoModel": "modeling_k3.KimiK3ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_k3.KimiK3ForConditionalGeneration",
}
LAYOUTS = ("k3", "kimi_linear")

# K3Config fields copied under the same name into the HF text config
_SAME = ("vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings",
         "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
         "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
         "v_head_dim", "mla_use_nope", "mla_use_output_gate",
         "intermediate_size", "first_k_dense_replace", "moe_layer_freq",
         "num_experts", "num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
         "routed_expert_hidden_size", "latent_moe_use_norm", "routed_scaling_factor", "moe_renormalize",
         "moe_router_activation_func", "hidden_act", "activation_situ_beta", "activation_situ_linear_beta",
         "attn_res_block_size", "num_nextn_predict_layers",
         # project fields (not in the release; harmless extra keys for other readers)
         "mla_norm_eps", "kda_chunk_size", "seq_length")


def text_config(cfg: K3Config) -> dict:
    """The HF ``text_config`` (``model_type: kimi_linear``) of a K3 config, K3 fields included."""
    d = {"model_type": "kimi_linear"}
    for k in _SAME:
        d[k] = getattr(cfg, k)
    d["num_key_value_heads"] = cfg.num_attention_heads
    d["initializer_range"] = cfg.init_std
    d["topk_method"] = "noaux_tc"
    d["use_grouped_topk"] = True
    d["num_expert_group"] = 1
    d["topk_group"] = 1
    d["linear_attn_config"] = {
        "kda_layers": list(cfg.kda_layers),
        "full_attn_layers": list(cfg.full_attn_layers),
        "num_heads": cfg.kda_num_heads,
        "head_dim": cfg.kda_head_dim,
        "short_conv_kernel_size": cfg.short_conv_kernel_size,
        "gate_lower_bound": cfg.gate_lower_bound,
        "use_full_rank_gate": cfg.use_full_rank_gate,
    }
    return d


def k3_config_json(cfg: K3Config, dtype: str = "float32") -> dict:
    """The wrapper ``config.json`` of the K3 release layout (remote code in the same directory)."""
    tc = text_config(cfg)
    tc["dtype"] = dtype
    return {
        "model_type": K3_WRAPPER_TYPE,
        "architectures": [K3_ARCH],
        "auto_map": dict(K3_AUTO_MAP),
        "text_config": tc,
        "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": dtype,
    }


def native_kimi_linear_problems(cfg: K3Config) -> list[str]:
    """Why transformers' native Kimi Linear classes cannot represent ``cfg`` (empty list: they can)."""
    out = []
    if cfg.hidden_act != "silu":
        out.append(f"hidden_act={cfg.hidden_act!r} (Kimi Linear: 'silu')")
    if cfg.gate_lower_bound is not None:
        out.append(f"gate_lower_bound={cfg.gate_lower_bound} (Kimi Linear: unbounded gate, null)")
    if cfg.use_full_rank_gate:
        out.append("use_full_rank_gate=True (Kimi Linear: low-rank output gate g_a_proj/g_b_proj)")
    if cfg.attn_res_block_size is not None:
        out.append(f"attn_res_block_size={cfg.attn_res_block_size} (Kimi Linear: no Attention Residuals)")
    if cfg.num_experts > 0 and cfg.routed_expert_hidden_size is not None:
        out.append(f"routed_expert_hidden_size={cfg.routed_expert_hidden_size} (Kimi Linear: no latent MoE)")
    if cfg.mla_use_output_gate:
        out.append("mla_use_output_gate=True (Kimi Linear: no MLA output gate)")
    if cfg.moe_layer_freq != 1:
        out.append(f"moe_layer_freq={cfg.moe_layer_freq} (transformers' Kimi Linear: every layer after the dense ones)")
    if cfg.num_experts == 0:
        out.append("num_experts=0 (transformers' Kimi Linear always builds MoE layers after first_k_dense_replace)")
    elif cfg.num_experts < 2:
        out.append("num_experts < 2 (the native router takes a top-2 per expert group)")
    if cfg.num_nextn_predict_layers:
        out.append("num_nextn_predict_layers > 0 (no MTP in transformers' Kimi Linear)")
    if abs(cfg.mla_norm_eps - 1e-6) > 0:
        out.append(f"mla_norm_eps={cfg.mla_norm_eps} (transformers' Kimi Linear: 1e-6)")
    return out


def kimi_linear_config_json(cfg: K3Config, dtype: str = "float32") -> dict:
    """Flat Kimi-Linear-48B-style ``config.json`` (native ``transformers`` ``kimi_linear``, no remote code)."""
    d = text_config(cfg)
    d.pop("mla_use_output_gate")
    d["linear_attn_config"].pop("gate_lower_bound")
    d["linear_attn_config"].pop("use_full_rank_gate")
    d.update({"architectures": ["KimiLinearForCausalLM"], "dtype": dtype, "use_cache": True,
              "use_grouped_topk": True, "n_group": 1, "topk_group": 1, "num_expert_group": 1})
    return d


_KIMI_LINEAR_DEFAULTS = {"mla_use_output_gate": False, "attn_res_block_size": None, "routed_expert_hidden_size": None,
                         "latent_moe_use_norm": False}


def _native_k3_fields(d: dict) -> dict:
    """K3Config fields from a flat Kimi Linear (or K3 text) config dict."""
    lac = d.get("linear_attn_config") or {}
    out = {}
    for k in _SAME:
        if k in d:
            out[k] = d[k]
    # transformers' native names (if a config was re-saved by transformers)
    for native, ours in (("num_local_experts", "num_experts"), ("num_experts_per_tok", "num_experts_per_token"),
                         ("n_shared_experts", "num_shared_experts"), ("norm_topk_prob", "moe_renormalize"),
                         ("model_max_length", "max_position_embeddings")):
        if native in d and ours not in d:
            out[ours] = d[native]
    if "initializer_range" in d:
        out["init_std"] = d["initializer_range"]
    if "kda_layers" in lac:
        out["kda_layers"] = list(lac["kda_layers"])
    elif d.get("layer_types"):
        out["kda_layers"] = [i + 1 for i, t in enumerate(d["layer_types"]) if t == "linear_attention"]
    for src, dst in (("num_heads", "kda_num_heads"), ("head_dim", "kda_head_dim"),
                     ("short_conv_kernel_size", "short_conv_kernel_size")):
        if src in lac:
            out[dst] = lac[src]
    for src, dst in (("linear_num_heads", "kda_num_heads"), ("linear_head_dim", "kda_head_dim"),
                     ("linear_conv_kernel_dim", "short_conv_kernel_size")):
        if src in d and dst not in out:
            out[dst] = d[src]
    if "gate_lower_bound" in lac or "use_full_rank_gate" in lac:  # K3
        out["gate_lower_bound"] = lac.get("gate_lower_bound")
        out["use_full_rank_gate"] = bool(lac.get("use_full_rank_gate", True))
    else:  # Kimi Linear: unbounded gate, low-rank output gate, SiLU
        out["gate_lower_bound"] = None
        out["use_full_rank_gate"] = False
        out.setdefault("hidden_act", "silu")
    for k, v in _KIMI_LINEAR_DEFAULTS.items():  # what K3 added, absent from a Kimi Linear config
        out.setdefault(k, v)
    if isinstance(out.get("eos_token_id"), list):
        out["eos_token_id"] = out["eos_token_id"][0]
    return out


def config_from_hf_dict(d: dict, name: str = "hf") -> K3Config:
    """K3Config from a ``config.json`` dict: the K3 wrapper (``text_config``) or a flat Kimi Linear config."""
    if "text_config" in d and isinstance(d["text_config"], dict):
        d = d["text_config"]
    cfg = K3Config(**_native_k3_fields(d))
    cfg.name = name
    return cfg.validate()


def a_log_padded_len(num_heads: int) -> int:
    """Length of ``A_log`` in the K3 release layout: zero-padded to a multiple of 128 (96 heads -> 128)."""
    return -(-num_heads // 128) * 128
