"""The host-streamed optimizer (megatron_k3/optim/offload.py) against megatron-core's own optimizer, on CPU/gloo.

    python offload_check.py OUT.json --world 2 --case dp2-fp32-distopt ...

Every case builds two identical k3-tiny megatron models (A, B) on the case's layout and trains for
--steps steps on random batches: A with megatron's optimizer (``runtime.build_optimizer``: FP32Optimizer,
Float16OptimizerWithFloat16Params or DistributedOptimizer), B with ``build_host_stream_optimizer``.
``lockstep``: B's DDP grad buffers receive A's gradients before both steps (isolates the optimizer);
``free``: B runs its own forward/backward (the whole training loop). Afterwards every parameter's fp32
master, exp_avg, exp_avg_sq (A: megatron's main params and torch AdamW state, per DP shard; B:
``param_states()``, all-gathered) and model weights are compared: relative error ||b - a|| / ||a||.
Then the checkpoint hooks: a third model + optimizer ``load_param_states(B.param_states())`` and both take
one more step on the same gradients (``roundtrip_max_abs_diff``: weights and states, must be 0).
Writes {case: {"master": err, "exp_avg": err, "exp_avg_sq": err, "weight": err, ...}}.
"""
import argparse
import json
import os
import sys

import torch


CASES = {
    # name: (dp, distopt, bf16, impl, moments, mode)
    "dp1-fp32-torch": (1, False, False, "torch", "fp32", "lockstep"),
    "dp1-bf16-fused": (1, False, True, "fused", "fp32", "lockstep"),
    "dp1-bf16-torch-bf16moments": (1, False, True, "torch", "bf16", "lockstep"),
    "dp1-bf16-onepass-bf16moments": (1, False, True, "onepass", "bf16", "lockstep"),
    "dp2-fp32-distopt-torch": (2, True, False, "torch", "fp32", "lockstep"),
    "dp2-bf16-distopt-fused": (2, True, True, "fused", "fp32", "lockstep"),
    "dp2-fp32-distopt-free": (2, True, False, "torch", "fp32", "free"),
    "dp2-fp32-nodistopt-torch": (2, False, False, "torch", "fp32", "lockstep"),
}


def _rel(a, b):
    d = (a.double() - b.double()).norm().item()
    n = b.double().norm().item()
    return d / n if n > 0 else d


def _megatron_state(opt, model_params):
    """{param: (range_lo, range_hi, {"master", "exp_avg", "exp_avg_sq"} 1-D fp32)} of this rank (A)."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    subs = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
    out = {}
    for sub in subs:
        if isinstance(sub, DistributedOptimizer):
            pairs = [(mg, sg) for mgs, sgs in ((sub.model_float16_groups, sub.shard_fp32_from_float16_groups),
                                               (sub.model_fp32_groups, sub.shard_fp32_groups))
                     for mg, sg in zip(mgs, sgs)]
            for mg, sg in pairs:
                for p, mp in zip(mg, sg):
                    r = sub._get_model_param_range_map(p)["param"]
                    st = sub.optimizer.state[mp]
                    assert mp.numel() == r.end - r.start
                    out[p] = (r.start, r.end, {"master": mp.detach().view(-1).float(),
                                               "exp_avg": st["exp_avg"].view(-1).float(),
                                               "exp_avg_sq": st["exp_avg_sq"].view(-1).float()})
        elif isinstance(sub, Float16OptimizerWithFloat16Params):
            for mg, fg in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                for p, mp in zip(mg, fg):
                    st = sub.optimizer.state[mp]
                    out[p] = (0, p.numel(), {"master": mp.detach().view(-1), "exp_avg": st["exp_avg"].view(-1),
                                             "exp_avg_sq": st["exp_avg_sq"].view(-1)})
        else:  # FP32Optimizer
            for g in sub.optimizer.param_groups:
                for p in g["params"]:
                    st = sub.optimizer.state[p]
                    out[p] = (0, p.numel(), {"master": p.detach().view(-1), "exp_avg": st["exp_avg"].view(-1),
                                             "exp_avg_sq": st["exp_avg_sq"].view(-1)})
    return out


def _worker(rank, world, port, out_path, cases, steps, chunk_bytes):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_k3.config import get_preset
    from megatron_k3.parallel.layout import ParallelLayout
    from megatron_k3.parallel import adapter
    from megatron_k3.parallel.runtime import (build_model_chunks, build_optimizer,
                                              init_distributed, make_forward_step, wrap_ddp)
    from megatron_k3.model import K3ForCausalLM
    from megatron_k3.optim.offload import build_host_stream_optimizer
    from megatron_k3.parallel.verify import make_batches

    cfg = get_preset("k3-tiny")
    init_sd = K3ForCausalLM(cfg, seed=7).state_dict()
    results = {}
    for name in cases:
        dp, distopt, bf16, impl, moments, mode = CASES[name]
        assert dp == world
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        layout = ParallelLayout(dp=dp)
        device = init_distributed(layout, seed=1)
        dtype = torch.bfloat16 if bf16 else torch.float32
        models = []
        for _ in range(2):
            chunks, tconfig = build_model_chunks(cfg, layout, params_dtype=dtype, device=device)
            adapter.load_hf_state_dict(chunks[0], init_sd, 0)
            ddp = wrap_ddp(chunks, tconfig, distopt)
            models.append((chunks, ddp, tconfig))
        kw = dict(lr=3e-3, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=distopt, bf16=bf16,
                  adam_eps=1e-8, beta1=0.9, beta2=0.95)
        opt_a = build_optimizer(models[0][1], **kw)
        opt_b = build_host_stream_optimizer(models[1][1], **kw, chunk_bytes=chunk_bytes, cpu_block_elems=3000,
                                            impl=impl,
                                            moments_dtype=torch.float32 if moments == "fp32" else torch.bfloat16)
        batches = make_batches(cfg, steps, 4 * dp, 32, 11, 0)
        fb = get_forward_backward_func()
        r = ps.get_data_parallel_rank()

        def fwd_bwd(ddp, b):
            for d in ddp:
                d.zero_grad_buffer()
            micro = [{k: v[r * 4 + 2 * m:r * 4 + 2 * m + 2].to(device) for k, v in b.items()} for m in range(2)]
            fb(forward_step_func=make_forward_step(), data_iterator=iter(micro), model=ddp[0], num_microbatches=2,
               seq_length=32, micro_batch_size=2, forward_only=False)

        norms = []
        for step, b in enumerate(batches):
            opt_a.zero_grad()
            opt_b.zero_grad()
            fwd_bwd(models[0][1], b)
            if mode == "lockstep":
                for da, db in zip(models[0][1], models[1][1]):
                    for ba, bb in zip(list(da.buffers) + list(da.expert_parallel_buffers),
                                      list(db.buffers) + list(db.expert_parallel_buffers)):
                        bb.grad_data.copy_(ba.grad_data)
            else:
                fwd_bwd(models[1][1], b)
            _, na, _ = opt_a.step()
            _, nb, _ = opt_b.step()
            norms.append((float(na), float(nb)))
        params_a = [p for p in models[0][0][0].parameters() if p.requires_grad]
        params_b = [p for p in models[1][0][0].parameters() if p.requires_grad]
        names = {p: n for n, p in models[1][1][0].module.named_parameters()}
        sa = _megatron_state(opt_a, params_a)
        sb = opt_b.param_states()["params"]
        num = {k: 0.0 for k in ("master", "exp_avg", "exp_avg_sq", "weight")}
        den = dict(num)
        ulp_diff, total = 0, 0
        for pa, pb in zip(params_a, params_b):
            if pa in sa:
                lo, hi, st = sa[pa]
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    ref = st[k].double()
                    got = sb[names[pb]][k].reshape(-1)[lo:hi].double()
                    num[k] += (got - ref).pow(2).sum().item()
                    den[k] += ref.pow(2).sum().item()
            num["weight"] += (pb.detach().double() - pa.detach().double()).pow(2).sum().item()
            den["weight"] += pa.detach().double().pow(2).sum().item()
            ulp_diff += int((pb.detach() != pa.detach()).sum())
            total += pa.numel()
        t = torch.tensor([num[k] for k in num] + [den[k] for k in den] + [ulp_diff, total], dtype=torch.float64)
        dist.all_reduce(t)
        k = len(num)
        errs = {key: (t[i] / t[k + i]).sqrt().item() if t[k + i] > 0 else 0.0 for i, key in enumerate(num)}
        errs["weight_elems_differing_frac"] = (t[-2] / t[-1]).item()
        errs["grad_norm_rel_err_max"] = max(abs(a - b) / max(abs(a), 1e-30) for a, b in norms)
        errs["grad_norms_first_last"] = [norms[0][0], norms[-1][0]]
        owned = sum(p.numel() for p in params_b) / (world if distopt else 1)
        errs["host_state_bytes_per_param"] = opt_b.state_bytes / owned
        errs["chunks_per_step"] = -(-opt_b.numel // opt_b.chunk_elems)
        errs["impl"] = opt_b.impl
        # checkpoint hooks: a fresh model + optimizer loaded from B's param_states() continues identically
        states = opt_b.param_states()
        chunks_c, tconfig_c = build_model_chunks(cfg, layout, params_dtype=dtype, device=device)
        adapter.load_hf_state_dict(chunks_c[0], init_sd, 0)   # different weights until the load
        ddp_c = wrap_ddp(chunks_c, tconfig_c, distopt)
        opt_c = build_host_stream_optimizer(ddp_c, **kw, chunk_bytes=chunk_bytes * 3, cpu_block_elems=5000,
                                            impl=impl, moments_dtype=opt_b.moments_dtype)
        opt_c.load_param_states(states)
        diff = max(float((pc.detach() - pb.detach()).abs().max()) for pc, pb in zip(chunks_c[0].parameters(), params_b))
        if not distopt:  # C's parameters move to new storage: the stream's chunk plans must rebind to them
            for pc in chunks_c[0].parameters():   # (with the distributed optimizer they are views of DDP's buffer)
                pc.data = pc.data.clone()
            errs["params_moved_before_roundtrip_step"] = True
        for dc, db in zip(ddp_c, models[1][1]):
            for bc, bb in zip(list(dc.buffers) + list(dc.expert_parallel_buffers),
                              list(db.buffers) + list(db.expert_parallel_buffers)):
                bc.grad_data.copy_(bb.grad_data)
        opt_b.step()
        opt_c.step()
        diff = max([diff] + [float((pc.detach() - pb.detach()).abs().max())
                             for pc, pb in zip(chunks_c[0].parameters(), params_b)])
        sc = opt_c.param_states()
        sb2 = opt_b.param_states()
        diff = max([diff] + [float((sc["params"][n][k] - sb2["params"][n][k]).abs().max())
                             for n in sb2["params"] for k in ("master", "exp_avg", "exp_avg_sq")])
        errs["roundtrip_max_abs_diff"] = diff
        errs["roundtrip_step"] = [states["step"], sc["step"]]
        results[name] = errs
        dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--case", action="append", required=True, choices=sorted(CASES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--chunk-bytes", type=int, default=40_000)
    a = ap.parse_args()
    from megatron_k3.train.launch_env import free_port

    port = free_port()
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(a.world, port, a.out, a.case, a.steps, a.chunk_bytes), nprocs=a.world,
                       join=True, start_method="spawn")


if __name__ == "__main__":
    main()
