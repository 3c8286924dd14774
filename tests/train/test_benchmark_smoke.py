"""The benchmark harness runs (CPU smoke mode); numbers come from the GPU, never from tests."""
import json
import os
import subprocess
import sys


def test_benchmark_smoke(root, tmp_path):
    """Smoke mode with gradient accumulation: a global batch of 2 micro-batches per step, timed through the
    trainer's own loop and through ``Trainer.train_step``; the baselines train on the same micro-batches."""
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "benchmark.py"), "--smoke", "--global-batch-size",
                        "4", "--baselines", "seed,seed_compiledconv,gptmodel", "--attn-res-impl", "compiled",
                        "--seed-micro-batch-size", "1", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root, MASTER_PORT="29688"))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(out))
    # the kernel choices are typed settings: part of the record and of the command that reruns it
    assert rep["kernels"]["attn_res"] == "compiled" and "--attn-res-impl compiled" in rep["command"]
    assert rep["tokens_per_s"] > 0 and len(rep["step_times_s"]) == 2 and rep["model_flops_per_token"] > 0
    assert rep["num_microbatches"] == 2 and rep["global_batch_size"] == 4 and len(rep["losses"]) == 4
    # tokens per step: 2 micro-batches of 2 x 128
    assert abs(rep["tokens_per_s"] * rep["median_step_s"] - 2 * 2 * 128) < 1e-6
    # the trainer's own loop ran the same step first (its losses continue into the harness's: one run)
    loop = rep["trainer_loop"]
    assert loop["steps"] == 4 and len(loop["step_time_s"]) == 2 and loop["median_step_s"] > 0
    assert rep["trainer_loop_vs_train_step"] == loop["median_step_s"] / rep["median_step_s"]
    assert rep["data"]["windows"] > 0 and rep["data"]["path"].endswith(".zarr")
    # every same-run baseline trained (GPTModel: local spec on CPU)
    for name in ("seed", "seed_compiledconv", "gptmodel"):
        b = rep["baselines"][name]
        assert "error" not in b, b
        assert len(b["step_times_s"]) == 2 and rep[f"speedup_vs_{name}"] > 0
        assert abs(b["tokens_per_s"] * b["median_step_s"] - 2 * 2 * 128) < 1e-6
    # the seeds at their own micro-batch size (--seed-micro-batch-size 1): the same 4 sequences a step
    for name in ("seed", "seed_compiledconv"):
        assert (rep["baselines"][name]["micro_batch_size"], rep["baselines"][name]["num_microbatches"]) == (1, 4)


def _benchmark_module(root):
    import importlib.util

    spec = importlib.util.spec_from_file_location("k3_benchmark", os.path.join(root, "benchmarks", "benchmark.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seed_regroup_keeps_tokens(root):
    """``regroup``: a step's micro-batches of 4 as micro-batches of 2 and of 8 hold the same rows in the same order."""
    import torch

    bm = _benchmark_module(root)
    g = torch.Generator().manual_seed(0)
    steps = [[(torch.randint(0, 99, (4, 5), generator=g), torch.randint(0, 99, (4, 5), generator=g))
              for _ in range(2)] for _ in range(3)]
    for b, n in ((2, 4), (8, 1), (4, 2)):
        out = bm.regroup(steps, b)
        assert [len(m) for m in out] == [n] * 3
        for before, after in zip(steps, out):
            assert all(t.shape == (b, 5) and y.shape == (b, 5) for t, y in after)
            assert torch.equal(torch.cat([t for t, _ in before]), torch.cat([t for t, _ in after]))
            assert torch.equal(torch.cat([y for _, y in before]), torch.cat([y for _, y in after]))


def test_seed_micro_batch_refused_up_front(root):
    """A seed micro-batch that does not divide a rank's sequences per step is one error line, before any model."""
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "benchmark.py"), "--smoke", "--global-batch-size",
                        "4", "--baselines", "seed", "--seed-micro-batch-size", "3"], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=root, MASTER_PORT="29689"))
    assert r.returncode == 2 and "error: --seed-micro-batch-size 3 must be positive and divide the 4 sequences" \
        in r.stderr, r.stderr[-2000:]
    assert "[benchmark" not in r.stderr, r.stderr[-2000:]  # refused before the harness's first progress line


def test_gpu_tools_import(root):
    """The GPU-only tools (gpu_check, bench_ops) import and parse their arguments here (they run on the GPU)."""
    for tool in ("gpu_check.py", "bench_ops.py", "bench_scaling.py"):
        r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", tool), "--help"], capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, PYTHONPATH=root))
        assert r.returncode == 0 and "usage" in r.stdout, tool + r.stderr[-2000:]


def test_bench_scaling_smoke(root, tmp_path):
    """1 rank, DP2 and EP2 (two gloo ranks each) through benchmark.py; the report compares per-rank tokens/s."""
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_scaling.py"), "--smoke", "--master-port",
                        "29741", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.load(open(out))["runs"]
    assert [runs[n]["layout"] for n in ("1", "dp2", "ep2")] == ["TP1 PP1 EP1 CP1 DP1", "TP1 PP1 EP1 CP1 DP2",
                                                                  "TP1 PP1 EP2 CP1 DP2"]
    for n in ("dp2", "ep2"):
        x = runs[n]
        assert x["world_size"] == 2 and x["tokens_per_s"] > 0 and len(x["step_times_s"]) == 2
        assert abs(x["per_gpu_vs_1gpu"] - x["tokens_per_s"] / runs["1"]["tokens_per_s"]) < 1e-12
        assert abs(x["tokens_per_s_all_gpus"] - 2 * x["tokens_per_s"]) < 1e-6


def test_bench_host_smoke(root, tmp_path):
    """benchmarks/bench_host.py at k3-tiny's structure: one timed step, every timed piece reported (numbers mean
    nothing here; the committed k3-mini JSON is benchmarks/results/bench_host_*.json)."""
    out = tmp_path / "h.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_host.py"), "--preset", "k3-tiny", "--steps",
                        "1", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root, MASTER_PORT="29749"))
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.load(open(out))
    t = rep["median_ms_per_step"]
    for k in ("wall", "forward_backward", "finalize_k3_grads", "reset_model_temporary_tensors", "moe_routers",
              "optimizer_step", "grad_norm", "clip", "zero_grad"):
        assert k in t and t[k] >= 0, k
    assert t["wall"] >= t["forward_backward"] + t["optimizer_step"] and rep["parameter_tensors"] > 100


def test_bench_checkpoint_trainer_smoke(root, tmp_path):
    """``bench_checkpoint.py --trainer`` with writer processes then threads (k3-tiny): every save finds its staging
    buffer reserved (setup for the first entry, the switch for the second), writes a complete checkpoint through
    the kind of writer asked for, and the report carries the disk's own bandwidth beside it."""
    out = tmp_path / "c.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_checkpoint.py"), "--trainer", "--dir",
                        str(tmp_path / "d"), "--save-threads", "2p,2t", "--no-stock-baseline", "--raw-gib", "0.25",
                        "--json", str(out), "--", "--preset", "k3-tiny", "--micro-batch-size", "2",
                        "--global-batch-size", "4", "--seq-length", "128"], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=root, MASTER_PORT="29693"))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(out))
    saves = rep["trainer_save"]["async"]
    assert [s["workers"] for s in saves] == ["processes", "threads"] and [s["threads"] for s in saves] == [2, 2]
    for s in saves:
        assert s["bytes"] > 0 and s["staged_bytes"] > 0 and s["stall_s"] > 0 and s["GB_per_s"] > 0
        # the background write's phases add up to it: planning, the data files, metadata and the rest
        assert min(s["plan_s"], s["files_s"], s["finish_s"]) >= 0
        assert abs(s["plan_s"] + s["files_s"] + s["finish_s"] - s["write_s"]) < 1e-6
    assert rep["raw_disk_odirect"]["GB_per_s"] > 0
    assert rep["summary"]["write_vs_raw_disk"] == max(s["GB_per_s"] for s in saves) / rep["raw_disk_odirect"]["GB_per_s"]
    assert rep["summary"]["write_GB_per_s_min"] == min(s["GB_per_s"] for s in saves)


def test_bench_offload_host_smoke(root, tmp_path):
    """benchmarks/bench_offload_host.py: the offload's host update alone at several block sizes; every block size
    gives the same bits as the first (the update is element-wise), the three impls (the one-pass kernel has no
    blocks: timed once), bf16 and fp32 moments; the torch impls are compared with the one-pass kernel."""
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_offload_host.py"), "--params", "3e6",
                        "--blocks", "1048576,4096", "--moments", "bf16,fp32", "--steps", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="2"))  # 2 threads: see below
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.load(open(out))
    assert {(x["impl"], x["moments"], x["cpu_block"]) for x in rep["runs"]} == {
        (i, m, b) for i in ("fused", "torch") for m in ("bfloat16", "float32") for b in (1048576, 4096)} | {
        ("onepass", m, 1048576) for m in ("bfloat16", "float32")}
    # the fused kernel's bits equal the one-pass kernel's outside its scalar tails (none here: 1M-element blocks
    # and 3e6 elements split evenly over two threads' 16-element shares)
    fused = [x for x in rep["runs"] if x["impl"] == "fused" and x["cpu_block"] == 1048576]
    assert [x["elements_differing_from_onepass"] for x in fused] == [{"master": 0, "exp_avg": 0, "exp_avg_sq": 0}] * 2
    assert [x["identical_to_first_block"] for x in rep["runs"] if x["cpu_block"] == 4096] == [True] * 4
    assert all(x["G_params_per_s"] > 0 and len(x["seconds"]) == 2 for x in rep["runs"])
    assert rep["bandwidth"]["copy_GB_per_s"] > 0 and rep["best"]["G_params_per_s"] > 0


def test_preload_torch_cudnn_maps_torch_cudnn(root):
    """gpu_check's preload mode loads the pip cuDNN's parts (the package is installed with torch here too) into
    the process, libcudnn_graph first, so later loads by soname find them instead of a system cuDNN."""
    code = ("import sys; sys.argv = ['x']; import gpu_check; "
            "libs = gpu_check.preload_torch_cudnn(); print(libs); "
            "maps = open('/proc/self/maps').read(); "
            "assert libs and 'libcudnn_graph' in libs[0] and libs[-1].endswith('/libcudnn.so.9'), libs; "
            "assert all(f in maps for f in libs), 'not mapped'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "benchmarks")])))
    assert r.returncode == 0, r.stderr[-2000:]


def test_idle_gaps_charges_each_gap_to_its_host_phase(bench_module):
    """The device-idle analysis of the profiled step (``idle_gaps``) on a hand-made timeline (microseconds)."""
    idle_gaps = bench_module("benchmark").idle_gaps
    kernels = [(0, 10, "a"), (5, 12, "b"), (2, 4, "inside_a"),   # overlapping and nested kernels: no gap
               (20, 30, "c"), (100, 110, "d"), (111, 120, "e"), (140, 150, "f"),
               (151, 160, "e"), (163, 170, "f")]                   # two more e -> f gaps (unannotated)
    ranges = [(0, 80, "k3.forward_backward"), (0, 15, "k3.forward"), (85, 125, "k3.optimizer_step")]
    r = idle_gaps(kernels, ranges)
    # gaps: 12-20 (backward: in forward_backward, after k3.forward), 30-100 (backward), 110-111 (optimizer),
    # 120-140 (midpoint 130: no phase)
    # 120-140 (midpoint 130: no phase), 150-151 and 160-163 (no phase)
    assert abs(r["idle_s"] - 103e-6) < 1e-12
    assert list(r["by_phase_s"]) == ["backward", "unannotated", "optimizer_step"]  # largest first
    assert all(abs(r["by_phase_s"][k] - v) < 1e-12 for k, v in (("backward", 78e-6), ("unannotated", 24e-6),
                                                                  ("optimizer_step", 1e-6)))
    assert r["longest"][0] == {"us": 70, "phase": "backward", "cause": "unknown", "after_kernel": "c",
                               "before_kernel": "d"}
    assert r["longest"][-1]["us"] == 1 and len(r["longest"]) == 6
    # by kind of gap, most idle first: the two e -> f gaps (20 + 3 us) are one entry
    assert r["by_pair"][:3] == [
        {"us_total": 70, "count": 1, "phase": "backward", "cause": "unknown", "after_kernel": "c", "before_kernel": "d"},
        {"us_total": 23, "count": 2, "phase": "unannotated", "cause": "unknown", "after_kernel": "e",
         "before_kernel": "f"},
        {"us_total": 8, "count": 1, "phase": "backward", "cause": "unknown", "after_kernel": "b", "before_kernel": "c"}]
    assert len(r["by_pair"]) == 5 and sum(p["count"] for p in r["by_pair"]) == 6
    assert r["by_cause_s"] == {"unknown": 103e-6}  # no launch ids: no cause
    assert idle_gaps([], ranges) == {"idle_s": 0.0, "by_phase_s": {}, "by_cause_s": {}, "longest": [], "by_pair": []}


def test_idle_gaps_names_the_cause_of_each_gap(bench_module):
    """With the launching host call of each kernel: a gap inside one launch (a replayed graph), a next kernel
    launched only after the device went idle (host-bound), or launched before (the device waited)."""
    idle_gaps = bench_module("benchmark").idle_gaps
    kernels = [(0, 10, "g1", 7), (15, 20, "g2", 7),      # 10-15: both from launch 7 (one graph replay)
               (50, 60, "k", 8),                          # 20-50: launch 8 called at host time 40 (late)
               (70, 80, "m", 9),                          # 60-70: launch 9 called at 30, before the gap
               (90, 95, "x", None)]                       # 80-90: no launch id
    launches = {7: (0, "cudaGraphLaunch"), 8: (40, "cudaLaunchKernel"), 9: (30, "cuLaunchKernelEx")}
    r = idle_gaps(kernels, [], launches)
    assert r["by_cause_s"] == {"host_late": 30e-6, "device_wait": 10e-6, "unknown": 10e-6, "in_launch": 5e-6}
    assert [(g["cause"], g["us"]) for g in r["longest"]] == [("host_late", 30), ("device_wait", 10),
                                                              ("unknown", 10), ("in_launch", 5)]
    assert r["by_pair"][0] == {"us_total": 30, "count": 1, "phase": "unannotated", "cause": "host_late",
                               "after_kernel": "g2", "before_kernel": "k"}


def test_profile_intervals_reads_the_phase_ranges(bench_module):
    """``profile_intervals`` takes the ``k3.*`` host ranges (and, on CUDA, the kernels) from a real profile."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    profile_intervals = bench_module("benchmark").profile_intervals
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("k3.forward"):
            torch.ones(64, 64).sum()
        with record_function("other"):
            torch.ones(8).sum()
    kernels, ranges, launches = profile_intervals(prof)
    assert kernels == [] and launches == {}
    assert [n for _, _, n in ranges] == ["k3.forward"] and ranges[0][1] > ranges[0][0]


def test_profile_intervals_links_kernels_to_their_launch_call(bench_module):
    """Each kernel's launch id is its own correlation id, which is its runtime call's (a graph replay's kernels
    share the ``cudaGraphLaunch``'s); on an id clash with a CPU operator the runtime call wins. Events have no
    ``linked_correlation_id`` here, as in torch 2.11's ``FunctionEvent``."""
    from types import SimpleNamespace as NS

    cuda, cpu = NS(name="CUDA"), NS(name="CPU")
    def ev(dev, name, i, a, b):
        return NS(device_type=dev, name=name, id=i, time_range=NS(start=a, end=b), is_user_annotation=False)

    events = [ev(cpu, "aten::mm", 7, 0.0, 1.0), ev(cpu, "cudaGraphLaunch", 7, 2.0, 3.0),
              ev(cpu, "cudaLaunchKernel", 9, 4.0, 5.0), ev(cpu, "k3.forward", 11, 0.0, 50.0),
              ev(cuda, "nvjet_a", 7, 10.0, 20.0), ev(cuda, "triton_b", 7, 21.0, 30.0),
              ev(cuda, "elementwise", 9, 31.0, 40.0)]
    kernels, ranges, launches = bench_module("benchmark").profile_intervals(NS(events=lambda: events))
    assert [(k[2], k[3]) for k in kernels] == [("nvjet_a", 7), ("triton_b", 7), ("elementwise", 9)]
    assert launches == {7: (2.0, "cudaGraphLaunch"), 9: (4.0, "cudaLaunchKernel")}
    assert ranges == [(0.0, 50.0, "k3.forward")]


def test_device_ranges_are_not_kernels(bench_module):
    """Annotation ranges on the device timeline (``Optimizer.step#...``, the ``k3.*`` phases) are not counted
    as kernels by the breakdown or the idle analysis; kernels and copies are."""
    from types import SimpleNamespace

    is_device_kernel = bench_module("benchmark").is_device_kernel
    cuda, cpu = SimpleNamespace(name="CUDA"), SimpleNamespace(name="CPU")
    ev = lambda dev, ann=False: SimpleNamespace(device_type=dev, is_user_annotation=ann)  # noqa: E731
    assert is_device_kernel(ev(cuda), "nvjet_sm90_tst_256x128") and is_device_kernel(ev(cuda), "Memcpy DtoD")
    # aten's templated kernels carry "#" in their lambdas: kernels all the same (dropped before 2026-12-07)
    lam = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_"
           "kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#12}>")
    assert is_device_kernel(ev(cuda), lam)
    for e, name in ((ev(cuda), "k3.forward_backward"), (ev(cuda), "Optimizer.step#AdamW.step"),
                    (ev(cuda), "ProfilerStep#3"),
                    (ev(cuda, True), "my_range"), (ev(cpu), "aten::mm")):
        assert not is_device_kernel(e, name), name


def test_bench_startup_smoke(root, tmp_path):
    """benchmarks/bench_startup.py: two k3-tiny jobs sharing one kernel cache; each report holds the trainer's own
    start-up record (process start to the end of step 1, with its parts) and the cache's file counts."""
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_startup.py"), "--json", str(out),
                        "--jobs", "2", "--work", str(tmp_path / "w"), "--note", "cpu smoke", "--", "--preset", "k3-tiny",
                        "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "128"],
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in dict(os.environ, PYTHONPATH=root, MASTER_PORT="29696").items()
                            if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.load(open(out))
    assert [j["job"] for j in rep["jobs"]] == [1, 2] and rep["note"] == "cpu smoke"
    assert "--kernel-cache-dir" in rep["trainer_flags"]  # the two jobs share one cache (the bench's work dir)
    for j in rep["jobs"]:
        st = j["startup"]
        assert 0 < st["setup_started_s"] < st["setup_done_s"] <= st["startup_s"] <= j["process_wall_s"], j
        assert st["build_s"] > 0 and st["first_step_s"] > 0 and st["data_s"] >= 0 and st["distributed_init_s"] > 0
        assert set(j["cache_files_added"]) == {"triton", "inductor"}
    assert rep["summary"]["startup_s"] == [j["startup"]["startup_s"] for j in rep["jobs"]]


def test_bench_gemm_fp8_math_and_refusal(root, tmp_path):
    """benchmarks/bench_gemm_fp8.py (issue #33's GEMM table): its FP8 cases compute the GEMMs they are named
    after (torch._scaled_mm runs on the CPU too: relative error at e4m3's ~3% level, a wrong operand layout or
    scale would give ~100%), and on a machine without an FP8 GPU it writes its refusal and exits 2."""
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import bench_gemm_fp8 as b
    finally:
        sys.path.pop(0)
    import torch

    torch.manual_seed(0)
    x, w = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    dy = torch.randn(64, 48, dtype=torch.bfloat16)
    refs = (x.float() @ w.float().t(), dy.float() @ w.float(), dy.float().t() @ x.float())

    def rel(a, r):
        return float((a.float() - r).norm() / r.norm())

    for got, ref in zip(b.rowwise_fwd_bwd(x, w, dy), refs):
        assert got.shape == ref.shape and rel(got, ref) < 0.06, rel(got, ref)
    cases = b.gemm_cases(64, 48, 32, "cpu")
    ref = cases["bf16"]().float()
    for name in ("scaled_mm_tensorwise", "scaled_mm_rowwise"):
        assert rel(cases[name](), ref) < 0.06, name
    # the Linear table has the trainer's torchao GEMMs (each ran once when set up; "compiled" is eager on CPU)
    lin, errors = b.linear_cases(64, 48, 32, "cpu", [])
    assert "torchao" not in errors and {"torchao-rowwise_compiled", "torchao-tensorwise_eager"} <= set(lin), errors
    if not torch.cuda.is_available():
        out = tmp_path / "g.json"
        r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_gemm_fp8.py"), "--out", str(out)],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=root))
        assert r.returncode == 2 and "compute capability" in json.load(open(out))["error"], r.stderr[-500:]


def test_bench_gemm_fp8_kernel_split(root):
    """``--profile``'s split of a case's kernels into GEMM and the rest (what the issue's "why is FP8 slow" rests
    on): cuBLAS/CUTLASS GEMM names count as GEMM, TE's and torchao's quantisation/transposes as the rest, per
    call; and the cuBLASLt version probe reads a real library when this process maps one."""
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import bench_gemm_fp8 as b
        from benchmark import kernel_kind
    finally:
        sys.path.pop(0)
    kernels = [("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128", 3000.0),
               ("nvjet_qqtst_128x256_64x4_1x2_h_bz_coopA_NNT", 1500.0),
               ("void transformer_engine::detail::cast_transpose_kernel<...>", 1200.0),
               ("triton_red_fused__to_copy_abs_amax_clamp_div_0", 600.0),
               # Inductor names torchao's compiled cast after the `_scaled_mm` it feeds (H200, 2026-12-07): a cast
               ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_reciprocal_t_3", 600.0),
               ("void at::native::vectorized_elementwise_kernel<4, ...>", 300.0),
               ("idle_marker", 0.0)]
    s = b.split_kernels(kernels, calls=3, top_n=2)
    assert s["gemm_ms"] == 1.5 and s["other_ms"] == 0.9 and s["total_ms"] == 2.4, s
    # the step breakdown's kinds use the same names: Inductor's pointwise/reduction kernels are never GEMMs
    # (its GEMM templates, triton_tem_, are), torchao's amax and casts are FP8 quantisation
    kinds = {n: kernel_kind(n) for n in ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_reciprocal_t_3",
                                           "triton_red_fused_abs_max_view_0", "triton_tem_fused_mm_0",
                                           "nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT",
                                           "void at::native::vectorized_elementwise_kernel<8, add>")}
    assert list(kinds.values()) == ["fp8_quant", "fp8_quant", "gemm", "gemm", "elementwise"], kinds
    assert [t["kernel"][:12] for t in s["top"]] == ["sm90_xmma_ge", "nvjet_qqtst_"], s
    # device-time TFLOP/s of a profiled case (3 GEMMs of 2*M*N*K in total_ms) and the --summarize table
    row = {"M": 1000, "N": 1000, "K": 1000, "gemm_tflops": {"bf16": 1.0}, "linear_fwd_bwd_tflops": {"a": 2.0, "b": 3.0},
           "linear_fwd_bwd_kernels": {"a": {"total_ms": 0.006, "gemm_ms": 0.005, "other_ms": 0.001},
                                      "b": "RuntimeError: profiler"}, "errors": {"te_mxfp8": "needs 10.0"}}
    assert b.device_tflops(row) == {"a": 1000.0}, b.device_tflops(row)
    table = b.summarize({"rows": [row]}).splitlines()
    assert "| a | 2.0 | 1000.0 | 0.006 | 0.005 | 0.001 |" in table and "| b | 3.0 |  |  |  |  |" in table, table
    assert any(t.startswith("| te_mxfp8 | refused: needs 10.0") for t in table), table
    v = b.cublaslt_versions(["/nonexistent/libcublasLt.so.12", "/x/libcudnn.so"])
    assert list(v) == ["/nonexistent/libcublasLt.so.12"] and "OSError" in v["/nonexistent/libcublasLt.so.12"], v


def test_te_build_facts_fatbin_walk(root):
    """benchmarks/te_build_facts.py's reading of a .nv_fatbin section (how TE's kernels were compiled): entries
    are counted by kind and SM across several fat binaries, payload sizes are skipped exactly (a payload that
    happens to contain the magic number is not read as a header)."""
    import struct

    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import te_build_facts as t
    finally:
        sys.path.pop(0)

    def entry(kind, sm, payload):
        head = struct.pack("<HHIQ", kind, 1, 64, len(payload)) + b"\0" * 12 + struct.pack("<I", sm)
        return head + b"\0" * (64 - len(head)) + payload

    def fat(*entries):
        body = b"".join(entries)
        return struct.pack("<IHHQ", t.FATBIN_MAGIC, 1, 16, len(body)) + body

    trap = struct.pack("<I", t.FATBIN_MAGIC) + b"x" * 28  # a payload holding the magic number
    blob = b"pad" + fat(entry(2, 90, b"a" * 10), entry(1, 90, trap), entry(2, 80, b"")) + fat(entry(2, 90, b"z"))
    assert t.fatbin_entries(blob) == {"ELF sm_80": 1, "ELF sm_90": 2, "PTX sm_90": 1}
    assert t.fatbin_entries(b"no fat binary here") == {}


def test_fp8_ceiling_amdahl(root, tmp_path):
    """benchmarks/fp8_ceiling.py: the prediction and ceilings that the FP8 docs quote follow Amdahl's law on the
    bf16 step's profiled GEMM time, the eligible fraction and the per-case Linear speed-ups (compiled for
    torchao), and a bf16 run without a breakdown is refused."""
    runs = {"device": "GPU", "fp8_eligible_fraction": 0.5, "recipes": {
        "bf16": {"median_step_s": 1.0, "final_loss_mean_last20": 2.0,
                 "breakdown": {"median_step_s": 1.0, "device_busy_s": 0.9, "idle_s": 0.1,
                               "by_kind_s": {"gemm": 0.8}}},
        "torchao-tensorwise": {"median_step_s": 0.8, "final_loss_mean_last20": 2.02}}}
    k = lambda ms: {"total_ms": ms}  # noqa: E731
    gemm = {"device": "GPU", "rows": [
        {"linear_fwd_bwd_kernels": {"torch_bf16": k(3.0), "torchao-tensorwise_compiled": k(1.0),
                                    "torchao-tensorwise_eager": k(9.0), "te_delayed": k(1.5),
                                    "te_current": "RuntimeError: profiler failed"}},
        {"linear_fwd_bwd_kernels": {"torch_bf16": k(1.0), "torchao-tensorwise_compiled": k(1.0),
                                    "te_delayed": k(0.5)}}]}
    (tmp_path / "r.json").write_text(json.dumps(runs))
    (tmp_path / "g.json").write_text(json.dumps(gemm))
    out = tmp_path / "c.json"
    cmd = [sys.executable, os.path.join(root, "benchmarks", "fp8_ceiling.py"), "--runs", str(tmp_path / "r.json"),
           "--gemm", str(tmp_path / "g.json"), "--target", "1.3", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    c = json.load(open(out))
    assert c["eligible_gemm_s"] == 0.4
    tw = c["recipes"]["torchao-tensorwise"]
    # (3 + 1) ms of bf16 over (1 + 1) ms compiled: r = 2; step 1 - 0.4 * (1 - 1/2) = 0.8
    assert tw["linear_speedup"] == 2.0 and abs(tw["predicted_step_s"] - 0.8) < 1e-12
    assert tw["measured_ratio"] == 1.25 and abs(tw["loss_vs_bf16"] - 0.01) < 1e-12
    # at r = 2, 1.3x needs the eligible GEMMs to be (1 - 1/1.3) / (1 - 1/2) of the step; this model has 0.4
    assert abs(tw["eligible_share_needed"] - (1 - 1 / 1.3) / 0.5) < 1e-12 and c["eligible_share_of_step"] == 0.4
    # a recipe of the table no run measured: predicted only (TE delayed, r = 4 / 2), eager and failed cases left out
    assert c["predicted_only"] == {"te_delayed": {"linear_speedup": 2.0, "predicted_ratio": 1 / 0.8}}
    ce = c["ceilings"]
    assert abs(ce["eligible_at_peak_ratio"] - 1.25) < 1e-12 and abs(ce["all_gemm_at_peak_ratio"] - 1 / 0.6) < 1e-12
    # 1.3x needs 1 - 1/1.3 = 0.2308 s off: from 0.4 s of eligible GEMM that is r = 1 / (1 - 0.2308 / 0.4)
    assert abs(ce["speedup_needed_on_eligible"] - 1 / (1 - (1 - 1 / 1.3) / 0.4)) < 1e-12
    runs["fp8_eligible_fraction"] = 0.2  # 0.16 s eligible: even free GEMMs give 1/0.84 = 1.19x < 1.3x
    (tmp_path / "r.json").write_text(json.dumps(runs))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert json.load(open(out))["ceilings"]["speedup_needed_on_eligible"] is None
    del runs["recipes"]["bf16"]["breakdown"]
    (tmp_path / "r.json").write_text(json.dumps(runs))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--breakdown" in r.stderr, r.stderr


def test_kernel_trace_writes_the_host_ranges_of_a_real_profile(bench_module, tmp_path):
    """``benchmark.kernel_trace`` turns a real profile into the interned file ``trace_gaps.py`` reads (on the CPU:
    the ``k3.*`` ranges, no kernels)."""
    import gzip

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("k3.forward"):
            torch.ones(64, 64).sum()
        with record_function("other"):
            torch.ones(8).sum()
    path = str(tmp_path / "t.json.gz")
    n = bench_module("benchmark").kernel_trace(prof, path)
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    assert n == 1 and doc["k"] == [] and [doc["names"][r[2]] for r in doc["a"]] == ["k3.forward"]
    assert doc["a"][0][1] > 0


def test_trace_gaps_tells_structural_from_sporadic_gaps(bench_module):
    """``trace_gaps.summarize`` on a hand-made timeline: one graph replayed three times (launch ids 1-3), kernels
    A, B, C on stream 7; a 100 us gap before B in every replay (structural), a gap before C in one replay only
    (sporadic), and one gap at a stream switch between replays."""
    names = ["A", "B", "C", "D"]

    def k(ts, dur, n, stream, corr, smem=0):
        return [ts, dur, names.index(n), stream, corr, [1, 1, 1], [128, 1, 1], smem, 32]

    rows = []
    for r, t0 in enumerate((0.0, 1000.0, 2000.0)):
        rows += [k(t0, 10, "A", 7, r + 1), k(t0 + 110, 10, "B", 7, r + 1, smem=200000),
                 k(t0 + 120 + (300 if r == 1 else 0), 10, "C", 7, r + 1)]
    rows.append(k(2500.0, 10, "D", 9, 4))
    doc = {"names": names, "k": rows, "c": [], "s": [], "r": [], "a": []}
    bench_module("benchmark")  # trace_gaps reads benchmark.kernel_kind (a sibling import when run as a script)
    s = bench_module("trace_gaps").summarize(doc, min_us=20.0)
    assert s["by_kind"]["other"]["s"] == 0.0001 and s["busy_us"] == 100.0
    assert s["events"] == 10 and s["gaps"] == 3 + 1 + 2 + 1  # B x3, C once, between replays x2, before D
    top = {(p["before"], p["after"]): p for p in s["in_graph_positions"]["top"]}
    assert top[("A", "B")]["min_us"] == 100.0 and top[("A", "B")]["with_gap"] == 3
    assert top[("B", "C")]["min_us"] == 0.0 and top[("B", "C")]["max_us"] == 300.0
    assert s["in_graph_positions"] == {**s["in_graph_positions"], "structural_us": 300.0, "sporadic_us": 300.0}
    assert s["by_stream"]["stream_switch"]["count"] == 1
    assert s["next_kernel"]["after_long_gaps"]["smem=200000 block=(128, 1, 1)"] == 3
