"""Official HF tensor names and shapes of the two exported layouts, and their inverse (import).

The golden model's ``state_dict`` names (``model.layers.{i}...``, ``lm_head.weight``) are the project's HF
names; the megatron adapter (``megatron_k3/parallel/adapter.py``) maps them to shards. This module adds
what the *released directories* do on top of them:

* **K3 release layout** (``layout="k3"``): every text tensor under ``language_model.``; KDA ``A_log``
  1-D and zero-padded to a multiple of 128 entries (the release: 96 heads -> 128); nothing else changes.
* **Kimi Linear layout** (``layout="kimi_linear"``): the Kimi-Linear-48B checkpoint names (no prefix);
  ``A_log`` has shape ``[1, 1, H, 1]``.

Import also accepts (``from_release``):

* MXFP4-packed weights: ``X.weight_packed`` (uint8/int8, two E2M1 values per byte, low nibble first) +
  ``X.weight_scale`` (one E8M0 exponent per 32 values along the last axis, bias 127; or float scales)
  -> ``X.weight`` dequantised (the released K3 routed experts);
* the names transformers' native Kimi Linear classes use in memory (``self_attn.conv1d.weight`` holding
  q/k/v convs stacked, ``self_attn.forget_gate.*``, ``mlp.experts.gate_up_proj`` / ``down_proj`` merged
  over experts, ``mlp.*`` for the MoE block), in case a directory was written from those classes;
* tensors outside ``language_model.`` in a K3 wrapper (``vision_tower.*``, ``mm_projector.*``) are skipped.
"""
from __future__ import annotations

import re

import torch

from .config_map import a_log_padded_len

K3_PREFIX = "language_model."
FP32_SUFFIXES = (".A_log", ".dt_bias", "_conv1d.weight", ".o_norm.weight", ".e_score_correction_bias")
SKIP_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")

# ----------------------------------------------------------------------------------------------------
# export


def keeps_fp32(name: str) -> bool:
    """Tensors stored in fp32 whatever the export dtype (KDA gate/conv/o_norm, the router bias)."""
    return name.endswith(FP32_SUFFIXES)


def export_name_shape(name: str, shape, cfg, layout: str):
    """(release name, release shape) of a golden tensor."""
    shape = tuple(shape)
    if name.endswith(".self_attn.A_log"):
        shape = (a_log_padded_len(cfg.kda_num_heads),) if layout == "k3" else (1, 1, cfg.kda_num_heads, 1)
    return (K3_PREFIX + name if layout == "k3" else name), shape


def export_tensor(name: str, t: torch.Tensor, cfg, layout: str):
    """(release name, tensor) of a golden tensor."""
    out_name, shape = export_name_shape(name, t.shape, cfg, layout)
    if name.endswith(".self_attn.A_log"):
        if layout == "k3":
            t = torch.cat([t.reshape(-1), t.new_zeros(shape[0] - t.numel())])
        else:
            t = t.reshape(shape)
    return out_name, t


# ----------------------------------------------------------------------------------------------------
# MXFP4 (E2M1 values, E8M0 scales, groups of 32 along the last axis)
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """[..., C/2] packed bytes + [..., C/G] scales -> [..., C] values (G = C / scale columns, 32 in MXFP4)."""
    u8 = packed.contiguous().view(torch.uint8)
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    vals = torch.stack([table[(u8 & 0xF).long()], table[(u8 >> 4).long()]], dim=-1)
    vals = vals.reshape(*u8.shape[:-1], u8.shape[-1] * 2)
    cols, groups = vals.shape[-1], scale.shape[-1]
    if cols % groups:
        raise ValueError(f"MXFP4: {cols} values per row do not split into {groups} scale groups")
    if scale.dtype == torch.uint8:
        s = torch.ldexp(torch.ones(scale.shape, dtype=torch.float32), scale.to(torch.int32) - 127)
    else:
        s = scale.to(torch.float32)
    vals = vals.reshape(*vals.shape[:-1], groups, cols // groups) * s.unsqueeze(-1)
    return vals.reshape(*vals.shape[:-2], cols).to(dtype)


def quantize_mxfp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 of ``w`` [..., C] -> (packed uint8 [..., C/2], E8M0 scales uint8 [..., C/group]).
    (Test fixture and the format's definition; the exporter writes full precision.)"""
    C = w.shape[-1]
    g = w.float().reshape(*w.shape[:-1], C // group, group)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -126)
    e = torch.floor(torch.log2(amax)) - 2  # 6 = 1.5 * 2^2 is the largest E2M1 value
    x = g / torch.exp2(e)
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    idx = (x.unsqueeze(-1) - table).abs().argmin(-1).reshape(*w.shape[:-1], C)
    packed = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
    return packed, (e.squeeze(-1) + 127).to(torch.uint8)


# ----------------------------------------------------------------------------------------------------
# import
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


class ImportPlan:
    """How to build every golden tensor from the tensors of a release directory.

    ``plan[golden_name] = (source_keys, fn)`` with ``fn({key: tensor}) -> tensor``; ``skipped`` lists the
    source keys that belong to no golden tensor (other modalities)."""

    def __init__(self, source_keys, cfg):
        self.cfg = cfg
        self.plan: dict = {}
        self.skipped: list[str] = []
        keys = set(source_keys)
        prefixed = any(k.startswith(K3_PREFIX) for k in keys)
        for key in sorted(keys):
            if key.endswith("_scale") and key[:-len("_scale")] + "_packed" in keys:
                continue  # consumed with its packed partner
            if prefixed:
                if not key.startswith(K3_PREFIX):
                    self.skipped.append(key)
                    continue
                name = key[len(K3_PREFIX):]
            else:
                if key.startswith(SKIP_PREFIXES):
                    self.skipped.append(key)
                    continue
                name = key
            self._add(key, name, keys)

    # ---------------------------------------------------------------------------------------------
    def _add(self, key, name, keys):
        cfg = self.cfg
        if name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            skey = key[: -len("_packed")] + "_scale"
            if skey not in keys:
                raise ValueError(f"{key}: MXFP4 packed weight without its scale {skey}")
            self._put(base, [key, skey], lambda d, k=key, s=skey: dequantize_mxfp4(d[k], d[s]))
            return
        if name.endswith((".self_attn.A_log", ".self_attn.forget_gate.A_log")):
            gname = name.replace(".forget_gate.", ".")
            H = cfg.kda_num_heads

            def a_log(d, k=key, n=gname):
                t = d[k].reshape(-1)
                if t.numel() < H:
                    raise ValueError(f"{k}: {t.numel()} entries for {H} KDA heads")
                if t.numel() > H and torch.count_nonzero(t[H:]):
                    raise ValueError(f"{k}: the padding past the {H} heads is not zero")
                return t[:H].clone()

            self._put(gname, [key], a_log)
            return
        m = _LAYER.match(name)
        if m:  # transformers-native in-memory names
            i, rest = int(m.group(1)), m.group(2)
            pre = f"model.layers.{i}."
            if rest == "self_attn.conv1d.weight":
                P = cfg.kda_proj_dim
                for j, qkv in enumerate("qkv"):
                    self._put(pre + f"self_attn.{qkv}_conv1d.weight", [key],
                              lambda d, k=key, j=j: d[k][j * P:(j + 1) * P].clone())
                return
            if rest.startswith("self_attn.forget_gate."):
                self._put(pre + "self_attn." + rest[len("self_attn.forget_gate."):], [key], _same(key))
                return
            if rest.startswith("block_sparse_moe.") and not cfg.is_moe_layer(i):
                # transformers' save_pretrained reverses its ".block_sparse_moe." -> ".mlp." rename blindly,
                # dense layers included
                self._put(pre + "mlp." + rest[len("block_sparse_moe."):], [key], _same(key))
                return
            if rest.startswith("mlp.") and cfg.is_moe_layer(i):
                sub = rest[len("mlp."):]
                if sub == "experts.gate_up_proj":
                    I_ = cfg.moe_intermediate_size
                    for e in range(cfg.num_experts):
                        self._put(pre + f"block_sparse_moe.experts.{e}.w1.weight", [key],
                                  lambda d, k=key, e=e: d[k][e, :I_].clone())
                        self._put(pre + f"block_sparse_moe.experts.{e}.w3.weight", [key],
                                  lambda d, k=key, e=e: d[k][e, I_:].clone())
                    return
                if sub == "experts.down_proj":
                    for e in range(cfg.num_experts):
                        self._put(pre + f"block_sparse_moe.experts.{e}.w2.weight", [key],
                                  lambda d, k=key, e=e: d[k][e].clone())
                    return
                self._put(pre + "block_sparse_moe." + sub, [key], _same(key))
                return
        self._put(name, [key], _same(key))

    def _put(self, gname, keys, fn):
        if gname in self.plan:
            raise ValueError(f"two source tensors map to {gname}: {self.plan[gname][0]} and {keys}")
        self.plan[gname] = (keys, fn)


def _same(key):
    return lambda d, k=key: d[k]
