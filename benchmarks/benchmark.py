#!/usr/bin/env python3
"""Training throughput of the K3 trainer's own step, with same-run baselines.

    python benchmarks/benchmark.py --preset k3-mini --bf16 --micro-batch-size 8 --global-batch-size 32 \
        --cuda-graph-impl local --out R.json          # any trainer flag (python -m megatron_k3 train --help)
    python benchmarks/benchmark.py --smoke                 # CPU: k3-tiny, a few steps (checks the harness runs)

The K3 figure is ``megatron_k3.train.Trainer.train_step``, the step the trainer runs: the harness builds a
``Trainer`` from the same flags (per-rank init, DDP, optimizer, the data loader, layer graphs), runs the
trainer's own loop (``Trainer.fit``) for warm-up + steps and records its per-step times
(``trainer_loop``), then times ``warm-up + steps`` more ``train_step`` calls on the loader's next batches with
the device synchronised around each, and reports their median step time, tokens/s, MFU and peak memory, and
``trainer_loop_vs_train_step`` (the loop's median over the harness's). Data: the trainer's (``--data-path``;
default the embedded corpus). ``--global-batch-size`` (default one micro-batch per rank) accumulates gradients
over ``global / (micro x DP)`` micro-batches per step, as a training run does; the learning rate is held at
``--lr`` (constant schedule).
In the same process it then times the **seed-style baseline** (``--baselines seed``): the golden
plain-PyTorch ``K3ForCausalLM`` on one device as a careful single-GPU user would run it (bf16 weights, fla
``chunk_kda`` on CUDA, grouped-GEMM experts, chunked cross-entropy, fused AdamW, and on CUDA the same
torch.compile'd element-wise glue as the K3 model: ``--compile off`` runs both eagerly) on the same
micro-batches, and reports ``speedup_vs_seed`` (``seed_compiledconv``: the same with torch.compile'd short
convolutions instead of fla's; hold a target against the faster of the two); and megatron-core's own
``GPTModel`` (``--baselines gptmodel``: MLA + MoE at the same width, depth, heads, experts and vocabulary, TE
spec when Transformer Engine imports; see ``gptmodel_config``), reported as ``speedup_vs_gptmodel``. The
baselines keep their own loops. On CUDA one extra profiled ``train_step`` gives ``breakdown``: device time by
kernel kind (GEMM, fla KDA, attention, optimizer, elementwise, ...), the profiled step's wall time and the
device's idle gaps by host phase. Model FLOPs per token (see benchmarks/README.md): 6 x active parameters
without the input embedding, plus causal attention scores of the MLA layers (3 x 2 x (S/2) x H x (d_qk + d_v))
and the KDA chunked recurrence (3 x H x (4 C d + 4 d^2) with chunk C = 64).
"""
import argparse
import contextlib
import datetime
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time


import torch  # noqa: E402

H200_BF16_DENSE = 989e12
# device kernels that are GEMMs (cuBLAS/cuBLASLt, CUTLASS, torch's grouped mm), by name (lower-case, re.search):
# the breakdown's "gemm" kind, and bench_gemm_fp8's split of a Linear's time into its GEMMs and the rest.
# Inductor's pointwise/reduction kernels
# (triton_poi_/triton_per_/triton_red_) are never GEMMs, though Inductor names them after the ops they feed:
# torchao's compiled cast for a `_scaled_mm` is "triton_poi_fused__scaled_mm__to_copy_clamp_..." (H200,
# 2026-12-07). Inductor's own GEMM templates are "triton_tem_" and stay GEMMs.
GEMM_KERNELS = (r"^(?!triton_(?:poi|per|red)_).*(?:gemm|nvjet|cutlass|sm90_xmma|grouped_mm|matmul|_mm_|wgmma|"
                r"magma|gemv|cublas)")


def flops_per_token(cfg, seq_length, active_params):
    mla = cfg.layer_kinds.count("mla")
    kda = cfg.layer_kinds.count("kda")
    attn = 3 * 2 * (seq_length / 2) * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * mla
    C, d = cfg.kda_chunk_size, cfg.kda_head_dim
    kda_f = 3 * cfg.kda_num_heads * (4 * C * d + 4 * d * d) * kda
    return 6 * active_params + attn + kda_f


BENCH_DEFAULTS = dict(preset="k3-mini", micro_batch_size=4, seq_length=4096)


def build_parser():
    """The trainer's flags (every section of ``python -m megatron_k3 train --help``) plus the harness's own."""
    from megatron_k3.cli import ArgumentParser
    from megatron_k3.train.config import add_arguments

    ap = ArgumentParser(prog="benchmark", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    b = ap.add_argument_group("benchmark")
    b.add_argument("--warmup", type=int, default=3, help="untimed steps before each timed series")
    b.add_argument("--steps", type=int, default=10, help="timed steps of each series")
    b.add_argument("--smoke", action="store_true", help="CPU smoke mode: k3-tiny, seq 128, micro-batch 2, 2+2 steps")
    b.add_argument("--out", default=None)
    b.add_argument("--profile", default=None, help="also write the profiled step's top ops table here")
    b.add_argument("--kernel-trace", default=None,
                   help="also write the profiled step's device timeline here (gzip JSON, ``kernel_trace``: every "
                        "kernel, copy and memset with its stream, grid, block, shared memory and launch id, the "
                        "runtime calls that launched them and the k3.* host phases; read by "
                        "benchmarks/trace_gaps.py)")
    b.add_argument("--baselines", default="seed,gptmodel",
                   help="comma list of same-run baselines: seed, seed_compiledconv (the seed with the compiled short "
                        "convolutions instead of fla's), gptmodel, k3eager (this K3 model again without layer "
                        "graphs; with --cuda-graph-impl local), or none")
    b.add_argument("--seed-micro-batch-size", type=int, default=None,
                   help="micro-batch size of the seed baselines (default: the trainer's). They regroup the K3 run's "
                        "tokens of each step into micro-batches of this size: the same tokens and global batch, each "
                        "model at the largest micro-batch that fits (the seed fits micro-batch 8 on an H200, "
                        "the K3 model may fit more)")
    b.add_argument("--no-trainer-loop", action="store_true",
                   help="skip the trainer's own loop (Trainer.fit) before the timed train_step series")
    b.add_argument("--watchdog", type=float, default=None,
                   help="after this many seconds print every thread's stack to stderr (where a slow run is)")
    b.add_argument("--no-te", action="store_true",
                   help="hide Transformer Engine and apex (megatron then uses its torch fallbacks)")
    add_arguments(ap)
    return ap


def job_from(ns, world: int):
    """The trainer's JobConfig for the benchmark: the harness's defaults (k3-mini, 4 x 4096, one micro-batch per
    rank and step), then the flags; the schedule is held at the peak learning rate (no warmup or decay)."""
    from megatron_k3.train.config import JobConfig, apply_file

    job = JobConfig()
    job.model.preset = BENCH_DEFAULTS["preset"]
    job.train.micro_batch_size = BENCH_DEFAULTS["micro_batch_size"]
    job.train.seq_length = BENCH_DEFAULTS["seq_length"]
    job.train.global_batch_size = 0  # below: micro-batch x DP unless given
    job.optim.lr, job.optim.lr_decay_style, job.optim.lr_warmup_fraction = 1e-4, "constant", 0.0
    job.logging.wandb_mode = "disabled"
    job.logging.run_dir = tempfile.mkdtemp(prefix="k3-benchmark-")  # the loop's metrics.jsonl (or --run-dir)
    given = {k: v for k, v in vars(ns).items() if "." in k}
    if getattr(ns, "config", None):
        apply_file(job, ns.config, skip={k.split(".", 1)[1] for k in given})
    if ns.smoke:
        job.model.preset, job.train.seq_length, job.train.micro_batch_size = "k3-tiny", 128, 2
        ns.warmup, ns.steps = 2, 2
    for k, v in given.items():
        sname, fname = k.split(".", 1)
        setattr(getattr(job, sname), fname, v)
    tp, pp, cp = (job.parallel.tensor_model_parallel_size, job.parallel.pipeline_model_parallel_size,
                  job.parallel.context_parallel_size)
    if not job.train.global_batch_size:
        job.train.global_batch_size = job.train.micro_batch_size * max(1, world // (tp * pp * cp))
    job.train.train_iters = 2 * (ns.warmup + ns.steps) + 2
    return job


def main():
    ns = build_parser().parse_args()
    if ns.watchdog:
        import faulthandler

        faulthandler.dump_traceback_later(ns.watchdog, exit=False)
    if ns.no_te:
        for m in ("transformer_engine", "transformer_engine.pytorch", "apex", "amp_C"):
            sys.modules[m] = None  # import raises ImportError
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29677", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)  # torchrun sets them for several ranks
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world > 1 and ns.baselines not in ("", "none"):
        sys.exit("error: the same-run baselines are single-GPU runs: pass --baselines none with several ranks")
    from megatron_k3.cli import friendly_errors
    from megatron_k3.plan.model_info import model_info
    from megatron_k3.train.trainer import Trainer

    job = job_from(ns, world)
    seed_b = check_seed_micro_batch(ns, job)  # before the K3 run: a bad value costs no device time
    trainer = friendly_errors(lambda: Trainer(job))()
    cfg, layout = trainer.cfg, trainer.layout
    B, S, M = job.train.micro_batch_size, cfg.seq_length, trainer.num_micro
    k3 = k3_run(trainer, ns, rank, profile_path=ns.profile, trace_path=ns.kernel_trace)
    device = trainer.device
    cuda = device.type == "cuda"
    batches = k3.pop("batches")
    if ns.out and rank == 0:  # the K3 measurement survives a baseline that runs out of time or memory
        with open(ns.out, "w") as f:
            json.dump({"partial": True, **k3}, f)
    baselines = {}
    seed_batches = regroup(batches, seed_b) if seed_b != B else batches  # once, for every seed baseline
    dtype = torch.bfloat16 if job.perf.bf16 else torch.float32
    for name in [b for b in ns.baselines.split(",") if b and b != "none"]:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        progress(f"baseline {name}")
        try:
            if name == "k3eager":  # the same K3 model without layer graphs: what the graphs buy, same run
                import copy

                job2 = copy.deepcopy(job)
                job2.perf.cuda_graph_impl = "none"
                b = k3_run(Trainer(job2), ns, rank, profile_path=None, trainer_loop=False, profile=False)
                b.pop("batches")
                b["loss_max_abs_diff_vs_k3"] = max(abs(x - y) for x, y in zip(b["losses"], k3["losses"]))
                baselines[name] = b
            else:
                from megatron_k3 import perf
                from megatron_k3.parallel.runtime import init_distributed

                init_distributed(layout, seed=0)  # the baselines' DDP and optimizer need megatron's state
                fn = {"seed": seed_baseline, "seed_compiledconv": seed_baseline, "gptmodel": gptmodel_baseline}[name]
                change = {"short_conv": "compiled"} if name == "seed_compiledconv" else {}
                b_, batches_ = (seed_b, seed_batches) if name.startswith("seed") else (B, batches)
                with perf.using(**change):
                    baselines[name] = fn(cfg, b_, S, M * B // b_, device, dtype, batches_, ns.warmup)
                from megatron.core import parallel_state as ps

                ps.destroy_model_parallel()
        except Exception as e:  # noqa: BLE001  (report, do not lose the K3 measurement)
            import traceback

            baselines[name] = {"error": f"{type(e).__name__}: {e}"[:500],
                               "where": traceback.format_exc().splitlines()[-6:]}
        if ns.out:
            with open(ns.out + ".partial", "w") as f:
                json.dump(baselines, f)
    info = model_info(cfg)
    med = k3["median_step_s"]
    tps = M * B * S / med
    fpt = flops_per_token(cfg, S, info["active_params"])
    launcher = ["torchrun", "--nproc-per-node", str(world)] if world > 1 else None
    rep = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "command": command_line("benchmarks/benchmark.py", launcher),
        "kernels": k3.pop("kernels"),  # the perf section's kernel choices this run had
        "preset": cfg.name, "params_total": info["total_params"], "params_active_no_embed": info["active_params"],
        "micro_batch_size": B, "global_batch_size": job.train.global_batch_size, "num_microbatches": M,
        "seq_length": S, "dtype": str(dtype).replace("torch.", ""),
        "world_size": world, "layout": layout.describe(), "tokens_per_s_all_gpus": world * tps,
        "recompute": job.perf.recompute_granularity, "fp8_recipe": job.perf.fp8_recipe,
        "build_and_init_s": k3["build_and_init_s"], "cuda_graph_impl": job.perf.cuda_graph_impl,
        "graph_capture_s": k3["graph_capture_s"], "layer_graph_replays": k3["layer_graph_replays"],
        "data": k3["data"],
        "step_times_s": k3["step_times_s"], "median_step_s": med, "tokens_per_s": tps,  # per GPU
        "trainer_loop": k3["trainer_loop"],
        "model_flops_per_token": fpt, "mfu_vs_989_tflops": tps * fpt / H200_BF16_DENSE if cuda else None,
        "peak_memory_gib": k3["peak_memory_gib"], "losses": k3["losses"], "breakdown": k3["breakdown"],
        "optimizer_timings": k3["optimizer_timings"], "optimizer_impl": k3["optimizer_impl"],
        "baselines": baselines, "transformer_engine": have_te(),
        "cudnn": _cudnn_report(),
    }
    if k3["trainer_loop"]:
        rep["trainer_loop_vs_train_step"] = k3["trainer_loop"]["median_step_s"] / med
    for name, b in baselines.items():
        if "median_step_s" in b:
            b["tokens_per_s"] = M * B * S / b["median_step_s"]
            b["mfu_vs_989_tflops"] = b["tokens_per_s"] * fpt / H200_BF16_DENSE if cuda else None
            rep[f"speedup_vs_{name}"] = b["median_step_s"] / med
    if rank == 0:
        write_report(rep, ns.out)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def k3_run(trainer, ns, rank: int, profile_path=None, trainer_loop: bool = True, profile: bool = True,
           trace_path=None) -> dict:
    """Set up ``trainer`` (the K3 model as the trainer builds it: per-rank init, DDP, optimizer, data, layer
    graphs), then time it two ways in this process, both through ``Trainer.train_step``:
    1. ``trainer_loop``: the trainer's own loop (``Trainer.fit``: data, step, metrics, logging) for
       ``warmup + steps`` steps, its per-step wall times (``step_time_s`` of metrics.jsonl) after the warm-up;
    2. the harness: ``warmup + steps`` more steps on the loader's next batches, the device synchronised
       around each ``train_step`` call; the median of these is the figure (``median_step_s``).
    On CUDA one more profiled step gives the breakdown. The model is released on return (the process group
    stays for the baselines); returns the measurement and the harness's micro-batches (for the baselines)."""
    from megatron_k3 import perf
    from megatron_k3.parallel.graphs import layer_graph_replays

    t0 = time.time()
    trainer.setup()
    build_s = time.time() - t0
    device = trainer.device
    cuda = device.type == "cuda"
    progress(f"K3 trainer set up in {build_s:.1f} s (model build and init {trainer.build_s:.1f} s, layer graphs: "
             f"{trainer.job.perf.cuda_graph_impl})")
    loop = None
    if trainer_loop and not ns.no_trainer_loop:
        recs = trainer.fit(max_steps=ns.warmup + ns.steps)
        if recs:
            st = [r["step_time_s"] for r in recs[ns.warmup:]]
            loop = {"steps": len(recs), "step_time_s": st, "median_step_s": statistics.median(st),
                    "losses": [r["loss"] for r in recs], "what": "Trainer.fit: per-step wall time of the loop "
                                                                "(data, train_step, metrics, logging)"}
            progress(f"trainer loop: median {loop['median_step_s']:.3f} s over {len(st)} steps")
    lr = trainer.lr_at(0)
    times, losses, batches, opt_timings = [], [], [], []
    for i in range(ns.warmup + ns.steps):
        micro = trainer.loader.next_step()
        batches.append([(m["tokens"], m["labels"]) for m in micro])
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        res = trainer.train_step(micro, lr)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t1
        losses.append(res.loss)
        if i >= ns.warmup:
            times.append(dt)
            if getattr(trainer.opt, "timings", None):  # the host-stream optimizer's own split of its step
                opt_timings.append(dict(trainer.opt.timings))
        progress(f"step {i}{' (warm-up)' if i < ns.warmup else ''}: {dt:.3f} s  loss {res.loss:.4f}")
    breakdown = None
    if profile and (profile_path or cuda):  # one extra, profiled step: where the device time goes
        from torch.profiler import ProfilerActivity, profile as torch_profile

        micro = trainer.loader.next_step()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=acts, record_shapes=cuda) as prof:
            t1 = time.perf_counter()
            trainer.train_step(micro, lr)
            if cuda:
                torch.cuda.synchronize()
            prof_wall = time.perf_counter() - t1
        if cuda:
            breakdown = {"profiled_step_wall_s": prof_wall, **kernel_breakdown(prof),
                         "idle_gaps": idle_gaps(*profile_intervals(prof))}
        if trace_path and cuda:
            progress(f"device timeline: {kernel_trace(prof, trace_path)} events -> {trace_path}")
        if profile_path:
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            with open(profile_path, "w") as f:
                f.write(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60))
    replays = layer_graph_replays(trainer.chunks)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    out = {"build_and_init_s": build_s, "graph_capture_s": trainer.graph_capture_s,
           "layer_graph_replays": replays, "step_times_s": times, "median_step_s": statistics.median(times),
           "losses": losses, "peak_memory_gib": peak, "breakdown": breakdown, "trainer_loop": loop,
           "optimizer_timings": opt_timings or None,
           "optimizer_impl": {"impl": getattr(trainer.opt, "impl", None),
                              "note": getattr(trainer.opt, "impl_note", None)},
           "kernels": vars(perf.current()), "batches": batches,
           "data": {"path": trainer.job.data.data_path, "windows": trainer.loader.num_windows}}
    trainer.close(destroy_process_group=False)
    del trainer
    gc.collect()  # the graphs' private pools and the model's cycles, before a baseline allocates
    return out


def progress(msg: str):
    """One timestamped line on stderr (the JSON report goes to stdout)."""
    r = f" rank {os.environ.get('RANK', '0')}" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"[benchmark{r} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def check_seed_micro_batch(ns, job) -> int:
    """The seed baselines' micro-batch size (``--seed-micro-batch-size``, default the trainer's); exits with one
    error line when it does not divide the sequences of a step (baselines run on one rank: ``main`` refuses them
    with several, so a step is the whole global batch)."""
    b = ns.seed_micro_batch_size or job.train.micro_batch_size
    n = job.train.global_batch_size
    if "seed" in ns.baselines and (b <= 0 or n % b):
        print(f"error: --seed-micro-batch-size {b} must be positive and divide the {n} sequences of a step "
              f"(the global batch)", file=sys.stderr)
        sys.exit(2)
    return b


def regroup(batches, b: int):
    """Each step's micro-batches (lists of (tokens, labels) [B, S]) as micro-batches of ``b`` sequences: the same
    tokens in the same order, so a baseline at another micro-batch size trains on exactly the K3 run's data."""
    out = []
    for micro in batches:
        tok = torch.cat([t for t, _ in micro])
        lab = torch.cat([y for _, y in micro])
        out.append(list(zip(tok.split(b), lab.split(b))))
    return out


def random_batches(vocab: int, B: int, S: int, M: int, n: int, seed: int = 0):
    """``n`` steps' data: each a list of ``M`` random (tokens, labels) micro-batches [B, S] on the CPU, the same in
    every run (``seed``: the rank)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        step = []
        for _ in range(M):
            t = torch.randint(0, vocab, (B, S + 1), generator=g)
            step.append((t[:, :-1], t[:, 1:]))
        out.append(step)
    return out


@contextlib.contextmanager
def patched_env(env: dict):
    """``os.environ`` updated with ``env`` inside the block, restored after it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def time_steps(step, batches, device, warmup: int):
    """Seconds per ``step(micro_batches)`` over ``batches`` (lists of (tokens, labels) CPU tensors, moved to
    ``device`` first), synchronised around each step, leaving out the first ``warmup``. Returns (times, the
    steps' outputs, the last step's micro-batches)."""
    cuda = device.type == "cuda"
    times, outs = [], []
    for i, micro in enumerate(batches):
        batch = [(tok.to(device), lab.to(device)) for tok, lab in micro]
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        outs.append(step(batch))
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t1
        if i >= warmup:
            times.append(dt)
        progress(f"step {i}{' (warm-up)' if i < warmup else ''}: {dt:.3f} s")
    return times, outs, batch


def _cudnn_report() -> dict:
    """Which cuDNN this process runs (``megatron_k3/cudnn.py``: torch's, loaded before TE) and the libraries mapped."""
    from megatron_k3 import cudnn

    try:
        version = torch.backends.cudnn.version()
    except Exception as e:  # noqa: BLE001  (the version-mismatch error TE's system cuDNN caused)
        version = f"error: {e}"[:300]
    return {"version": version, "megatron_k3": cudnn.status(),
            "mapped": [os.path.basename(m) for m in cudnn._mapped_cudnn()]}


def command_line(script: str, launcher: list[str] | None = None) -> str:
    """The command that reruns this process (the launcher, ``script`` and its arguments)."""
    return " ".join((launcher or ["python"]) + [script] + sys.argv[1:])


def write_report(rep: dict, out: str | None):
    """Print the report as JSON and write it to ``out`` when given."""
    txt = json.dumps(rep, indent=1)
    print(txt)
    if out:
        with open(out, "w") as f:
            f.write(txt + "\n")


def megatron_step(ddp, opt, forward_step, B: int, S: int):
    """One training step of a DDP-wrapped megatron model over a list of (tokens, labels) micro-batches through
    megatron's schedule (gradients accumulated in ``main_grad``, one optimizer step); returns the schedule's
    loss dicts (``lm_sum``, ``n``, ...), one per micro-batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fb = get_forward_backward_func()

    from torch.profiler import record_function

    def annotated_forward_step(data_iterator, model):
        with record_function("k3.forward"):
            return forward_step(data_iterator, model)

    def step(micro_batches):  # the k3.* ranges name the host phases for the profiled step's idle_gaps
        with record_function("k3.zero_grad"):
            ddp[0].zero_grad_buffer()
            opt.zero_grad()
        data = iter([{"tokens": t, "labels": y} for t, y in micro_batches])
        with record_function("k3.forward_backward"):
            out = fb(forward_step_func=annotated_forward_step, data_iterator=data, model=ddp[0],
                     num_microbatches=len(micro_batches), seq_length=S, micro_batch_size=B, forward_only=False)
        with record_function("k3.optimizer_step"):
            opt.step()
        return out  # megatron's per-micro-batch loss dicts

    return step


def have_te() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
        return True
    except Exception:  # noqa: BLE001  (ImportError, or a TE build that does not load)
        return False


# apply_rope_fusion is left out: megatron 0.19.2 refuses it for MLA with plain RoPE ("apply_rope_fusion for
# MLA only works with YARN RoPE", measured on the H200 2026-12-01)
GPTMODEL_FUSIONS = dict(gradient_accumulation_fusion=True, moe_permute_fusion=True, moe_router_fusion=True,
                        cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")


def gptmodel_config(cfg, dtype, te: bool, cuda: bool, fusions: bool = True):
    """megatron-core ``MLATransformerConfig`` at the K3 config's width, depth, heads, MLA ranks, experts
    (sigmoid top-k with expert bias, shared experts, the same dense-first layers) and vocabulary: what a
    user would train instead. SwiGLU and RoPE MLA (megatron's own), no KDA, no AttnRes. With Transformer
    Engine: TE spec, grouped-GEMM experts and the latent MoE projections; without it the local spec
    (sequential experts, no latent projections: megatron requires TE for them; SDPA core attention).
    ``fusions`` (TE only): the fused paths Megatron-LM recipes turn on (``GPTMODEL_FUSIONS``: wgrad
    accumulation into main_grad, MoE permute and router fusion, TE's fused cross-entropy)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    L = cfg.num_hidden_layers
    freq = [0 if i < cfg.first_k_dense_replace else 1 for i in range(L)]
    kw = dict(num_layers=L, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
              ffn_hidden_size=cfg.intermediate_size, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
              add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0,
              attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
              q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
              qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_type="rope",
              use_cpu_initialization=not cuda, bias_activation_fusion=te, masked_softmax_fusion=te,
              apply_rope_fusion=False)
    if te and cuda and fusions:
        kw.update(GPTMODEL_FUSIONS)
        # megatron's output layer (a plain ColumnParallelLinear) needs apex's fused_weight_gradient_mlp_cuda
        # for wgrad accumulation fusion (RuntimeError without it, measured on the H200 2026-12-01)
        import importlib.util

        kw["gradient_accumulation_fusion"] = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    if cfg.num_experts > 0:
        kw.update(num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                  moe_router_topk=cfg.num_experts_per_token, moe_layer_freq=freq,
                  moe_shared_expert_intermediate_size=(cfg.num_shared_experts * cfg.moe_intermediate_size or None),
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_token_dispatcher_type="alltoall", moe_grouped_gemm=te)
        if te and cfg.routed_expert_hidden_size:
            kw["moe_latent_size"] = cfg.routed_expert_hidden_size
    return MLATransformerConfig(**kw)


class SDPACoreAttention(torch.nn.Module):
    """Causal ``F.scaled_dot_product_attention`` with megatron's core-attention interface, for the no-TE
    GPTModel baseline: megatron 0.19.2's local ``DotProductAttention`` does not take MLA's separate
    ``k_channels``/``v_channels`` (TypeError), so without TE its MLA spec cannot be built as shipped."""

    def __init__(self, config=None, layer_number=None, attn_mask_type=None, attention_type=None,
                 softmax_scale=None, k_channels=None, v_channels=None, **kw):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, q, k, v, attention_mask=None, **kw):  # [S, B, H, D] each
        import torch.nn.functional as F

        o = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                           scale=self.softmax_scale)
        S, B = q.shape[0], q.shape[1]
        return o.permute(2, 0, 1, 3).reshape(S, B, -1)


def gptmodel_baseline(cfg, B, S, M, device, dtype, batches, warmup):
    """megatron-core ``GPTModel`` of the same shape, trained through the same DDP, optimizer and schedule
    as the K3 model (see ``gptmodel_config``): with its fusions on when TE is there; if that build or run
    fails, without them (the error is kept in the result)."""
    fused = have_te() and device.type == "cuda"
    if fused:
        try:
            return _gptmodel_run(cfg, B, S, M, device, dtype, batches, warmup, fusions=True)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"[:400]
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            rec = _gptmodel_run(cfg, B, S, M, device, dtype, batches, warmup, fusions=False)
            rec["fusions_error"] = err
            return rec
    return _gptmodel_run(cfg, B, S, M, device, dtype, batches, warmup, fusions=False)


def _gptmodel_run(cfg, B, S, M, device, dtype, batches, warmup, fusions: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_k3.parallel.runtime import build_optimizer, wrap_ddp

    cuda = device.type == "cuda"
    te = have_te()
    tc = gptmodel_config(cfg, dtype, te, cuda, fusions=fusions)
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=te)
    if not te:
        for ls in spec.layer_specs:
            ls.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(tc, spec, vocab_size=cfg.vocab_size, max_sequence_length=S, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    if dtype != torch.float32:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(tc, model)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    from megatron.core.distributed import finalize_model_grads

    ddp = wrap_ddp([model], tc, finalize_grads=finalize_model_grads)  # what Megatron-LM's pretrain_gpt sets
    opt = build_optimizer(ddp, lr=1e-4, bf16=dtype == torch.bfloat16)
    pos = torch.arange(S, device=device).unsqueeze(0).expand(B, S)

    def fwd(data_iterator, m):
        b = next(data_iterator)
        out = m(b["tokens"], pos, None, labels=b["labels"])
        return out, lambda o: (o.float().mean(), {})

    times, _, _ = time_steps(megatron_step(ddp, opt, fwd, B, S), batches, device, warmup)
    return {"what": f"megatron-core GPTModel, {'TE spec, grouped-GEMM experts, latent MoE' if te else 'local spec (no TE)'}"
                    f", MLA (RoPE) + SwiGLU, same width/depth/heads/experts/vocab, same DDP + optimizer, "
                    "megatron's finalize_model_grads",
            "transformer_engine": te, "fusions": GPTMODEL_FUSIONS if (te and cuda and fusions) else None,
            "params": n_params, "step_times_s": times,
            "median_step_s": statistics.median(times),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}


# What a device kernel does, by its name: the first kind whose pattern matches (lower-case, re.search)
KERNEL_KINDS = [("short_conv_fla", r"causal_conv1d"),
                ("kda_fla", r"chunk_kda|chunk_gated|kda|fused_recurrent|solve_tril|wy_|chunk_fwd|chunk_bwd|"
                            r"chunk_local"),
                ("attention", r"flash|fmha|cudnn|attention|sdpa"),
                ("gemm", GEMM_KERNELS),
                # FP8 recipes' quantisation (TE's cast/transpose/amax kernels, torchao's compiled amax/scale/cast);
                # a bf16 step's share here is its own clamps, the noise floor of this group
                ("fp8_quant", r"amax|abs_max|float8|fp8|e4m3|cast_transpose|quantize|compute_scale|clamp"),
                ("optimizer", r"adam|multi_tensor|foreach|l2norm"),
                ("situ_triton", r"situ"),
                ("norm_reduce", r"reduce|norm|softmax|logsumexp"),
                ("copy_cat", r"copy|cat|memcpy|memset|index|gather|scatter|fill"),
                ("elementwise", r"elementwise|vectorized|unrolled|triton_")]


def kernel_kind(name: str) -> str:
    """The breakdown's kind of one device kernel (``KERNEL_KINDS``, in order; "other" when none matches)."""

    name = name.lower()
    return next((k for k, rx in KERNEL_KINDS if re.search(rx, name)), "other")


def kernel_breakdown(prof, top_n: int = 10, top_ops: int = 25) -> dict:
    """Self device time of one profiled step, grouped by what the kernels do (names matched in order), with
    the ``top_n`` kernels of each kind (time and launch count) and the step's number of kernel launches.
    Profiler ranges shown on the device timeline (``Optimizer.step#...``: user annotations) are not kernels
    and are left out (they would count the kernels inside them twice). ``top_ops``: the aten operators that
    launched the most device time, by input shapes (the profile records shapes; kernels replayed from a CUDA
    graph have no operator and are not in this list)."""
    out = {k: 0.0 for k, _ in KERNEL_KINDS}
    out["other"] = 0.0
    kernels = {k: [] for k in out}  # kind -> [(seconds, calls, name)]
    for e in prof.key_averages():
        t = kernel_device_us(e)
        if not t:
            continue
        kind = kernel_kind(e.key)
        out[kind] += t / 1e6
        kernels[kind].append((t / 1e6, e.count, e.key[:90]))
    total = sum(out.values())
    top = {k: [{"s": round(t, 5), "calls": c, "kernel": n} for t, c, n in sorted(v, reverse=True)[:top_n]]
           for k, v in kernels.items() if v}
    ops = []
    for e in prof.key_averages(group_by_input_shape=True):
        t = _self_device_us(e)
        if t and e.device_type.name == "CPU" and e.key.startswith("aten::"):
            ops.append((t / 1e6, e.count, e.key, str(getattr(e, "input_shapes", ""))[:160]))
    return {"device_busy_s": total, "by_kind_s": {k: round(v, 5) for k, v in out.items()},
            "kernel_launches": sum(c for v in kernels.values() for _, c, _ in v), "top_by_kind": top,
            "top_ops": [{"s": round(t, 5), "calls": c, "op": n, "shapes": sh}
                        for t, c, n, sh in sorted(ops, reverse=True)[:top_ops]]}


def idle_stretches(items, start, end) -> list:
    """``(duration, before, after)`` for every stretch in which none of ``items`` (sorted by ``start``) runs:
    ``before`` is the item that ended last before it, ``after`` the one that starts it (all streams together).
    Shared by ``idle_gaps`` and ``trace_gaps.py``."""
    out, last = [], None
    for x in items:
        if last is not None and start(x) > end(last):
            out.append((start(x) - end(last), last, x))
        if last is None or end(x) >= end(last):
            last = x
    return out


def idle_gaps(kernels, ranges, launches=None, top_n: int = 12) -> dict:
    """Where the device waits for the host within one profiled step. ``kernels``: (start_us, end_us, name) or
    (start_us, end_us, name, launch_id) of every device kernel/copy, ``launch_id`` the correlation id of the
    host call that launched it (a graph launch launches all kernels of the graph); ``ranges``: (start_us,
    end_us, name) of the host's ``k3.*`` phase annotations (``megatron_step``); ``launches``: launch_id ->
    (host start_us, name of the runtime call) (``profile_intervals``). Between the first kernel's start and
    the last kernel's end, every stretch with no kernel running is idle; each is charged to the innermost
    phase whose host range covers its midpoint (``backward`` for ``k3.forward_backward`` outside
    ``k3.forward``; ``unannotated`` when none does) and, with launch ids, to a cause:
    ``in_launch`` (both kernels came from the same host call: a gap inside a replayed CUDA graph),
    ``host_late`` (the next kernel's launch call started only after the device had gone idle: host-bound),
    ``device_wait`` (it was launched before: the device waited on a dependency or the launch's own latency),
    ``unknown`` (no launch id). Returns the idle total, idle per phase and per cause, the ``top_n`` longest
    gaps with the kernels on either side, and ``by_pair``: the ``top_n`` (phase, cause, kernel before, kernel
    after) kinds of gap with the most idle time in all (count and total: many short gaps of one kind can cost
    more than the longest ones)."""
    ks = sorted(k if len(k) == 4 else (*k, None) for k in kernels)
    launches = launches or {}
    if not ks:
        return {"idle_s": 0.0, "by_phase_s": {}, "by_cause_s": {}, "longest": [], "by_pair": []}
    gaps = []
    for dur, (_, end, prev, prev_launch), (a, _, name, launch) in idle_stretches(ks, lambda k: k[0], lambda k: k[1]):
        if launch is not None and launch == prev_launch:
            cause = "in_launch"
        elif launch in launches:  # (launches has no None key)
            cause = "host_late" if launches[launch][0] >= end else "device_wait"
        else:
            cause = "unknown"
        gaps.append((dur, end, a, prev, name, cause))
    names = {"k3.forward_backward": "backward"}

    def phase(t):
        cover = [r for r in ranges if r[0] <= t <= r[1]]
        if not cover:
            return "unannotated"
        inner = max(cover, key=lambda r: r[0])[2]  # ranges nest: the latest-starting one is the innermost
        return names.get(inner, inner.removeprefix("k3."))

    by_phase, by_cause, by_pair = {}, {}, {}
    longest = []
    for dur, a, b, before, after, cause in gaps:
        ph = phase((a + b) / 2)
        by_phase[ph] = by_phase.get(ph, 0.0) + dur / 1e6
        by_cause[cause] = by_cause.get(cause, 0.0) + dur / 1e6
        longest.append({"us": round(dur, 1), "phase": ph, "cause": cause, "after_kernel": before[:70],
                        "before_kernel": after[:70]})
        key = (ph, cause, before[:70], after[:70])
        n, t = by_pair.get(key, (0, 0.0))
        by_pair[key] = (n + 1, t + dur)
    longest.sort(key=lambda g: -g["us"])
    pairs = sorted(by_pair.items(), key=lambda kv: -kv[1][1])[:top_n]

    def desc(d):
        return {k: round(v, 6) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    return {"idle_s": round(sum(g[0] for g in gaps) / 1e6, 6), "by_phase_s": desc(by_phase),
            "by_cause_s": desc(by_cause), "longest": longest[:top_n],
            "by_pair": [{"us_total": round(t, 1), "count": n, "phase": ph, "cause": c, "after_kernel": k0,
                         "before_kernel": k1} for (ph, c, k0, k1), (n, t) in pairs]}


def profile_intervals(prof):
    """(kernels, ranges, launches) for ``idle_gaps`` from a finished ``torch.profiler.profile``: each kernel
    with the correlation id of the host call that launched it, and those host calls (``cudaLaunchKernel``,
    ``cudaGraphLaunch``, ``cuLaunchKernelEx``, ...) by correlation id. A device event's ``id`` is its CUPTI
    correlation id, the same as the runtime call that launched it (for a graph replay, the ``cudaGraphLaunch``).
    (``linked_correlation_id``, the CPU operator's id, is not used: ``FunctionEvent`` gained it in 2026,
    pytorch PR #177662, and the 2026-12-04 profile on the lent machines' torch 2.11 had every gap's cause
    ``unknown``, which is what a missing attribute gives.)"""
    kernels, ranges, cpu = [], [], {}
    for e in prof.events():
        tr = e.time_range
        if is_device_kernel(e, e.name):
            kernels.append((tr.start, tr.end, e.name, e.id or None))
        elif e.device_type.name != "CUDA":
            if e.name.startswith("k3."):
                ranges.append((tr.start, tr.end, e.name))
            if e.name.startswith("cu") or e.id not in cpu:  # the runtime/driver call wins an id clash
                cpu[e.id] = (tr.start, e.name)
    ids = {k[3] for k in kernels if k[3] is not None}
    return kernels, ranges, {i: cpu[i] for i in ids if i in cpu}


TRACE_CATS = {"kernel": "k", "gpu_memcpy": "c", "gpu_memset": "s", "cuda_runtime": "r", "cuda_driver": "r",
              "user_annotation": "a"}


def kernel_trace(prof, path: str) -> int:
    """Write the device side of a finished ``torch.profiler.profile`` to ``path`` (gzip JSON) for offline study of
    the step's idle gaps (``benchmarks/trace_gaps.py``): torch's Chrome trace filtered to kernels, copies and
    memsets (start, duration, name, stream, launch id, grid, block, shared memory, registers), the runtime and
    driver calls (start, duration, name, launch id) and the ``k3.*`` host ranges. Names are interned (45k kernels of
    a k3-mini step are ~2 MB compressed). Returns the number of events written."""
    import gzip

    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        with open(tmp) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(tmp)
    names, index, rows = [], {}, {"k": [], "c": [], "s": [], "r": [], "a": []}

    def nid(n):
        if n not in index:
            index[n] = len(names)
            names.append(n)
        return index[n]

    for e in events:
        kind = TRACE_CATS.get(e.get("cat"))
        if kind is None or e.get("ph") != "X":
            continue
        a = e.get("args", {})
        if kind == "a" and not e["name"].startswith("k3."):
            continue
        row = [round(float(e["ts"]), 3), round(float(e.get("dur", 0)), 3), nid(e["name"])]
        if kind in "kcs":
            row += [a.get("stream"), a.get("correlation"), a.get("grid"), a.get("block"),
                    a.get("shared memory"), a.get("registers per thread")]
        elif kind == "r":
            row += [a.get("correlation")]
        rows[kind].append(row)
    doc = {"format": "k3 kernel_trace v1: k/c/s = kernel/copy/memset [ts_us, dur_us, name, stream, correlation, "
                     "grid, block, shared_memory, registers]; r = runtime/driver call [ts_us, dur_us, name, "
                     "correlation]; a = k3.* host range [ts_us, dur_us, name]", "names": names, **rows}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f, separators=(",", ":"))
    return sum(len(v) for v in rows.values())


def _self_device_us(e) -> float:
    """A profiler average's self device time in microseconds (``self_cuda_time_total`` in older torch)."""
    t = getattr(e, "self_device_time_total", None)
    return getattr(e, "self_cuda_time_total", 0.0) if t is None else t


ANNOTATION = re.compile(r"[\w.:/-]+#[\w.:/-]*")  # ``Optimizer.step#AdamW.step``: no spaces or brackets


def is_device_kernel(e, name: str) -> bool:
    """Whether a profiler event or average (``name``: its name or key) is a device kernel or copy: ranges shown
    on the device timeline (user annotations such as ``Optimizer.step#AdamW.step``, ``ProfilerStep#3`` and
    ``megatron_step``'s ``k3.*`` phases) are not, and would count the kernels inside them twice.

    A ``#`` alone does not make an annotation: aten's templated kernels carry it in their lambdas
    (``elementwise_kernel<128, 4, ...direct_copy_kernel_cuda(...)::{lambda()#3}...>``). Until 2026-12-07 this test
    dropped every name with a ``#``: 0.193 s of copies, casts, fp32 adds, sums and flips per k3-mini step on an
    H100 went missing from ``breakdown`` and showed up as idle time (``benchmarks/README.md``)."""
    if e.device_type.name != "CUDA" or getattr(e, "is_user_annotation", False) or name.startswith("k3."):
        return False
    return not ANNOTATION.fullmatch(name)


def kernel_device_us(e) -> float:
    """``_self_device_us`` of a profiler average that is a device kernel (``is_device_kernel``), else 0."""
    return _self_device_us(e) if is_device_kernel(e, e.key) else 0.0


def seed_baseline(cfg, B, S, M, device, dtype, batches, warmup):
    """The golden model trained the way a careful single-GPU user would (see the module docstring), accumulating
    the gradients of ``M`` micro-batches per step, on the K3 run's ``batches``."""
    from megatron_k3.model import K3ForCausalLM

    model = K3ForCausalLM(cfg, seed=0)
    if dtype != torch.float32:
        model.to_compute_dtype(dtype)
    model.to(device).train()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)
    def step(micro_batches):
        for tokens, labels in micro_batches:
            (model(tokens, labels)["loss"] / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, _, _ = time_steps(step, batches, device, warmup)
    from megatron_k3 import perf

    glue = "compiled glue (AttnRes, norms, gates, short convs)" if perf.current().compile != "off" else "eager"
    return {"what": "golden K3ForCausalLM, bf16 weights, fla chunk_kda (CUDA), grouped-GEMM experts, chunked CE, "
                    f"fused AdamW, {glue}", "micro_batch_size": B, "num_microbatches": M,
            "step_times_s": times, "median_step_s": statistics.median(times),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None}


if __name__ == "__main__":
    main()
