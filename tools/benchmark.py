#!/usr/bin/env python3
"""Training-throughput benchmark of the megatron K3 model, with a seed-style baseline in the same run.

    python tools/benchmark.py --preset k3-mini --bf16 --micro-batch-size 4 --seq-length 4096 --out R.json
    python tools/benchmark.py --smoke            # CPU: k3-tiny, a few steps (checks the harness runs)

Times full training steps (forward, backward, gradient finalisation, AdamW step) after warm-up
(synchronised wall clock around each step) and reports the median step time, tokens/s, MFU and peak memory.
In the same process it then times the **seed-style baseline** (``--baselines seed``): the golden
plain-PyTorch ``K3ForCausalLM`` on one device as a careful single-GPU user would run it (bf16 weights, fla
``chunk_kda`` on CUDA, grouped-GEMM experts, chunked cross-entropy, fused AdamW; eager: torch.compile is not
applied) on the same shapes and data, and reports ``speedup_vs_seed``. megatron-core's ``GPTModel`` baseline
of the speed issue needs Transformer Engine's fused attention on the device and is not in this harness yet. Model FLOPs per token (see
benchmarks/README.md): 6 x active parameters without the input embedding, plus causal attention scores of
the MLA layers (3 x 2 x (S/2) x H x (d_qk + d_v)) and the KDA chunked recurrence
(3 x H x (4 C d + 4 d^2) with chunk C = 64).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

H200_BF16_DENSE = 989e12


def flops_per_token(cfg, seq_length, active_params):
    mla = cfg.layer_kinds.count("mla")
    kda = cfg.layer_kinds.count("kda")
    attn = 3 * 2 * (seq_length / 2) * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * mla
    C, d = cfg.kda_chunk_size, cfg.kda_head_dim
    kda_f = 3 * cfg.kda_num_heads * (4 * C * d + 4 * d * d) * kda
    return 6 * active_params + attn + kda_f


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-mini")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--recompute-granularity", default="none")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke mode: k3-tiny, seq 128, 2+2 steps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="also profile one extra step; write the top ops table here")
    ap.add_argument("--baselines", default="seed", help="comma list of same-run baselines: seed, or none")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.seq_length, args.micro_batch_size, args.warmup, args.steps = "k3-tiny", 128, 2, 2, 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29677"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_k3.config import get_preset
    from megatron_k3.layout import ParallelLayout
    from megatron_k3.megatron import adapter
    from megatron_k3.megatron.runtime import (build_model_chunks, build_optimizer, finalize_k3_grads,
                                              init_distributed, make_forward_step, wrap_ddp)
    from megatron_k3.model import K3ForCausalLM
    from megatron_k3.model_info import model_info

    cfg = get_preset(args.preset, seq_length=args.seq_length)
    layout = ParallelLayout()
    device = init_distributed(layout, seed=0)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    t0 = time.time()
    chunks, tconfig = build_model_chunks(cfg, layout, params_dtype=dtype, device=device,
                                         recompute=args.recompute_granularity)
    adapter.load_hf_state_dict(chunks[0], K3ForCausalLM(cfg, seed=0).state_dict(), 0)
    build_s = time.time() - t0
    ddp = wrap_ddp(chunks, tconfig)
    tconfig.finalize_model_grads_func = finalize_k3_grads
    tconfig.no_sync_func = ddp[0].no_sync
    opt = build_optimizer(ddp, lr=1e-4, bf16=args.bf16)
    fb = get_forward_backward_func()
    g = torch.Generator().manual_seed(0)
    B, S = args.micro_batch_size, args.seq_length
    cuda = device.type == "cuda"
    def train_step(micro):
        ddp[0].zero_grad_buffer()
        opt.zero_grad()
        fb(forward_step_func=make_forward_step(), data_iterator=iter(micro), model=ddp[0], num_microbatches=1,
           seq_length=S, micro_batch_size=B, forward_only=False)
        opt.step()

    times = []
    for step in range(args.warmup + args.steps):
        t = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=g)
        micro = [{"tokens": t[:, :-1].to(device), "labels": t[:, 1:].to(device)}]
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        train_step(micro)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t1)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            train_step(micro)
            if cuda:
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        with open(args.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60))
    k3_peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    if args.out:  # the K3 measurement survives a baseline that runs out of time or memory
        with open(args.out, "w") as f:
            json.dump({"partial": True, "step_times_s": times, "median_step_s": statistics.median(times),
                       "tokens_per_s": B * S / statistics.median(times), "peak_memory_gib": k3_peak}, f)
    baselines = {}
    if "seed" in args.baselines.split(","):
        del opt, ddp, chunks
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            baselines["seed"] = seed_baseline(cfg, B, S, device, dtype, args.warmup, args.steps)
        except Exception as e:  # noqa: BLE001  (report, do not lose the K3 measurement)
            baselines["seed"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    info = model_info(cfg)
    med = statistics.median(times)
    tps = B * S / med
    fpt = flops_per_token(cfg, S, info["active_params"])
    rep = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "command": " ".join(["python", "tools/benchmark.py"] + sys.argv[1:]),
        "preset": cfg.name, "params_total": info["total_params"], "params_active_no_embed": info["active_params"],
        "micro_batch_size": B, "seq_length": S, "dtype": str(dtype).replace("torch.", ""),
        "recompute": args.recompute_granularity, "build_and_init_s": build_s,
        "step_times_s": times, "median_step_s": med, "tokens_per_s": tps,
        "model_flops_per_token": fpt, "mfu_vs_989_tflops": tps * fpt / H200_BF16_DENSE if cuda else None,
        "peak_memory_gib": k3_peak, "baselines": baselines,
    }
    for name, b in baselines.items():
        if "median_step_s" in b:
            b["tokens_per_s"] = B * S / b["median_step_s"]
            b["mfu_vs_989_tflops"] = b["tokens_per_s"] * fpt / H200_BF16_DENSE if cuda else None
            rep[f"speedup_vs_{name}"] = b["median_step_s"] / med
    txt = json.dumps(rep, indent=1)
    print(txt)
    if args.out:
        with open(args.out, "w") as f:
            f.write(txt + "\n")
    ps.destroy_model_parallel()


def seed_baseline(cfg, B, S, device, dtype, warmup, steps):
    """The golden model trained the way a careful single-GPU user would (see the module docstring)."""
    from megatron_k3.model import K3ForCausalLM

    model = K3ForCausalLM(cfg, seed=0)
    if dtype != torch.float32:
        model.to_compute_dtype(dtype)
    model.to(device).train()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)
    g = torch.Generator().manual_seed(0)
    times = []
    for step in range(warmup + steps):
        t = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss = model(t[:, :-1], t[:, 1:])["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t1)
    return {"what": "golden K3ForCausalLM, bf16 weights, fla chunk_kda (CUDA), grouped-GEMM experts, chunked CE, "
                    "fused AdamW, eager", "step_times_s": times, "median_step_s": statistics.median(times),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None}


if __name__ == "__main__":
    main()
