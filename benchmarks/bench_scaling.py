#!/usr/bin/env python3
"""Per-GPU throughput on several GPUs relative to one: ``benchmarks/benchmark.py`` at 1 GPU, at DP2 and at EP2.

    python3 benchmarks/bench_scaling.py --preset k3-mini --bf16 --micro-batch-size 4 --seq-length 4096 --out R.json
    python benchmarks/bench_scaling.py --smoke --out R.json        # CPU: k3-tiny on gloo (checks the harness runs)

Each configuration is its own ``benchmark.py`` process (``torch.distributed.run`` for several ranks) with
``--baselines none`` and the same per-GPU micro-batch, so every rank does one GPU's work of the 1-GPU run:
- ``1``: one GPU;
- ``dp2``: data parallel over 2 GPUs (the whole model on each, gradients all-reduced);
- ``ep2``: 2 GPUs, the routed experts split over them (expert parallel 2; everything else data parallel
  over the same 2 GPUs, tokens exchanged by megatron's all-to-all dispatcher).
``per_gpu_vs_1gpu`` is a configuration's per-GPU tokens/s over the 1-GPU run's (target >= 0.9). Other
arguments go to ``benchmark.py`` unchanged; a configuration that fails or times out keeps its error in the
report and the others still run.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"1": (1, 1), "dp2": (2, 1), "ep2": (2, 2)}  # name -> (ranks, expert parallel size)
TARGET = 0.9


def run_config(name, passthrough, workdir, timeout, port):
    ranks, ep = CONFIGS[name]
    out = os.path.join(workdir, f"{name}.json")
    bench = [os.path.join(ROOT, "benchmarks", "benchmark.py"), *passthrough, "--baselines", "none",
             "--expert-model-parallel-size", str(ep), "--out", out]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(port)]
           if ranks > 1 else [sys.executable]) + bench
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               MASTER_PORT=str(port))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if r.returncode != 0 or not os.path.exists(out):
        return {"error": f"exit {r.returncode}", "stderr_tail": r.stderr[-1500:]}
    rep = json.load(open(out))
    keep = ("command", "layout", "world_size", "median_step_s", "step_times_s", "tokens_per_s", "tokens_per_s_all_gpus",
            "mfu_vs_989_tflops", "peak_memory_gib", "breakdown", "device")
    return {k: rep.get(k) for k in keep}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1,dp2,ep2", help="comma list of: " + ", ".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    ap.add_argument("--master-port", type=int, default=29711)
    ap.add_argument("--out", default=None)
    args, passthrough = ap.parse_known_args()
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad or "1" not in names:
        sys.exit(f"error: --configs {args.configs}: choose from {', '.join(CONFIGS)} and include 1 (the reference)")
    if "--smoke" not in passthrough:
        import torch

        need = max(CONFIGS[c][0] for c in names)
        if not torch.cuda.is_available() or torch.cuda.device_count() < need:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            sys.exit(f"error: {need} GPUs needed for --configs {args.configs}, this machine has {have} "
                     "(on the CPU use --smoke)")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            print(f"[bench_scaling] {name} ...", file=sys.stderr, flush=True)
            runs[name] = run_config(name, passthrough, tmp, args.timeout, args.master_port + i)
    ref = runs["1"].get("tokens_per_s")
    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", "benchmarks/bench_scaling.py"] + sys.argv[1:]),
           "device": runs["1"].get("device"), "target_per_gpu_vs_1gpu": TARGET, "runs": runs}
    for name, r in runs.items():
        if name != "1" and ref and r.get("tokens_per_s"):
            r["per_gpu_vs_1gpu"] = r["tokens_per_s"] / ref
            r["target_met"] = r["per_gpu_vs_1gpu"] >= TARGET
    txt = json.dumps(rep, indent=1)
    print(txt)
    if args.out:
        with open(args.out, "w") as f:
            f.write(txt + "\n")
    if any("error" in r for r in runs.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
