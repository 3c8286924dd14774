"""Run 3 training steps of k3-tiny at DP2 with 4 micro-batches per rank and report, per step, the counts
the balancing used vs counts recorded independently by a forward hook on every router call, and the bias.
Usage: python balancing_run.py {sign|quantile} OUT.json"""
import json
import os
import sys

import torch
import torch.multiprocessing as mp



def worker(rank, world, port, mode, out):
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
                                              init_distributed, make_forward_step, moe_routers, wrap_ddp)
    from megatron_k3.model import K3ForCausalLM

    cfg = get_preset("k3-tiny")
    layout = ParallelLayout(dp=2)
    device = init_distributed(layout, seed=1)
    chunks, tconfig = build_model_chunks(cfg, layout, device=device,
                                         moe_router_bias_update_rate=(0.05 if mode == "sign" else 0.0))
    adapter.load_hf_state_dict(chunks[0], K3ForCausalLM(cfg, seed=1).state_dict(), 0)
    routers = moe_routers(chunks)
    seen = {name: torch.zeros(cfg.num_experts, dtype=torch.float64) for name, _ in routers}
    calls = {name: 0 for name, _ in routers}
    for name, r in routers:
        r.k3_balancing = mode

        def hook(mod, inp, outp, name=name):
            if torch.is_grad_enabled():
                seen[name] += outp[1].sum(0).double()
                calls[name] += 1

        r.register_forward_hook(hook)
    ddp = wrap_ddp(chunks, tconfig)
    opt = build_optimizer(ddp, lr=1e-3)
    fb = get_forward_backward_func()
    g = torch.Generator().manual_seed(100 + rank)
    report = []
    for step in range(3):
        micro = []
        for _ in range(4):
            t = torch.randint(0, cfg.vocab_size, (1, 33), generator=g)
            micro.append({"tokens": t[:, :-1], "labels": t[:, 1:]})
        for d in ddp:
            d.zero_grad_buffer()
        opt.zero_grad()
        captured = []
        tconfig.k3_capture_counts = captured
        for name in seen:
            seen[name].zero_()
            calls[name] = 0
        fb(forward_step_func=make_forward_step(), data_iterator=iter(micro), model=ddp[0], num_microbatches=4,
           seq_length=32, micro_batch_size=1, forward_only=False)
        opt.step()
        hooked = torch.stack([seen[n] for n, _ in routers])
        dist.all_reduce(hooked)
        report.append({"captured": {n: c.tolist() for n, c in captured}, "hooked": hooked.tolist(),
                       "calls": [calls[n] for n, _ in routers],
                       "bias": [r.expert_bias.tolist() for _, r in routers]})
    obj = [report[-1]["bias"]]
    dist.broadcast_object_list(obj, src=1)  # rank 1's final bias, to rank 0
    if rank == 0:
        report.append({"bias_rank1": obj[0]})
        json.dump(report, open(out, "w"))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_k3.train.launch_env import free_port

    port = free_port()
    mp.start_processes(worker, args=(2, port, sys.argv[1], sys.argv[2]), nprocs=2, join=True, start_method="spawn")
