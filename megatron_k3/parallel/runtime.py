"""Process setup, model construction per pipeline stage, DDP/optimizer wrapping and the train step glue.

Used by the trainer (``train.trainer``) and ``parallel.verify``. On a machine without CUDA everything
runs on the CPU with gloo through ``megatron_k3.compat`` (the only module that knows).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import compat
from .layout import ParallelLayout
from ..model.k3 import IGNORE_INDEX
from .collectives import all_reduce
from .routers import moe_routers  # noqa: F401  (re-exported: runtime.moe_routers)


def init_distributed(layout: ParallelLayout, seed: int = 1234) -> torch.device:
    """Join the process group (env:// rendezvous) and build megatron's parallel state for ``layout``."""
    device = compat.setup_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(compat.backend(), timeout=timedelta(minutes=10))
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=1)
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return device


def destroy():
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def stage_ranges(cfg, layout: ParallelLayout) -> list[tuple[int, int, bool, bool, int | None]]:
    """This rank's (virtual) stages: (layer_start, layer_end, pre_process, post_process, vp_stage)."""
    from megatron.core import parallel_state as ps

    bounds = layout.stage_boundaries(cfg.num_hidden_layers)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    out = []
    for v in range(layout.vpp):
        s = v * layout.pp + pp_rank
        out.append((bounds[s], bounds[s + 1], s == 0, s == layout.num_stages - 1, v if layout.vpp > 1 else None))
    return out


def build_model_chunks(cfg, layout: ParallelLayout, params_dtype=torch.float32, device=None, recompute: str = "none",
                       init_seed: int | None = 0, init_workers: int | None = None, torchao_float8: str | None = None,
                       **tconfig_overrides):
    """This rank's model chunks (one per virtual stage), built without the rest of the model
    (``rank_init.py``): parameters on the meta device, then allocated on ``device`` and, with ``init_seed``,
    given the golden initialisation of that seed (``None``: left uninitialised, for a caller that loads
    weights). ``device="meta"`` leaves them on the meta device (``simulate``). ``recompute``: "none",
    "selective" (the token mixers' cores and FFN activations are recomputed in backward) or "full" (whole
    layers). ``init_workers``: threads generating the initial values (``rank_init.init_chunks_``).
    FP8 (``precision.resolve``): megatron's ``fp8`` fields route the projections through Transformer Engine,
    ``torchao_float8`` (a torchao recipe) through torchao's float8 GEMMs."""
    from megatron.core import parallel_state as ps

    from .comm import ParallelCtx
    from .model import K3MegatronModel
    from .rank_init import init_chunks_, materialize_, meta_parameters
    from .tconfig import build_transformer_config

    tconfig = build_transformer_config(cfg, layout, params_dtype, **tconfig_overrides)
    ctx = ParallelCtx.from_parallel_state(layout.sequence_parallel)
    with meta_parameters():
        chunks = [K3MegatronModel(cfg, tconfig, ctx, start, end, pre, post, vp_stage=vp, recompute=recompute)
                  for start, end, pre, post, vp in stage_ranges(cfg, layout)]
    device = torch.device(device or "cpu")
    materialize_(chunks, device, params_dtype)  # on "meta": only the dtypes change (simulate)
    if init_seed is not None and device.type != "meta":
        init_chunks_(chunks, cfg, init_seed, ps.get_tensor_model_parallel_rank(), workers=init_workers)
    if tconfig.fp8:  # FP8: the eligible projections run through Transformer Engine (megatron_k3/parallel/precision.py)
        from .precision import use_te_linears

        for m in chunks:
            use_te_linears(m)
    elif torchao_float8:
        from .precision import use_torchao_linears

        for m in chunks:
            use_torchao_linears(m, torchao_float8)
    return chunks, tconfig


def wrap_ddp(chunks, tconfig, use_distributed_optimizer: bool = False, finalize_grads=None):
    """megatron's DDP around each chunk, ready for megatron's schedules: ``tconfig`` gets the gradient
    finalisation (``finalize_grads``, default ``finalize_k3_grads``; megatron's ``finalize_model_grads`` for a
    model that is not K3) and DDP's ``no_sync`` for the micro-batches before the last."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    ddp = [DistributedDataParallel(tconfig, ddp_config, c, disable_bucketing=(i > 0)) for i, c in enumerate(chunks)]
    if not ddp_config.overlap_grad_reduce:  # DDP's hooks only add .grad to main_grad: the grouped experts
        from .experts import GroupedExperts  # may add their weight gradients to main_grad themselves

        for c in chunks:
            for m in c.modules():
                if isinstance(m, GroupedExperts):
                    for p in m.parameters():
                        p.k3_fuse_wgrad = True
            for p in c.parameters():  # and captured layer graphs add the others' (graphs.main_grad_params)
                p.k3_graph_main_grad = True
    tconfig.finalize_model_grads_func = finalize_grads or finalize_k3_grads
    tconfig.no_sync_func = [d.no_sync for d in ddp] if len(ddp) > 1 else ddp[0].no_sync
    return ddp


def finalize_k3_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's finalize_model_grads plus K3's pieces:

    - before it: the step's expert token counts (accumulated by the routers over every micro-batch) are
      summed over TP x DP x CP and handed to ``config.k3_capture_counts`` (a list) for routing metrics;
    - megatron then applies the aux-loss-free sign update ``b += rate * sign(mean - count)`` from the same
      all-reduced counts; afterwards the bias is re-centred to zero mean (equivalent to zero-centring each
      update: top-k is invariant to a common shift, and a plain sign update drifts in common mode);
    - the sum over TP of the TP-partial parameters' gradients (replicated weights that each rank
      back-propagates through its own heads only)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    routers = moe_routers(model)
    capture = getattr(config, "k3_capture_counts", None)
    if routers and capture is not None:
        counts = torch.stack([r.local_tokens_per_expert.detach().double() for _, r in routers])
        all_reduce(counts, group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
        capture.extend(zip((name for name, _ in routers), counts))  # on the device: read after the step
    finalize_model_grads(model, num_tokens=num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    qb = [r for _, r in routers if getattr(r, "k3_balancing", None) == "quantile"]
    if qb:  # Quantile Balancing: the step's mean shift over micro-batches and TP x DP x CP token shards
        from .balancing import quantile_update

        stats = torch.stack([torch.cat([r.k3_qb_sum, r.k3_qb_count.reshape(1)]) for r in qb])
        all_reduce(stats, group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
        with torch.no_grad():
            for r, st in zip(qb, stats):
                if st[-1] > 0:
                    r.expert_bias.copy_(quantile_update(r.expert_bias, (st[:-1] / st[-1]).to(r.expert_bias.dtype)))
                r.k3_qb_sum.zero_()
                r.k3_qb_count.zero_()
    with torch.no_grad():
        for _, r in routers:
            if r.expert_bias is not None:
                r.expert_bias -= r.expert_bias.mean()
    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    grads = []
    for chunk in model:
        for p in chunk.parameters():
            if getattr(p, "k3_tp_partial", False) and p.requires_grad:
                g = getattr(p, "main_grad", None)
                grads.append(g if g is not None else p.grad)
    if grads:
        flat = torch._utils._flatten_dense_tensors(grads)
        all_reduce(flat, group=ps.get_tensor_model_parallel_group())
        for g, s in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(s)


def build_optimizer(ddp_chunks, lr: float, weight_decay: float = 0.1, clip_grad: float = 1.0,
                    use_distributed_optimizer: bool = False, bf16: bool = False, adam_eps: float = 1e-8,
                    beta1: float = 0.9, beta2: float = 0.95, coalesce: bool = True):
    """megatron's Adam(W) optimizer over ``ddp_chunks`` (fused torch AdamW without TE/apex; with ``coalesce``
    the bf16 parameters and their fp32 masters in flat buffers: ``coalesce_float16_params``)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    oc = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=beta1,
                         adam_beta2=beta2, adam_eps=adam_eps, clip_grad=clip_grad, bf16=bf16,
                         use_distributed_optimizer=use_distributed_optimizer)
    opt = get_megatron_optimizer(oc, ddp_chunks, config_overrides={})
    from ..patches.coalesced_master_copy import coalesce_float16_params
    from ..patches.foreach_kernels import fuse_torch_adamw

    fuse_torch_adamw(opt)  # no TE/apex on CUDA: torch's fused AdamW instead of its foreach loop
    if coalesce:
        coalesce_float16_params(opt)
    return opt


def cp_slice(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """This context-parallel rank's contiguous part of the sequence axis."""
    from megatron.core import parallel_state as ps

    cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    if cp == 1:
        return t
    n = t.shape[dim] // cp
    return t.narrow(dim, r * n, n)


def make_forward_step(mtp_loss_weight: float = 0.1):
    """megatron forward_step: batches are dicts with full-sequence ``tokens``/``labels`` [B, S] (and, with MTP,
    ``mtp_tokens``/``mtp_labels`` [K, B, S] already shifted on the full sequence)."""

    def forward_step(data_iterator, model):
        from megatron.core.utils import get_attr_wrapped_model

        batch = next(data_iterator)
        pre = get_attr_wrapped_model(model, "pre_process")
        post = get_attr_wrapped_model(model, "post_process")
        dev = get_attr_wrapped_model(model, "lm_head").weight.device if post else None
        labels = cp_slice(batch["labels"]) if post else None
        kw = {}
        if "mtp_tokens" in batch and post:
            kw = {"mtp_input_ids": [cp_slice(t) for t in batch["mtp_tokens"]],
                  "mtp_labels": [cp_slice(t) for t in batch["mtp_labels"]]}
        out = model(input_ids=cp_slice(batch["tokens"]) if pre else None, labels=labels, **kw)
        if not post:
            return out, None
        lm, mtp_sums = out
        total = lm + (mtp_loss_weight * torch.stack(mtp_sums).mean() if mtp_sums else 0.0)
        n = (labels != IGNORE_INDEX).sum().to(torch.int)
        if dev is not None:
            n = n.to(dev)

        def loss_func(output_tensor):
            return output_tensor, n, {"lm_sum": lm.detach(), "mtp_sums": [s.detach() for s in mtp_sums], "n": n}

        return total, loss_func

    return forward_step


def grad_norm_fp32(chunks) -> float:
    """Global L2 norm of the (finalized) gradients: dense parameters counted once per TP group (replicated
    ones on TP rank 0) and reduced over TP x PP; expert parameters reduced over EP x PP. The squares are
    summed in fp64 on the gradients' device (one host read at the end)."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    dense, expert = [], []
    dev = None
    for c in chunks:
        for p in c.parameters():
            g = getattr(p, "main_grad", None)
            g = g if g is not None else p.grad
            if g is None:
                continue
            dev = g.device
            sq = g.double().pow(2).sum()
            if not getattr(p, "allreduce", True):
                expert.append(sq)
            elif getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                dense.append(sq)
    dev = dev or compat_device()
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    dense = torch.stack(dense).sum() if dense else zero.clone()
    expert = torch.stack(expert).sum() if expert else zero.clone()
    all_reduce(dense, group=ps.get_model_parallel_group())
    all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return float((dense + expert).sqrt())


def compat_device() -> torch.device:
    """This process's compute device (the current CUDA device, else the CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if compat.has_gpu() else torch.device("cpu")


def build_muon(chunks, lr: float, weight_decay: float = 0.1, adam_eps: float = 1e-8, beta1: float = 0.9,
               beta2: float = 0.95):
    from megatron.core import parallel_state as ps

    from ..optim.muon import MuonAdamW

    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    return MuonAdamW(named, lr=lr, weight_decay=weight_decay, adam_betas=(beta1, beta2), adam_eps=adam_eps,
                     tp_group=ps.get_tensor_model_parallel_group(), tp_size=ps.get_tensor_model_parallel_world_size())
