"""Parameter accounting for a config, by instantiating the golden model on the meta device.

Counts come from the model's real parameters (not from a formula), classified by their official names.
"active" = parameters touched per token, without the input embedding table (a lookup, not a matmul):
everything except the routed experts, plus ``top_k`` experts' worth per MoE layer. The MTP head is
reported separately (training-only; the released K3 has none).
"""
from __future__ import annotations

import torch

from ..config import K3Config

COMPONENTS = ("embed_tokens", "lm_head", "kda", "mla", "attn_res", "norms", "dense_mlp", "router",
              "latent_proj", "shared_experts", "routed_experts", "mtp")


def classify(name: str, kda_layers: set[int]) -> str:
    if name.startswith("model.mtp."):
        return "mtp"
    if name.startswith("model.embed_tokens"):
        return "embed_tokens"
    if name.startswith("lm_head"):
        return "lm_head"
    if "_res_norm" in name or "_res_proj" in name:
        return "attn_res"
    if ".self_attn." in name:
        layer = int(name.split(".")[2])
        return "kda" if layer in kda_layers else "mla"
    if ".mlp." in name:
        return "dense_mlp"
    if ".block_sparse_moe.gate." in name:
        return "router"
    if ".block_sparse_moe.experts." in name:
        return "routed_experts"
    if ".block_sparse_moe.shared_experts." in name:
        return "shared_experts"
    if ".block_sparse_moe.routed_expert_" in name:
        return "latent_proj"
    return "norms"


def model_info(cfg: K3Config) -> dict:
    from ..model import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(cfg, init=False)
    kda = {i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i)}
    comp = dict.fromkeys(COMPONENTS, 0)
    for name, p in model.named_parameters():
        comp[classify(name, kda)] += p.numel()
    n_moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    per_expert = 0
    if n_moe:
        layer = next(l for l in model.model.layers if l.is_moe)
        per_expert = sum(p.numel() for p in layer.block_sparse_moe.experts[0].parameters())
    routed_active = n_moe * cfg.num_experts_per_token * per_expert
    total = sum(comp.values())
    trunk = total - comp["mtp"]
    active = trunk - comp["embed_tokens"] - comp["routed_experts"] + routed_active
    return {
        "preset": cfg.name,
        "total_params": total,
        "total_params_without_mtp": trunk,
        "active_params": active,
        "active_params_definition": "per token, without the input embedding table and without the MTP head",
        "routed_expert_params_total": comp["routed_experts"],
        "routed_expert_active_params": routed_active,
        "mtp_params": comp["mtp"],
        "components": comp,
        "layers": {
            "total": cfg.num_hidden_layers,
            "kda": len(kda),
            "mla": cfg.num_hidden_layers - len(kda),
            "dense_ffn": cfg.num_hidden_layers - n_moe,
            "moe": n_moe,
            "kda_layers_1_indexed": cfg.kda_layers,
            "full_attn_layers_1_indexed": cfg.full_attn_layers,
        },
        "experts": {"routed": cfg.num_experts, "top_k": cfg.num_experts_per_token, "shared": cfg.num_shared_experts,
                    "params_per_routed_expert": per_expert},
    }


def format_info(info: dict) -> str:
    def h(n):
        for unit, s in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if abs(n) >= s:
                return f"{n / s:.3f}{unit}"
        return str(n)

    lines = [f"{info['preset']}",
             f"  total parameters            {info['total_params']:>18,d}  ({h(info['total_params'])})",
             f"  active per token (no embed) {info['active_params']:>18,d}  ({h(info['active_params'])})",
             f"  routed experts, active      {info['routed_expert_active_params']:>18,d}  "
             f"({h(info['routed_expert_active_params'])})",
             f"  routed experts, total       {info['routed_expert_params_total']:>18,d}  "
             f"({h(info['routed_expert_params_total'])})"]
    L = info["layers"]
    lines.append(f"  layers: {L['total']} ({L['kda']} KDA + {L['mla']} MLA; {L['dense_ffn']} dense FFN + {L['moe']} MoE)")
    lines.append("  per component:")
    for k, v in info["components"].items():
        lines.append(f"    {k:<16s}{v:>18,d}  ({h(v)})")
    return "\n".join(lines)
