#!/usr/bin/env python3
"""The whole ``--optimizer-offload host-stream`` step on one GPU, without the model: where its time goes.

``bench_offload_host.py`` times the host update alone; the trainer's step times everything at once. This
script sits between them: megatron's DDP over a synthetic model shaped like k3-mini's parameter list
(``--params`` elements, ``--small`` small vectors beside [4096, 4096] matrices, bf16, fp32 gradient buffers
filled with noise) and ``HostStreamAdamW.step()`` on it, per setting of ``--variants`` (``chunk MiB:buffers``),
with the stream's own split of its host time (``stream_parts_s``: waiting for a gradient chunk, waiting for a
free output slot, the update, issuing copies). In the same process, the host update alone on the same
number of elements (``bench_offload_host.time_update``), so ``update_s`` inside the stream can be compared
with it directly.

    python benchmarks/bench_offload_stream.py --out R.json        # GPU; on the CPU it runs the CPU path
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch


def build(n_params: float, n_small: int, device):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    width = 4096 if n_params >= 1e8 else 256
    n_big = max(1, round((n_params - n_small * 1024) / width ** 2))
    m = torch.nn.Module()
    m.big = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(width, width, device=device,
                                                                   dtype=torch.bfloat16).normal_(0, 0.02))
                                    for _ in range(n_big)])
    m.small = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(1024, device=device, dtype=torch.bfloat16))
                                      for _ in range(n_small)])
    tc = TransformerConfig(num_layers=1, hidden_size=width, num_attention_heads=1, params_dtype=torch.bfloat16,
                           bf16=True)
    ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(grad_reduce_in_fp32=True), m)
    for b in ddp.buffers:
        b.grad_data.normal_(0, 1e-3)
    return ddp


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1.257e9, help="elements (default: k3-mini's 1.257 B)")
    ap.add_argument("--small", type=int, default=2372, help="small [1024] parameters (k3-mini: 2447 params in all)")
    ap.add_argument("--variants", default="32:2,32:4,128:2,128:3", help="comma list of chunk_MiB:buffers")
    ap.add_argument("--impls", default="onepass,fused", help="comma list of host update kernels (offload.IMPLS), "
                    "each run with every variant and, with --host-only, alone")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up step)")
    ap.add_argument("--host-only", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the host update alone on the same elements (bench_offload_host.time_update)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", "29791")
    from megatron_k3.optim.offload import build_host_stream_optimizer
    from megatron_k3.parallel.layout import ParallelLayout
    from megatron_k3.parallel.runtime import destroy, init_distributed

    device = init_distributed(ParallelLayout(), seed=0)
    t0 = time.perf_counter()
    ddp = build(args.params, args.small, device)
    n = sum(p.numel() for p in ddp.module.parameters())
    rec = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "host": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
           "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
           "params": n, "param_tensors": len(list(ddp.module.parameters())),
           "model_build_s": round(time.perf_counter() - t0, 2), "variants": []}
    print(json.dumps({k: rec[k] for k in ("device", "host", "params", "param_tensors")}), flush=True)

    def dump():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rec, f, indent=1)

    impls = args.impls.split(",")
    for impl, spec in ((i, s) for i in impls for s in args.variants.split(",")):
        mib, nbuf = (int(x) for x in spec.split(":"))
        gc.collect()
        t0 = time.perf_counter()
        opt = build_host_stream_optimizer([ddp], lr=1e-4, bf16=True, chunk_bytes=mib << 20, num_buffers=nbuf,
                                          impl=impl)
        build_s = time.perf_counter() - t0
        times, parts = [], []
        for i in range(args.steps + 1):
            sync()
            t = time.perf_counter()
            opt.step()
            sync()
            if i:
                times.append(time.perf_counter() - t)
                parts.append(opt.timings)
        med = statistics.median(times)
        v = {"chunk_mib": mib, "buffers": nbuf, "chunks": opt.timings["chunks"], "impl": opt.impl,
             "impl_note": opt.impl_note,
             "build_s": round(build_s, 2), "step_s": times, "median_step_s": med,
             "G_params_per_s": n / med / 1e9, "timings": parts,
             "fixed_buffer_bytes": opt.fixed_buffer_bytes, "device_buffer_bytes": opt.device_buffer_bytes}
        rec["variants"].append(v)
        print(json.dumps({k: v[k] for k in ("impl", "chunk_mib", "buffers", "median_step_s", "G_params_per_s")}
                         | {"parts": parts[-1]["stream_parts_s"]}), flush=True)
        dump()
        del opt
    if args.host_only:
        import importlib.util

        spec = importlib.util.spec_from_file_location(  # the sibling script's timing loop, not a copy of it
            "bench_offload_host", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_offload_host.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        time_update = mod.time_update

        del ddp
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        rec["host_only"] = []
        for impl in impls:
            upd, times = time_update(n, impl, 1 << 20, torch.bfloat16, args.steps)
            rec["host_only"].append({"impl": upd.impl, "moments": "bfloat16", "cpu_block": 1 << 20,
                                     "seconds": times, "G_params_per_s": n / statistics.median(times) / 1e9})
            print(json.dumps(rec["host_only"][-1]), flush=True)
            dump()
            del upd
    destroy()


if __name__ == "__main__":
    main()
