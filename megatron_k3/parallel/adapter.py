"""The one weight adapter between the official HF names (the golden model's ``state_dict``) and the
megatron model's local shards, for any TP/PP/EP/CP/DP layout.

Every local tensor of a megatron stage is described by *pieces*: ``(hf_name, hf_index, local_index)``
meaning ``local[local_index] == hf[hf_name][hf_index]``. Loading copies HF slices into the shards;
gathering writes the shards back into full HF-shaped tensors (used to compare gradients with the golden
model, and by HF export). Rules:

- TP-sharded tensors (``tensor_model_parallel``) are contiguous slices along ``partition_dim`` (whole heads
  or FFN columns; embeddings/lm_head by vocabulary rows);
- megatron's MoE internals: ``router.weight`` <-> ``gate.weight``, ``router.expert_bias`` <->
  ``gate.e_score_correction_bias``, ``experts.local_experts.{j}.linear_fc1`` <-> ``[experts.{e}.w1; w3]`` and
  ``linear_fc2`` <-> ``experts.{e}.w2`` with ``e = ep_rank * local_experts + j``;
- model-level names get the ``model.`` prefix (``lm_head`` does not); ``mtp_heads.{k}`` <-> ``model.mtp.{k}``.

Exported HF directories (``tools/convert_to_hf.py`` / ``convert_from_hf.py``) add one more naming step on
top of these HF names, kept in ``megatron_k3/hf/names.py`` and reached through :func:`release_name_shape`
and :func:`release_import_plan`: the K3 release layout (``language_model.`` prefix, ``A_log`` zero-padded to
a multiple of 128, MXFP4 experts on import) and the Kimi Linear layout of transformers' native classes.
"""
from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


def _hf_name(name: str) -> str:
    name = name.replace(".block_sparse_moe.router.expert_bias", ".block_sparse_moe.gate.e_score_correction_bias")
    name = name.replace(".block_sparse_moe.router.weight", ".block_sparse_moe.gate.weight")
    if name.startswith("lm_head."):
        return name
    if name.startswith("mtp_heads."):
        return "model.mtp." + name[len("mtp_heads."):]
    return "model." + name


def _tp_index(t: torch.Tensor, full_shape, dim: int, rank: int):
    n = t.shape[dim]
    idx = [slice(None)] * len(full_shape)
    idx[dim] = slice(rank * n, (rank + 1) * n)
    return tuple(idx)


def pieces(chunk, name: str, tensor: torch.Tensor, tp_rank: int, hf_shapes: dict):
    """List of (hf_name, hf_index, local_index) covering ``tensor`` (a parameter or buffer of ``chunk``)."""
    full = (slice(None),) * tensor.ndim
    m = _EXPERT.match(name)
    if m:
        prefix, j, fc = m.group(1), int(m.group(2)), m.group(3)
        moe = chunk.get_submodule(prefix + ".block_sparse_moe")
        e = moe.local_expert_indices[j]
        base = f"{_hf_name(prefix)}.block_sparse_moe.experts.{e}"
        if fc == "1":
            F_ = tensor.shape[0] // 2
            return [(f"{base}.w1.weight", (slice(None), slice(None)), (slice(0, F_), slice(None))),
                    (f"{base}.w3.weight", (slice(None), slice(None)), (slice(F_, 2 * F_), slice(None)))]
        return [(f"{base}.w2.weight", full, full)]
    hf = _hf_name(name)
    if getattr(tensor, "tensor_model_parallel", False):
        return [(hf, _tp_index(tensor, hf_shapes[hf], tensor.partition_dim, tp_rank), full)]
    return [(hf, full, full)]


def _named_tensors(chunk):
    """Parameters and persistent buffers of a stage, by name."""
    out = dict(chunk.named_parameters())
    for n, b in chunk.named_buffers():
        if n.endswith("expert_bias"):
            out[n] = b
    return out


def load_hf_state_dict(chunk, sd: dict, tp_rank: int):
    """Copy the matching slices of an HF-named full state dict into this stage's shards."""
    shapes = {k: v.shape for k, v in sd.items()}
    with torch.no_grad():
        for name, t in _named_tensors(chunk).items():
            for hf, hidx, lidx in pieces(chunk, name, t, tp_rank, shapes):
                if hf not in sd:
                    raise KeyError(f"state dict has no '{hf}' (needed by megatron parameter '{name}')")
                t[lidx].copy_(sd[hf][hidx].to(t.dtype))


def local_pieces(chunk, tp_rank: int, hf_shapes: dict, grads: bool = False):
    """[(hf_name, hf_index, tensor_slice)] for every local parameter (its main_grad/grad when ``grads``)."""
    out = []
    for name, t in _named_tensors(chunk).items():
        src = t
        if grads:
            if not isinstance(t, torch.nn.Parameter):
                continue
            src = getattr(t, "main_grad", None)
            src = src if src is not None else t.grad
            if src is None:
                continue
        for hf, hidx, lidx in pieces(chunk, name, t, tp_rank, hf_shapes):
            out.append((hf, hidx, src[lidx].detach().float().cpu().clone()))
    return out


def assemble(all_pieces, hf_shapes: dict):
    """Full HF-shaped tensors from the pieces of all ranks, plus a coverage mask per tensor."""
    full, covered = {}, {}
    for hf, hidx, val in all_pieces:
        if hf not in full:
            full[hf] = torch.zeros(hf_shapes[hf])
            covered[hf] = torch.zeros(hf_shapes[hf], dtype=torch.bool)
        full[hf][hidx] = val
        covered[hf][hidx] = True
    return full, covered


# ---- exported HF directories (megatron_k3/hf/names.py) -------------------------------------------------
def release_name_shape(hf_name: str, shape, cfg, layout: str = "k3"):
    """(name, shape) of an HF-named tensor in an exported directory: ``layout`` "k3" (the K3 release) or
    "kimi_linear" (transformers' native Kimi Linear)."""
    from ..hf.names import export_name_shape

    return export_name_shape(hf_name, shape, cfg, layout)


def release_import_plan(source_names, cfg):
    """How each HF name is rebuilt from an exported/released directory's tensors (``names.ImportPlan``)."""
    from ..hf.names import ImportPlan

    return ImportPlan(source_names, cfg)
