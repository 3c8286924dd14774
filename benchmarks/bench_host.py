#!/usr/bin/env python3
"""Host (Python) time of one training step at a preset's *structure*: the same layers, experts, parameter
tensors and modules, at tiny widths, so the arithmetic is negligible and what is timed is the per-module and
per-tensor host work of megatron's step (DDP, gradient finalisation, grad norm and clip, optimizer).

    python benchmarks/bench_host.py --preset k3-mini --steps 6 --out R.json

Why: on the H200 the step of k3-mini with layer graphs waits ~55 ms for the host (benchmarks/README.md), and
without graphs (pipeline, expert or tensor parallel layouts refuse them) every layer's host work is on the
critical path. This host work does not depend on the device, so it can be measured and improved on a CPU
machine; the device time it overlaps with can not (that needs benchmarks/benchmark.py on the GPU).

Runs on the CPU through megatron's schedule with bf16 weights (megatron's fp16/bf16 optimizer, the path the
GPU runs) and reports, per step (median over ``--steps`` after 2 warm-up steps), wall time and the time
inside: the forward/backward passes (the rest of the step), ``finalize_k3_grads`` and within it
megatron's ``reset_model_temporary_tensors`` and ``runtime.moe_routers``, the optimizer step and within it
the grad norm and the clip, and the zeroing of gradients. Widths are overridden by ``TINY`` (hidden 64,
vocabulary 512, ...); layers, experts, heads-per-module structure and the layer pattern stay the preset's.
"""
import argparse
import datetime
import functools
import json
import os
import statistics
import time


import torch  # noqa: E402

TINY = dict(hidden_size=64, kda_num_heads=2, kda_head_dim=16, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, moe_intermediate_size=16,
            routed_expert_hidden_size=32, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=3)


class Timers:
    """Seconds spent inside wrapped callables, per name, since the last ``reset``."""

    def __init__(self):
        self.t = {}

    def reset(self):
        self.t = {}

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
        return timed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-mini")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seq-length", type=int, default=32)
    ap.add_argument("--fused-adamw", action="store_true",
                    help="step the optimizer as on CUDA: torch's fused AdamW (its CPU kernel here) through "
                         "patches.foreach_kernels.fuse_torch_adamw (LeanFusedAdamWStep unless --no-lean-adamw)")
    ap.add_argument("--lean-adamw", action=argparse.BooleanOptionalAction, default=True,
                    help="with --fused-adamw: LeanFusedAdamWStep (default) or torch's own step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from megatron_k3 import perf

    perf.configure(lean_adamw=args.lean_adamw)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29681"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    import importlib

    # the modules (megatron.core.distributed's finalize_model_grads attribute is the function of that name)
    mfin = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    mopt = importlib.import_module("megatron.core.optimizer.optimizer")
    from benchmark import command_line, megatron_step, random_batches, write_report

    from megatron_k3.config import get_preset
    from megatron_k3.parallel.layout import ParallelLayout
    from megatron_k3.parallel import adapter
    from megatron_k3.parallel import runtime
    from megatron_k3.model import K3ForCausalLM

    cfg = get_preset(args.preset, seq_length=args.seq_length, **TINY)
    layout = ParallelLayout()
    device = runtime.init_distributed(layout, seed=0)
    chunks, tconfig = runtime.build_model_chunks(cfg, layout, params_dtype=torch.bfloat16, device=device)
    adapter.load_hf_state_dict(chunks[0], K3ForCausalLM(cfg, seed=0).state_dict(), 0)
    ddp = runtime.wrap_ddp(chunks, tconfig)
    opt = runtime.build_optimizer(ddp, lr=1e-4, bf16=True)
    if args.fused_adamw:
        from megatron_k3.patches.foreach_kernels import fuse_torch_adamw

        assert fuse_torch_adamw(opt, device_types=("cpu",)) >= 1
    timers = Timers()
    # time the pieces where they are looked up at call time (module globals, the config's hook, methods)
    mfin.reset_model_temporary_tensors = timers.wrap("reset_model_temporary_tensors", mfin.reset_model_temporary_tensors)
    runtime.moe_routers = timers.wrap("moe_routers", runtime.moe_routers)
    mopt.get_grad_norm_fp32 = timers.wrap("grad_norm", mopt.get_grad_norm_fp32)
    mopt.clip_grad_by_total_norm_fp32 = timers.wrap("clip", mopt.clip_grad_by_total_norm_fp32)
    tconfig.finalize_model_grads_func = timers.wrap("finalize_k3_grads", tconfig.finalize_model_grads_func)
    opt.step = timers.wrap("optimizer_step", opt.step)
    opt.zero_grad = timers.wrap("zero_grad", opt.zero_grad)
    ddp[0].zero_grad_buffer = timers.wrap("zero_grad", ddp[0].zero_grad_buffer)
    step = megatron_step(ddp, opt, runtime.make_forward_step(), args.micro_batch_size, args.seq_length)
    per_step = []
    for i, micro in enumerate(random_batches(cfg.vocab_size, args.micro_batch_size, args.seq_length, 1,
                                             2 + args.steps)):
        timers.reset()
        t0 = time.perf_counter()
        step(micro)
        wall = time.perf_counter() - t0
        if i >= 2:
            rec = dict(timers.t, wall=wall)
            # megatron's forward/backward schedule is the rest of the step (zero_grad and optimizer_step aside)
            rec["forward_backward"] = wall - sum(rec.get(k, 0.0) for k in ("zero_grad", "optimizer_step",
                                                                           "finalize_k3_grads"))
            per_step.append(rec)
    keys = sorted({k for r in per_step for k in r})
    med = {k: round(1e3 * statistics.median(r.get(k, 0.0) for r in per_step), 2) for k in keys}
    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": f"cpu ({os.cpu_count()} cores), one thread",
           "command": command_line("benchmarks/bench_host.py"),
           "preset_structure": args.preset, "widths": TINY, "dtype": "bfloat16",
           "optimizer": "torch fused AdamW (CPU kernel), " + ("torch's step" if not args.lean_adamw
                                                               else "LeanFusedAdamWStep")
           if args.fused_adamw else "megatron's fallback torch AdamW (single-tensor on the CPU)",
           "micro_batch_size": args.micro_batch_size, "seq_length": args.seq_length, "steps": args.steps,
           "parameter_tensors": sum(1 for _ in chunks[0].parameters()),
           "modules": sum(1 for _ in chunks[0].modules()),
           "median_ms_per_step": med}
    write_report(rep, args.out)
    runtime.destroy()


if __name__ == "__main__":
    main()
