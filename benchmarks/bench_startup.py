#!/usr/bin/env python3
"""Start-up of training jobs: how long a job takes from its process start to the end of its first step.

    python benchmarks/bench_startup.py --json out.json --jobs 2 [--kernel-cache-dir DIR] [--note TEXT] -- \
        --preset k3-mini --bf16 --micro-batch-size 8 --global-batch-size 32 --seq-length 4096 --cuda-graph-impl local

Runs ``--jobs`` training jobs one after the other, each a separate ``launchers/pretrain_k3.py`` process with the
given trainer flags, ``--train-iters 1`` and its own run directory, all sharing one kernel cache (``--kernel-cache-dir``,
passed to the trainer; without it the environment's ``TRITON_CACHE_DIR`` / ``TORCHINDUCTOR_CACHE_DIR`` if set,
else ``WORK/kernel_cache``). For each job the JSON holds the trainer's own start-up record (the
first metrics record's ``startup/*``: imports, data, distributed init, model build, DDP and optimizer, graph
capture, first step, process start to the end of step 1), the process's wall time, and the files in the
Triton and Inductor caches before and after it (files added = kernels compiled by that job). On a fresh
machine the first job is the one a new Slurm job on fresh nodes pays; with a cache carried from earlier jobs
it is the "second job on fresh nodes" of ``docs/training.md``. Say which with ``--note``.
"""
import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the report")
    ap.add_argument("--jobs", type=int, default=2, help="jobs to run one after the other (default 2)")
    ap.add_argument("--kernel-cache-dir", default=None, help="the trainer's --kernel-cache-dir for every job")
    ap.add_argument("--work", default=None, help="run directories go here (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job")
    ap.add_argument("--note", default="", help="what the machine and the cache were (recorded as is)")
    ap.add_argument("trainer_flags", nargs=argparse.REMAINDER, help="-- then the trainer's flags")
    a = ap.parse_args()
    from megatron_k3.train.trainer import count_files, kernel_cache_dirs  # the trainer's own rules
    flags = a.trainer_flags[1:] if a.trainer_flags[:1] == ["--"] else a.trainer_flags
    if a.jobs < 1:
        ap.error("--jobs must be at least 1")
    import tempfile

    work = a.work or tempfile.mkdtemp(prefix="k3-startup-")
    if not a.kernel_cache_dir and not os.environ.get("TRITON_CACHE_DIR"):  # the jobs share one cache
        a.kernel_cache_dir = os.path.join(work, "kernel_cache")
    if a.kernel_cache_dir:
        flags = [*flags, "--kernel-cache-dir", a.kernel_cache_dir]
        caches = kernel_cache_dirs(a.kernel_cache_dir)
    else:  # the environment's own caches, which the trainer keeps
        caches = {"triton": os.environ["TRITON_CACHE_DIR"], "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    jobs = []
    for j in range(a.jobs):
        run_dir = os.path.join(work, f"job{j + 1}")
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, os.path.join(ROOT, "launchers", "pretrain_k3.py"), *flags, "--train-iters", "1",
               "--wandb-mode", "disabled", "--run-dir", run_dir]
        before = {k: count_files(v) for k, v in caches.items()}
        t0 = time.time()
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=a.timeout,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wall = time.time() - t0
        log = os.path.join(work, f"job{j + 1}.log")
        with open(log, "w") as f:
            f.write(r.stdout)
        if r.returncode != 0:
            sys.exit(f"error: job {j + 1} failed (exit {r.returncode}); its output: {log}\n{r.stdout[-3000:]}")
        after = {k: count_files(v) for k, v in caches.items()}
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            first = json.loads(f.readline())
        startup = {k.split("/", 1)[1]: v for k, v in first.items() if k.startswith("startup/")}
        jobs.append({"job": j + 1, "startup": startup, "process_wall_s": round(wall, 2),
                     "cache_files_before": before, "cache_files_added": {k: after[k] - before[k] for k in after}})
        print(f"[bench_startup] job {j + 1}: end of step 1 {startup.get('startup_s')} s after the process started "
              f"(wall {wall:.1f} s); cache files added {jobs[-1]['cache_files_added']}", flush=True)
    import torch

    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "command": shlex.join(["python", os.path.relpath(os.path.abspath(__file__), ROOT), *sys.argv[1:]]),
           "note": a.note, "trainer_flags": flags, "jobs": jobs,
           "summary": {"startup_s": [jb["startup"].get("startup_s") for jb in jobs]}}
    with open(a.json, "w") as f:
        json.dump(rep, f, indent=1)
    print(json.dumps(rep["summary"]))


if __name__ == "__main__":
    main()
