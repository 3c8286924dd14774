#!/usr/bin/env python3
"""The GPU end-to-end check of the trainer: run it first on any GPU machine (one JSON, every check in it).

    python tests/gpu/e2e.py --out e2e.json                 # k3-mini on the GPU (about 7 minutes on an H200)
    python tests/gpu/e2e.py --smoke --out e2e.json         # k3-tiny on the CPU (what CI runs: the script works)

What it runs, each step a separate process exactly as a user would type it:
1. ``launchers/pretrain_k3.py`` k3-mini, bf16, layer CUDA graphs, 20 steps on the embedded store, saving at 10
   and 20 (``--save-interval 10``): the straight run;
2. the same command with ``--load CKPT/iter_0000010`` (a new process: weights, optimizer, RNG and data position
   from the checkpoint): the losses of its first 3 steps must be within ``--resume-tol`` (1e-3) of the straight
   run's steps 11-13 (all 10 are recorded);
3. ``tools/convert_to_hf.py`` of the final checkpoint (bf16), then transformers' ``AutoModelForCausalLM`` /
   ``AutoTokenizer`` load it (``trust_remote_code``) and ``generate`` 16 tokens greedily;
4. ``tools/eval_hellaswag.py --model`` of that directory on ``data/hellaswag/sample.jsonl`` (40 documents: acc
   is meaningless there, the check is that the evaluation runs and its numbers are valid).
The JSON (written after every step, so a run cut short still reports) holds the commands, their wall times,
the losses, the checks and ``all_passed``; the process exits 1 unless every check passed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable

GPU = dict(preset="k3-mini", flags=["--bf16", "--cuda-graph-impl", "local", "--micro-batch-size", "4",
                                    "--global-batch-size", "8", "--seq-length", "4096"], steps=20, save_at=10,
           export_dtype="bf16", eval_device="cuda", eval_dtype="bfloat16")
SMOKE = dict(preset="k3-tiny", flags=["--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "128"],
             steps=6, save_at=3, export_dtype="fp32", eval_device="cpu", eval_dtype="float32")


def run(cmd, log, timeout, rep, name, shown=None):
    t = time.time()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                    PYTHONUNBUFFERED="1"))
    rep["steps"][name] = {"command": shown or " ".join(cmd).replace(ROOT + "/", ""), "rc": r.returncode,
                          "wall_s": round(time.time() - t, 1)}
    if r.returncode != 0:
        tail = open(log).read().splitlines()[-25:]
        rep["steps"][name]["log_tail"] = tail
        raise RuntimeError(f"{name} failed (rc {r.returncode}): " + " | ".join(tail[-5:]))
    return open(log).read()


def startup(run_dir):
    """The trainer's start-up figures (first metrics record's ``startup/*``: process start to the end of the
    first step, imports, model build, graph capture, first step, kernel-cache files before)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        first = json.loads(f.readline())
    return {k.split("/", 1)[1]: v for k, v in first.items() if k.startswith("startup/")}


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="k3-tiny on the CPU, 6 steps (checks this script)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None, help="work directory (default: a new temporary one, removed after)")
    ap.add_argument("--resume-tol", type=float, default=1e-3)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per step")
    a = ap.parse_args()
    c = SMOKE if a.smoke else GPU
    work = a.work or tempfile.mkdtemp(prefix="k3-e2e-")
    os.makedirs(work, exist_ok=True)
    ck, hf = os.path.join(work, "ckpt"), os.path.join(work, "hf")
    import torch

    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
           "torch": torch.__version__, "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
           "preset": c["preset"], "trainer_flags": c["flags"], "steps": {}, "checks": {}}

    def save():
        rep["all_passed"] = bool(rep["checks"]) and all(v is True for v in rep["checks"].values())
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=1)

    base = [PY, "launchers/pretrain_k3.py", "--preset", c["preset"], *c["flags"], "--train-iters", str(c["steps"]),
            "--lr", "3e-4", "--lr-warmup-fraction", "0.1", "--wandb-mode", "disabled", "--log-interval", "1"]
    try:
        out = run(base + ["--save", ck, "--save-interval", str(c["save_at"]), "--run-dir", os.path.join(work, "a")],
                  os.path.join(work, "a.log"), a.timeout, rep, "train_straight")
        la = losses(os.path.join(work, "a"))
        rep["losses_straight"] = [la[s] for s in sorted(la)]
        rep["steps"]["train_straight"]["startup"] = startup(os.path.join(work, "a"))
        rep["checks"]["straight_run_finite_losses"] = len(la) == c["steps"] and all(map(math.isfinite, la.values()))
        rep["save_lines"] = [line for line in out.splitlines() if "saved step" in line]
        save()
        run(base + ["--load", os.path.join(ck, f"iter_{c['save_at']:07d}"), "--run-dir", os.path.join(work, "b")],
            os.path.join(work, "b.log"), a.timeout, rep, "train_resumed")
        lb = losses(os.path.join(work, "b"))
        rep["steps"]["train_resumed"]["startup"] = startup(os.path.join(work, "b"))
        steps = sorted(lb)
        rep["losses_resumed"] = {s: lb[s] for s in steps}
        diffs = {s: abs(lb[s] - la[s]) for s in steps}
        rep["resumed_vs_straight_abs_diff"] = diffs
        first3 = steps[:3]
        rep["checks"]["resume_starts_at_save_step"] = first3 == [c["save_at"] + 1, c["save_at"] + 2, c["save_at"] + 3]
        rep["checks"]["resume_first_3_losses_within_tol"] = all(diffs[s] <= a.resume_tol for s in first3)
        save()
        run([PY, "tools/convert_to_hf.py", "--checkpoint", ck, "--output", hf, "--dtype", c["export_dtype"],
             "--no-progress"], os.path.join(work, "export.log"), a.timeout, rep, "convert_to_hf")
        rep["checks"]["export_has_weights_and_tokenizer"] = (
            os.path.exists(os.path.join(hf, "config.json")) and os.path.exists(os.path.join(hf, "tokenizer.json"))
            and any(f.endswith(".safetensors") for f in os.listdir(hf)))
        save()
        gen = run([PY, "-c", GENERATE, hf, c["eval_device"], c["eval_dtype"]], os.path.join(work, "gen.log"),
                  a.timeout, rep, "transformers_generate",
                  shown=f"python -c <tests/gpu/e2e.py GENERATE> {hf} {c['eval_device']} {c['eval_dtype']}")
        g = json.loads(gen.strip().splitlines()[-1])
        rep["generate"] = g
        rep["checks"]["transformers_generate"] = g["new_tokens"] == 16 and g["finite_logits"]
        save()
        ev = run([PY, "tools/eval_hellaswag.py", "--model", hf, "--data", "data/hellaswag/sample.jsonl", "--json",
                  "--device", c["eval_device"], "--dtype", c["eval_dtype"], "--no-progress"],
                 os.path.join(work, "eval.log"), a.timeout, rep, "eval_hellaswag")
        e = json.loads(ev[ev.index("{"):])
        rep["hellaswag"] = {k: e[k] for k in e if k in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr", "n")}
        rep["checks"]["hellaswag_runs"] = 0.0 <= e["acc"] <= 1.0 and 0.0 <= e["acc_norm"] <= 1.0
    except Exception as ex:  # noqa: BLE001  (the JSON says where it stopped)
        rep["error"] = f"{type(ex).__name__}: {ex}"[:2000]
        rep["checks"].setdefault("completed", False)
    save()
    print(json.dumps({k: rep[k] for k in ("checks", "all_passed")}, indent=1))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if rep["all_passed"] else 1)


GENERATE = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, device, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=dtype).to(device).eval()
ids = tok("The Python standard library", return_tensors="pt").input_ids.to(device)
with torch.no_grad():
    logits = model(ids).logits
    out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
print(json.dumps({"prompt_tokens": ids.shape[1], "new_tokens": out.shape[1] - ids.shape[1],
                  "finite_logits": bool(torch.isfinite(logits.float()).all()),
                  "text": tok.decode(out[0, ids.shape[1]:])}))
"""

if __name__ == "__main__":
    main()
