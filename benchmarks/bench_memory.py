#!/usr/bin/env python3
"""Memory benchmark of the streaming SiTU-GLU op and the host-streamed optimizer offload; prints JSON.

    python benchmarks/bench_memory.py --out R.json                 # all parts (GPU: k3-mini shapes)
    python benchmarks/bench_memory.py --parts op,offload --op-rows 8192 --offload-params 16e6   # CPU sizes

Parts:
- ``op``: SiTU-GLU at k3-mini shapes (routed experts grouped: rows = micro-batch x seq x top-k over
  [R, 2 x 512]; one expert's share [R / 40, 2 x 512]; the dense layer 0 [tokens, 2 x 4864]), bf16.
  Saved-activation bytes of the op vs the reference ``situ_glu`` measured with autograd saved-tensor hooks
  (distinct storages); fwd+bwd time of the reference (eager, and ``torch.compile``d where a compiler
  works), and of the op; peak and retained memory per FFN layer (fc1 -> activation -> fc2, a stack of
  ``--op-layers`` layers, device memory on CUDA: ``max_memory_allocated``; on CPU the process's peak RSS,
  VmHWM); the op's error against the reference.
- ``offload``: per optimizer, in a fresh process each: a synthetic model of ``--offload-params`` bf16
  parameters in megatron's DDP (fp32 grad buffer, random gradients), the host memory growth (VmRSS/VmHWM
  from /proc/self/status, before building the optimizer to after 3 steps) per parameter, device memory
  growth per parameter and the step time: megatron's Adam (on the device: on CPU that is host memory),
  the host stream with bf16 and fp32 moments, megatron's ``HybridDeviceOptimizer`` (offload fraction 1,
  fp32 updates; needs CUDA).
- ``train``: k3-mini (``--train-preset``) full training steps (forward, backward, optimizer) with
  megatron's on-device Adam and with the host-stream offload in the same process; step-time overhead.
"""
import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time


import torch  # noqa: E402

from megatron_k3.train import launch_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timeit(fn, iters=10, warmup=3, repeats=5):
    """Median seconds per call (CUDA: events around ``iters`` calls; CPU: perf_counter)."""
    for _ in range(warmup):
        fn()
    _sync()
    out = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3 / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t) / iters)
    return statistics.median(out)


def _graph_timeit(fn, iters=10, repeats=5):
    """Median device seconds per call of ``fn`` replayed as one CUDA graph (no host/launch overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _timeit(graph.replay, iters=iters, warmup=2, repeats=repeats)


def saved_bytes(fn, *inputs, exclude=()):
    """Bytes of distinct storages autograd saves for backward during ``fn(*inputs)``; parameters (and views
    of the tensors in ``exclude``, e.g. a transposed weight) are not activations and not counted."""
    seen, total = set(), [0]
    skip = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in seen and not isinstance(t, torch.nn.Parameter) and st.data_ptr() not in skip:
            seen.add(key)
            total[0] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(*inputs)
    del y
    return total[0]


# ---------------------------------------------------------------------------------------------------------
def bench_op(args, device):
    from megatron_k3.model.situ import situ_glu, situ_glu_stream
    from megatron_k3.optim.offload import proc_status_bytes, reset_peak_rss

    cuda = device.type == "cuda"
    R = args.op_rows
    shapes = {"experts_grouped": (R, 2 * 512), "one_expert": (max(1, R // 40), 2 * 512),
              "dense_layer0": (max(1, R // 4), 2 * 4864)}
    naive_c = None
    compile_note = None
    if not args.no_compile:
        try:
            naive_c = torch.compile(situ_glu)
            x = torch.randn(64, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
            naive_c(x).sum().backward()
        except Exception as e:  # noqa: BLE001 - report why (e.g. no C++ compiler for inductor on CPU)
            naive_c, compile_note = None, f"torch.compile unavailable: {type(e).__name__}: {str(e)[:200]}"
    out = {"rows_note": "experts_grouped rows = micro-batch 4 x seq 4096 x top-4 at the default --op-rows 65536",
           "compile_note": compile_note, "shapes": {}}
    g = torch.Generator(device=device).manual_seed(0)
    for name, (r, w) in shapes.items():
        x = (torch.randn(r, w, device=device, generator=g) * 4).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(r, w // 2, device=device, generator=g).to(torch.bfloat16)
        rec = {"shape": [r, w], "dtype": "bfloat16"}
        rec["saved_bytes_naive"] = saved_bytes(situ_glu, x)
        rec["saved_bytes_stream"] = saved_bytes(situ_glu_stream, x)
        rec["saved_ratio"] = rec["saved_bytes_stream"] / rec["saved_bytes_naive"]
        # accuracy vs the reference (bf16 in/out) and vs an fp64 evaluation
        x0 = x.detach().clone().requires_grad_()
        y0 = situ_glu(x0)
        y0.backward(dy)
        x1 = x.detach().clone().requires_grad_()
        y1 = situ_glu_stream(x1)
        y1.backward(dy)
        xd = x.detach().double().requires_grad_()
        yd = situ_glu(xd)
        yd.backward(dy.double())
        y0, y1, yd = y0.detach(), y1.detach(), yd.detach()
        rec["max_abs_diff_vs_naive"] = {"out": float((y1.float() - y0.float()).abs().max()),
                                        "grad": float((x1.grad.float() - x0.grad.float()).abs().max())}
        rec["max_rel_err_vs_fp64"] = {
            "stream_out": float((y1.double() - yd).abs().max() / yd.abs().max()),
            "naive_out": float((y0.double() - yd).abs().max() / yd.abs().max()),
            "stream_grad": float((x1.grad.double() - xd.grad).abs().max() / xd.grad.abs().max()),
            "naive_grad": float((x0.grad.double() - xd.grad).abs().max() / xd.grad.abs().max())}
        del x0, x1, y0, y1, xd, yd

        def run(fn, leaf=None):
            leaf = x if leaf is None else leaf

            def f():
                leaf.grad = None
                fn(leaf).backward(dy)
            return f

        iters = args.op_iters if cuda else 2
        rec["fwd_bwd_s"] = {"naive_eager": _timeit(run(situ_glu), iters=iters, repeats=5 if cuda else 2, warmup=2),
                            "stream": _timeit(run(situ_glu_stream), iters=iters, repeats=5 if cuda else 2, warmup=2)}
        if naive_c is not None:
            rec["fwd_bwd_s"]["naive_compiled"] = _timeit(run(naive_c), iters=iters, repeats=5 if cuda else 2,
                                                         warmup=3)
            rec["stream_vs_compiled"] = rec["fwd_bwd_s"]["stream"] / rec["fwd_bwd_s"]["naive_compiled"]
        if cuda:
            # The same fwd+bwd replayed as a CUDA graph: device time only. Small shapes above are bound by the
            # host (autograd + launches, ~0.35 ms per fwd+bwd for every variant), which hides the kernels.
            variants = {"naive_eager": situ_glu, "stream": situ_glu_stream}
            if naive_c is not None:
                variants["naive_compiled"] = naive_c
            rec["fwd_bwd_graph_s"], rec["graph_errors"] = {}, {}
            for key, fn in variants.items():
                try:
                    # a fresh leaf: x's AccumulateGrad node, kept alive from the runs above, sits on the
                    # default stream and would invalidate the capture (measured on the first shape)
                    leaf = x.detach().clone().requires_grad_()
                    rec["fwd_bwd_graph_s"][key] = _graph_timeit(run(fn, leaf), iters=iters)
                    del leaf
                except Exception as e:  # noqa: BLE001 - record why one variant failed, keep the others
                    rec["graph_errors"][key] = f"{type(e).__name__}: {str(e)[:300]}"
            gt = rec["fwd_bwd_graph_s"]
            if "stream" in gt and "naive_compiled" in gt:
                rec["graph_stream_vs_compiled"] = gt["stream"] / gt["naive_compiled"]
        rec["stream_vs_eager"] = rec["fwd_bwd_s"]["stream"] / rec["fwd_bwd_s"]["naive_eager"]
        if cuda:  # bytes moved by the op (fwd: read x, write y; bwd: read x + dy, write dx)
            moved = 2 * (r * w + r * w // 2) + 2 * (r * w + r * w // 2 + r * w)
            rec["stream_effective_GBps"] = moved / rec["fwd_bwd_s"]["stream"] / 1e9
            if "stream" in rec["fwd_bwd_graph_s"]:
                rec["stream_graph_effective_GBps"] = moved / rec["fwd_bwd_graph_s"]["stream"] / 1e9
        x.grad = None
        del x, dy
        gc.collect()
        out["shapes"][name] = rec

    # peak / retained memory per FFN layer (expert grouped shape: latent 512 -> 2 x 512 -> 512)
    L, D, F = args.op_layers, 512, 512
    r = shapes["experts_grouped"][0]
    layers = [(torch.nn.Linear(D, 2 * F, bias=False), torch.nn.Linear(F, D, bias=False)) for _ in range(L)]
    layers = [(a.to(device, torch.bfloat16), b.to(device, torch.bfloat16)) for a, b in layers]
    per_layer = {}
    for name, act in (("stream", situ_glu_stream), ("naive", situ_glu)):  # stream first: RSS on CPU only grows
        xin = torch.randn(r, D, device=device, dtype=torch.bfloat16, requires_grad=True)

        def stack(t):
            for a, b in layers:
                t = b(act(a(t)))
            return t

        weights = [m.weight for ab in layers for m in ab]
        per_layer_saved = saved_bytes(stack, xin, exclude=weights) / L   # measured with the hooks (forward only)
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            reset_peak_rss()
            base = proc_status_bytes("VmRSS")
        h = stack(xin)
        if cuda:
            torch.cuda.synchronize()
            after_fwd = torch.cuda.memory_allocated() - base
        else:
            after_fwd = proc_status_bytes("VmRSS") - base
        h.float().sum().backward()
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = proc_status_bytes("VmHWM") - base
        per_layer[name] = {"saved_bytes_per_layer": per_layer_saved,
                           "retained_after_forward_bytes_per_layer": after_fwd / L, "peak_bytes_per_layer": peak / L}
        del h, xin
        for a, b in layers:
            a.weight.grad = b.weight.grad = None
    out["ffn_layer_memory"] = {"what": f"{L} stacked FFN layers [{r}, {D}] -> [{r}, {2 * F}] -> act -> [{r}, {D}], "
                                       "bf16, fwd+bwd; " + ("CUDA max_memory_allocated" if cuda else
                                                            "CPU: process RSS/VmHWM (allocator-dependent)"),
                               **per_layer}
    return out


# ---------------------------------------------------------------------------------------------------------
def _offload_worker(mode, n_params, steps, out_path, chunk_bytes):
    """One optimizer in a fresh process: host/device memory growth per parameter and step time."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29761"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_k3.parallel.layout import ParallelLayout
    from megatron_k3.parallel.runtime import build_optimizer, destroy, init_distributed
    from megatron_k3.optim.offload import build_host_stream_optimizer, proc_status_bytes, reset_peak_rss

    device = init_distributed(ParallelLayout(), seed=0)
    cuda = device.type == "cuda"
    width = 4096 if n_params >= 256e6 else 1024
    nl = max(1, round(n_params / width ** 2))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, device=device, dtype=torch.bfloat16)
                                  for _ in range(nl)])
    n = sum(p.numel() for p in model.parameters())
    tc = TransformerConfig(num_layers=1, hidden_size=width, num_attention_heads=1, params_dtype=torch.bfloat16,
                           bf16=True)
    ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    for b in ddp.buffers:
        b.grad_data.normal_(0, 1e-3)
    kernel_load = None
    if mode.startswith("host-stream"):
        # the one-pass update kernel is a shared library with its own OpenMP runtime, loaded and bit-checked
        # once per process: a fixed cost, measured here on its own so the window below holds the optimizer
        from megatron_k3.optim import host_kernel

        r0 = proc_status_bytes("VmRSS")
        try:
            host_kernel.load()
            kernel_load = proc_status_bytes("VmRSS") - r0
        except host_kernel.KernelUnavailable as e:
            kernel_load = f"not used: {e}"
    gc.collect()
    _sync()
    rss0 = proc_status_bytes("VmRSS")
    peak_reset = reset_peak_rss()
    dev0 = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    extra = {}
    if mode == "device-adam":
        opt = build_optimizer([ddp], lr=1e-4, bf16=True)
    elif mode in ("host-stream", "host-stream-fp32-moments"):
        opt = build_host_stream_optimizer([ddp], lr=1e-4, bf16=True, chunk_bytes=chunk_bytes,
                                          moments_dtype=torch.float32 if mode.endswith("moments") else torch.bfloat16)
        extra = {"fixed_buffer_bytes": opt.fixed_buffer_bytes, "state_bytes": opt.state_bytes, "impl": opt.impl,
                 "chunk_elems": opt.chunk_elems}
    elif mode == "host-stream-check":  # GPU streaming path vs one fused AdamW step on the GPU (fp32)
        params = list(model.parameters())
        ref_p = [p.detach().float().clone() for p in params]
        ref_g = [p.main_grad.detach().clone() for p in params]
        opt = build_host_stream_optimizer([ddp], lr=1e-4, bf16=True, chunk_bytes=chunk_bytes, weight_decay=0.1)
        ok, gn, _ = opt.step()
        _sync()
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in ref_g)).item()
        c = 1.0 / (norm + 1e-6)
        gs = [g * c for g in ref_g] if c < 1 else ref_g
        ms, vs = [torch.zeros_like(p) for p in ref_p], [torch.zeros_like(p) for p in ref_p]
        torch._fused_adamw_(ref_p, gs, ms, vs, [], [torch.ones((), device=device)] * len(ref_p), lr=1e-4,
                            beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        diff = sum(int((p.detach() != r.to(p.dtype)).sum()) for p, r in zip(params, ref_p))
        ulps = max(float(((p.detach().float() - r.to(p.dtype).float()).abs()
                          / r.abs().clamp(min=1e-30)).max()) for p, r in zip(params, ref_p))
        st = opt.param_states()["params"]
        rec = {"mode": mode, "params": n, "grad_norm_offload": gn, "grad_norm_fp64": norm,
               "bf16_weights_differing_frac": diff / n, "bf16_weights_max_rel_diff": ulps,
               "master_vs_ref_max_abs": max(float((st[k]["master"].to(device) - r).abs().max())
                                            for (k, _), r in zip(model.named_parameters(), ref_p))}
        with open(out_path, "w") as f:
            json.dump(rec, f)
        destroy()
        return
    elif mode == "hybrid":
        if not cuda:
            raise SystemExit("hybrid needs CUDA (HybridDeviceOptimizer offloads CUDA parameters)")
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

        params = list(model.parameters())
        for p in params:
            p.decoupled_grad = p.main_grad
        opt = HybridDeviceOptimizer([{"params": params}], offload_fraction=1.0,
                                    cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW,
                                    param_update_in_fp32=True, overlap_cpu_optimizer_d2h_h2d=True,
                                    pin_cpu_grads=True, pin_cpu_params=True, lr=1e-4, weight_decay=0.1,
                                    betas=(0.9, 0.95), eps=1e-8, fused=True)
    else:
        raise SystemExit(f"unknown mode {mode}")
    build_s = time.perf_counter() - t0
    times = []
    for i in range(steps + 1):
        _sync()
        t = time.perf_counter()
        opt.step()
        _sync()
        if i:
            times.append(time.perf_counter() - t)
    gc.collect()
    rec = {"mode": mode, "params": n, "build_s": build_s, "step_s": statistics.median(times),
           "host_bytes_per_param_end": (proc_status_bytes("VmRSS") - rss0) / n,
           "host_bytes_per_param_peak": (proc_status_bytes("VmHWM") - rss0) / n if peak_reset else None,
           "device_bytes_per_param_end": (torch.cuda.memory_allocated() - dev0) / n if cuda else None,
           "device_bytes_per_param_peak": (torch.cuda.max_memory_allocated() - dev0) / n if cuda else None,
           "host_kernel_load_rss_bytes": kernel_load, **extra}
    if "fixed_buffer_bytes" in extra:
        rec["host_bytes_per_param_peak_minus_fixed_buffer"] = (
            (rec["host_bytes_per_param_peak"] or rec["host_bytes_per_param_end"]) * n - extra["fixed_buffer_bytes"]) / n
    if hasattr(opt, "timings"):
        rec["last_step_timings"] = opt.timings
    with open(out_path, "w") as f:
        json.dump(rec, f)
    destroy()


def bench_offload(args, cuda):
    modes = args.offload_modes.split(",") if args.offload_modes else (
        ["device-adam", "host-stream", "host-stream-fp32-moments"] + (["hybrid", "host-stream-check"] if cuda else []))
    out = {"what": "host/device memory growth from before building the optimizer to after the steps, per parameter "
                   "(synthetic model: bf16 Linear weights in megatron DDP with an fp32 grad buffer)", "modes": {}}
    for i, mode in enumerate(modes):
        path = os.path.join(args.tmp, f"offload_{mode}.json")
        pp = os.pathsep.join([ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        env = dict(os.environ, PYTHONPATH=pp, MASTER_PORT=str(launch_env.free_port()))  # keep site dirs given by PYTHONPATH
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--_offload-worker", mode,
                            "--offload-params", str(args.offload_params), "--offload-steps", str(args.offload_steps),
                            "--chunk-bytes", str(args.chunk_bytes), "--out", path],
                           capture_output=True, text=True, env=env, timeout=args.worker_timeout)
        if r.returncode != 0:
            out["modes"][mode] = {"error": (r.stderr or r.stdout)[-1500:]}
            continue
        with open(path) as f:
            out["modes"][mode] = json.load(f)
    return out


# ---------------------------------------------------------------------------------------------------------
def bench_train(args, device):
    """Full k3-mini training steps with megatron's on-device Adam, then with the host-stream offload."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_k3.config import get_preset
    from megatron_k3.parallel.layout import ParallelLayout
    from megatron_k3.parallel import adapter
    from megatron_k3.parallel.runtime import (build_model_chunks, build_optimizer,
                                              make_forward_step, wrap_ddp)
    from megatron_k3.model import K3ForCausalLM
    from megatron_k3.optim.offload import build_host_stream_optimizer, proc_status_bytes

    cfg = get_preset(args.train_preset, seq_length=args.train_seq)
    bf16 = device.type == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32
    t0 = time.time()
    chunks, tconfig = build_model_chunks(cfg, ParallelLayout(), params_dtype=dtype, device=device)
    adapter.load_hf_state_dict(chunks[0], K3ForCausalLM(cfg, seed=0).state_dict(), 0)
    ddp = wrap_ddp(chunks, tconfig)
    n_params = sum(p.numel() for p in chunks[0].parameters())
    fb = get_forward_backward_func()
    B, S, M = args.train_micro_batch, args.train_seq, args.train_micro_batches
    g = torch.Generator().manual_seed(0)
    res = {"preset": args.train_preset, "params": n_params, "micro_batch_size": B, "seq_length": S,
           "num_microbatches": M, "dtype": str(dtype).replace("torch.", ""), "build_s": time.time() - t0}

    def run(opt, steps):
        times, opt_times = [], []
        for i in range(steps):
            t = torch.randint(0, cfg.vocab_size, (M * B, S + 1), generator=g)
            micro = [{"tokens": t[m * B:(m + 1) * B, :-1].to(device), "labels": t[m * B:(m + 1) * B, 1:].to(device)}
                     for m in range(M)]
            _sync()
            t1 = time.perf_counter()
            ddp[0].zero_grad_buffer()
            opt.zero_grad()
            fb(forward_step_func=make_forward_step(), data_iterator=iter(micro), model=ddp[0], num_microbatches=M,
               seq_length=S, micro_batch_size=B, forward_only=False)
            _sync()
            t2 = time.perf_counter()
            opt.step()
            _sync()
            t3 = time.perf_counter()
            if i >= args.train_warmup:
                times.append(t3 - t1)
                opt_times.append(t3 - t2)
        return {"step_times_s": times, "median_step_s": statistics.median(times),
                "median_optimizer_step_s": statistics.median(opt_times)}

    opt = build_optimizer(ddp, lr=1e-4, bf16=bf16)
    res["device_adam"] = run(opt, args.train_warmup + args.train_steps)
    if device.type == "cuda":
        res["device_adam"]["peak_device_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    del opt
    for p in chunks[0].parameters():  # megatron's Float16 optimizer hangs its fp32 copy on the parameter
        if hasattr(p, "main_param"):
            del p.main_param
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rss0 = proc_status_bytes("VmRSS")
    opt = build_host_stream_optimizer(ddp, lr=1e-4, bf16=bf16, chunk_bytes=args.chunk_bytes)
    res["host_stream"] = run(opt, args.train_warmup + args.train_steps)
    res["host_stream"].update({"impl": opt.impl, "chunk_bytes": opt.chunk_elems * 4,
                               "fixed_buffer_bytes": opt.fixed_buffer_bytes,
                               "host_state_bytes_per_param": opt.state_bytes / n_params,
                               "host_rss_growth_bytes_per_param": (proc_status_bytes("VmRSS") - rss0) / n_params,
                               "last_step_timings": opt.timings, "torch_threads": torch.get_num_threads()})
    if device.type == "cuda":
        res["host_stream"]["peak_device_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    res["step_overhead_vs_device_adam"] = (res["host_stream"]["median_step_s"] / res["device_adam"]["median_step_s"]
                                           - 1.0)
    return res


# ---------------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="op,offload,train")
    ap.add_argument("--out", default=None)
    ap.add_argument("--op-rows", type=int, default=None,
                    help="grouped expert rows (default: 65536 on CUDA, 8192 on CPU)")
    ap.add_argument("--op-layers", type=int, default=4)
    ap.add_argument("--op-iters", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--offload-params", type=float, default=None,
                    help="synthetic model size (default: 1e9 on CUDA, 16e6 on CPU)")
    ap.add_argument("--offload-steps", type=int, default=3)
    ap.add_argument("--offload-modes", default=None)
    ap.add_argument("--worker-timeout", type=int, default=900)
    ap.add_argument("--train-preset", default=None, help="default: k3-mini on CUDA, k3-tiny on CPU")
    ap.add_argument("--train-seq", type=int, default=None)
    ap.add_argument("--train-micro-batch", type=int, default=None)
    ap.add_argument("--train-micro-batches", type=int, default=1)
    ap.add_argument("--train-warmup", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, default=32 << 20, help="host-stream chunk (fp32 gradient bytes)")
    ap.add_argument("--time-budget", type=float, default=1e9, help="skip parts that start after this many seconds")
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--_offload-worker", dest="offload_worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.offload_worker:
        _offload_worker(args.offload_worker, int(float(args.offload_params)), args.offload_steps, args.out,
                        args.chunk_bytes)
        return
    cuda = torch.cuda.is_available()
    args.op_rows = args.op_rows or (65536 if cuda else 8192)
    args.offload_params = args.offload_params or (1e9 if cuda else 16e6)
    args.train_preset = args.train_preset or ("k3-mini" if cuda else "k3-tiny")
    args.train_seq = args.train_seq or (4096 if cuda else 128)
    args.train_micro_batch = args.train_micro_batch or (4 if cuda else 2)
    args.tmp = args.tmp or (os.path.dirname(os.path.abspath(args.out)) if args.out else "/tmp")
    t_start = time.time()
    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "command": " ".join(["python", "benchmarks/bench_memory.py"] + sys.argv[1:]),
           "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "os_cpus": os.cpu_count()}

    def dump():
        txt = json.dumps(rep, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(txt + "\n")
        return txt

    parts = args.parts.split(",")
    device = None
    if "op" in parts or "train" in parts:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", str(launch_env.free_port())),
                          RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        from megatron_k3.parallel.layout import ParallelLayout
        from megatron_k3.parallel.runtime import init_distributed

        device = init_distributed(ParallelLayout(), seed=0)
    for part in parts:
        if time.time() - t_start > args.time_budget:
            rep[part] = {"skipped": "time budget"}
            continue
        t = time.time()
        try:
            if part == "op":
                rep["op"] = bench_op(args, device)
            elif part == "offload":
                rep["offload"] = bench_offload(args, cuda)
            elif part == "train":
                rep["train"] = bench_train(args, device)
            else:
                raise SystemExit(f"unknown part {part}")
        except Exception as e:  # noqa: BLE001 - keep the other parts' results
            import traceback

            rep[part] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        rep.setdefault("part_seconds", {})[part] = time.time() - t
        dump()
    print(dump())
    if device is not None:
        from megatron_k3.parallel.runtime import destroy

        destroy()


if __name__ == "__main__":
    main()
