#!/usr/bin/env python3
"""FP8 against bf16 through the trainer: the same model, data, initial weights and flags, one trainer process
per recipe (JSON).

    python benchmarks/bench_fp8.py --recipes bf16,torchao-rowwise,torchao-tensorwise --train-iters 200 \
        --out R.json [-- any trainer flag]                              # GPU
    python benchmarks/bench_fp8.py --smoke                              # CPU: k3-tiny, bf16 + the FP8 refusals

Each recipe runs ``launchers/pretrain_k3.py`` (the trainer users run: ``Trainer.fit`` and its ``train_step``)
with ``--config configs/k3-h4096.yaml`` (K3 at hidden 4096, 8 layers, 1.24B parameters; micro-batch 8 x 2048
tokens, one micro-batch a step), ``--bf16``, ``--cuda-graph-impl local`` (``--no-graphs``: eager), the same
``--seed`` (initial weights and data order) and ``--fp8-recipe`` (``bf16``: none). A recipe named twice
(``bf16,torchao-rowwise,bf16``) runs twice; the second is reported as ``bf16#2`` and gives the run-to-run
spread that the FP8 differences are judged against.

Data: a token store written once by this script (``synthetic_store``): windows drawn from a fixed, learnable
order-2 source p(x_t | x_{t-1}, x_{t-2}) over the 512-token vocabulary, one fresh window per sample, so
nothing repeats, the loss at step k is a held-out loss, and its floor (the source's entropy, reported) is
known. (The embedded corpus is 0.5 MB: 200 steps would be ~8 epochs, a memorisation loss that varied ~13%
between two identical bf16 runs.)

Per recipe, from the trainer's ``metrics.jsonl``: the median ``step_time_s`` after ``--warmup`` steps,
tokens/s, the loss every 10 steps, the mean loss of the last 20 steps, the device's peak memory
(``max_memory_allocated_gib``), and against the first ``bf16``: ``speedup_vs_bf16`` and
``final_loss_rel_diff_vs_bf16``, and the trainer's start-up figures (``startup``: build, graph capture with
its compiling and autotuning, first step). A recipe the machine cannot run is recorded with the trainer's
one-line error (exit 2). ``--breakdown`` adds, per recipe, ``benchmarks/benchmark.py``'s profiled step of the
same model and recipe (``breakdown``: device time by kernel kind, GEMM and FP8 quantisation apart, and idle
time), the measured split that bounds what FP8 of the projections can gain.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL_CONFIG = os.path.join(ROOT, "configs", "k3-h4096.yaml")
VOCAB = 512  # k3-tiny's vocabulary, which configs/k3-h4096.yaml keeps


def synthetic_batches(vocab: int, n: int, B: int, S: int, device, seed: int = 0, dim: int = 16,
                      sharpness: float = 2.0):
    """``n`` batches [B, S] from the order-2 source p(x_t | x_{t-1}, x_{t-2}) = softmax(sharpness (U[x_{t-1}] +
    V[x_{t-2}]) W / sqrt(dim)) with U, V [vocab, dim] and W [dim, vocab] fixed N(0, 1) draws (``seed``), sampled
    by the Gumbel-max trick on ``device``. Returns the batches and the source's entropy in nats per token,
    averaged over the sampled positions (the loss a perfect model reaches)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    U, V, W = (torch.randn(*shape, generator=g, device=device) for shape in ((vocab, dim), (vocab, dim), (dim, vocab)))
    A, C = (sharpness * (M @ W) / dim ** 0.5 for M in (U, V))  # logits from x_{t-1} and from x_{t-2}
    x = torch.empty(n * B, S + 1, dtype=torch.long, device=device)
    x[:, :2] = torch.randint(0, vocab, (n * B, 2), generator=g, device=device)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    for t in range(2, S + 1):
        logp = torch.log_softmax(A[x[:, t - 1]] + C[x[:, t - 2]], dim=-1)
        u = torch.rand(logp.shape, generator=g, device=device).clamp_(1e-20, 1.0)
        x[:, t] = (logp - torch.log(-torch.log(u))).argmax(-1)
        nats += -logp.gather(1, x[:, t:t + 1]).sum(dtype=torch.float64)
    entropy = float(nats) / (n * B * (S - 1))
    w = x.cpu().view(n, B, S + 1)
    return [(w[i, :, :-1].contiguous(), w[i, :, 1:].contiguous()) for i in range(n)], entropy


def synthetic_store(path: str, windows: int, S: int, seed: int = 0, vocab: int = VOCAB) -> float:
    """A token store of ``windows`` windows of S + 1 tokens from the order-2 source (one document each, so the
    trainer's windows are exactly these); returns the source's entropy. Written once: an existing store of
    the same request is reused (its manifest keeps the request and the entropy)."""
    import numpy as np
    import torch

    from megatron_k3.data.store import StoreWriter, open_store

    request = {"windows": windows, "seq_length": S, "seed": seed, "vocab": vocab}
    if os.path.exists(os.path.join(path, "zarr.json")):
        _, _, man = open_store(path)
        src = man["sources"][0]
        if src.get("request") == request:
            return src["entropy_nats"]
        raise SystemExit(f"error: {path} holds another synthetic store ({src.get('request')}); remove it")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches, entropy = synthetic_batches(vocab, windows, 1, S, device, seed=seed)
    tmp = f"{path}.tmp-{os.getpid()}"
    w = StoreWriter(tmp, {"type": "synthetic-order2", "vocab_size": vocab, "sha256": f"synthetic-order2-seed{seed}"})
    for tokens, labels in batches:
        w.add(np.concatenate([tokens[0].numpy(), labels[0, -1:].numpy()]).tolist())
    w.close([{"kind": "synthetic order-2 source (benchmarks/bench_fp8.py)", "request": request,
              "entropy_nats": entropy}])
    os.replace(tmp, path)
    return entropy


def flop_split(config_path: str, seq_length: int, tokens: int) -> dict:
    """Model FLOPs of one step (benchmark.py's count) and the part in the GEMMs that FP8 recipes take (the
    decoder layers' projections with both sizes multiples of 16, routed experts excluded: 6 x in x out per
    token each), from the golden model on the meta device."""
    import torch

    from benchmark import flops_per_token
    from megatron_k3.model import K3ForCausalLM
    from megatron_k3.parallel.precision import eligible_linears
    from megatron_k3.plan.model_info import model_info
    from megatron_k3.train.config import JobConfig, apply_file

    job = JobConfig()
    apply_file(job, config_path)
    cfg = job.model_config()
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, init=False)
    # the golden model's routed experts are Linears too; the megatron model runs them as grouped GEMMs (bf16)
    eligible = sum(m.in_features * m.out_features for n, m in eligible_linears(model.model)
                   if ".experts." not in f".{n}.")
    step = flops_per_token(cfg, seq_length, model_info(cfg)["active_params"]) * tokens
    return {"model_tflop_per_step": step / 1e12, "fp8_eligible_gemm_tflop_per_step": 6 * eligible * tokens / 1e12,
            "fp8_eligible_fraction": 6 * eligible * tokens / step}


def run_child(cmd: list[str]) -> subprocess.CompletedProcess:
    """A child process from the checkout root, the checkout put in front of PYTHONPATH (kept: on the GPU
    machine it holds the carried packages)."""
    path = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=path))


def run_recipe(recipe: str, args, store: str, run_dir: str, extra: list[str]) -> dict:
    """One trainer process with ``recipe``; its figures from metrics.jsonl (or its error line)."""
    cmd = [sys.executable, os.path.join(ROOT, "launchers", "pretrain_k3.py"), "--config", args.config,
           "--data-path", store, "--run-dir", run_dir, "--train-iters", str(args.train_iters),
           "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.micro_batch_size),
           "--seq-length", str(args.seq_length), "--lr", str(args.lr), "--min-lr", str(args.lr),
           "--lr-warmup-fraction", "0.05", "--lr-decay-style", "constant", "--seed", str(args.seed),
           "--log-interval", "10", "--wandb-mode", "disabled"]
    cmd += ["--bf16"] + ([] if (args.no_graphs or args.smoke) else ["--cuda-graph-impl", "local"])
    if recipe != "bf16":
        cmd += ["--fp8-recipe", recipe]
    cmd += extra
    t0 = time.time()
    r = run_child(cmd)
    res = {"command": " ".join(cmd[1:]).replace(ROOT + "/", ""), "wall_s": round(time.time() - t0, 1),
           "returncode": r.returncode}
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
        res["error"] = (lines[-1] if lines else f"exit {r.returncode}")[:600]
        res["stderr_tail"] = (r.stderr or "")[-3000:]
        return res
    recs = [json.loads(ln) for ln in open(os.path.join(run_dir, "metrics.jsonl")) if ln.strip()]
    # the trainer's start-up figures (imports, build, graph capture with its compiling and autotuning, first step):
    # a cold machine spends minutes here per model, which is what a GPU call has to plan for
    res["startup"] = {k.split("/", 1)[1]: v for x in recs for k, v in x.items() if k.startswith("startup/")}
    recs = [x for x in recs if "step" in x and "loss" in x]
    losses = [x["loss"] for x in recs]
    times = [x["step_time_s"] for x in recs[args.warmup:]] or [x["step_time_s"] for x in recs]
    med = statistics.median(times)
    tokens = args.micro_batch_size * args.seq_length
    res.update({"steps": len(recs), "median_step_s": med, "tokens_per_s": tokens / med,
                "first_step_s": recs[0]["step_time_s"], "loss_every_10": losses[::10],
                "final_loss_mean_last20": statistics.fmean(losses[-20:]),
                "max_memory_allocated_gib": recs[-1].get("max_memory_allocated_gib")})
    return res


def save(rep: dict, out: str | None):
    if out:
        with open(out, "w") as f:
            json.dump(rep, f, indent=1)


def breakdown(recipe: str, args, store: str, run_dir: str) -> dict:
    """``benchmarks/benchmark.py`` on the same model, micro-batch and recipe (``--baselines none``): it builds
    the trainer from the same flags, times ``train_step`` and, on CUDA, profiles one step into device time by
    kernel kind (``breakdown.by_kind_s``: GEMM, the FP8 quantisation kernels, KDA, attention, glue, ...) and the
    device's idle gaps. This is the measured split of a recipe's step that the FP8 speed-up is bounded by."""
    out = run_dir + "_breakdown.json"
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark.py"), "--config", args.config,
           "--data-path", store,
           "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
           "--baselines", "none", "--warmup", "1" if args.smoke else "3", "--steps", "2" if args.smoke else "5",
           "--out", out, "--seed", str(args.seed),
           "--bf16"] + ([] if (args.no_graphs or args.smoke) else ["--cuda-graph-impl", "local"])
    if recipe != "bf16":
        cmd += ["--fp8-recipe", recipe]
    t0 = time.time()
    r = run_child(cmd)
    res = {"command": " ".join(cmd[1:]).replace(ROOT + "/", ""), "wall_s": round(time.time() - t0, 1)}
    if r.returncode != 0 or not os.path.exists(out):
        res["error"] = ((r.stderr or r.stdout).strip().splitlines() or [f"exit {r.returncode}"])[-1][:600]
        return res
    b = json.load(open(out))
    bd = b.get("breakdown") or {}
    res.update({"median_step_s": b.get("median_step_s"), "peak_memory_gib": b.get("peak_memory_gib"),
                "device_busy_s": bd.get("device_busy_s"), "by_kind_s": bd.get("by_kind_s"),
                "top_by_kind": {k: v[:3] for k, v in (bd.get("top_by_kind") or {}).items()},
                "idle_s": (bd.get("idle_gaps") or {}).get("idle_s")})
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default="bf16,torchao-rowwise,torchao-tensorwise")
    ap.add_argument("--train-iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (they still train)")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-4, help="held constant after a 5%% warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=MODEL_CONFIG, help="the trainer's --config (the model)")
    ap.add_argument("--no-graphs", action="store_true", help="eager layers (default: --cuda-graph-impl local)")
    ap.add_argument("--work", default="/tmp/k3_bench_fp8", help="synthetic store and run directories")
    ap.add_argument("--smoke", action="store_true", help="CPU: k3-tiny (configs/k3-tiny-cpu.yaml), 6 steps of 2 x 128")
    ap.add_argument("--out", default=None)
    ap.add_argument("--append", action="store_true",
                    help="add these recipes to the runs already in --out (several calls of one machine: the first "
                         "run's startup compiles and autotunes this model's kernels, ~7 min cold on an H100); each "
                         "run records its own date and device")
    ap.add_argument("--breakdown", action="store_true",
                    help="after each recipe's run, benchmarks/benchmark.py's profiled step of the same model and "
                         "recipe (device time by kernel kind; ~1 min a recipe on a warm GPU machine)")
    ap.add_argument("extra", nargs="*", help="after --: more trainer flags, for every recipe")
    args = ap.parse_args()
    if args.smoke:
        args.train_iters, args.warmup, args.micro_batch_size, args.seq_length = 6, 2, 2, 128
        args.config = os.path.join(ROOT, "configs", "k3-tiny-cpu.yaml")
    import torch

    from megatron_k3.parallel.precision import te_version, torchao_version

    cuda = torch.cuda.is_available()
    os.makedirs(args.work, exist_ok=True)
    windows = args.train_iters * args.micro_batch_size
    store = os.path.join(args.work, f"synthetic_{windows}x{args.seq_length + 1}_seed{args.seed}.zarr")
    entropy = synthetic_store(store, windows, args.seq_length, args.seed)
    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "command": " ".join(["python", "benchmarks/bench_fp8.py"] + sys.argv[1:]),
           "torch": torch.__version__, "transformer_engine": te_version(), "torchao": torchao_version(),
           "model_config": os.path.relpath(args.config, ROOT), "micro_batch_size": args.micro_batch_size,
           "seq_length": args.seq_length, "train_iters": args.train_iters, "timed_after_step": args.warmup,
           "layer_graphs": not (args.no_graphs or args.smoke),
           "data": "synthetic order-2 source (synthetic_store): fresh windows every step, the same for every recipe",
           "source_entropy_nats": entropy, "recipes": {}}
    rep.update(flop_split(args.config, args.seq_length, args.micro_batch_size * args.seq_length))
    if args.append and args.out and os.path.exists(args.out):
        old = json.load(open(args.out))
        same = ("model_config", "micro_batch_size", "seq_length", "train_iters", "layer_graphs", "source_entropy_nats")
        if any(old.get(k) != rep[k] for k in same):
            raise SystemExit(f"error: --append: {args.out} holds runs of other settings "
                             f"({ {k: old.get(k) for k in same} }); use another --out")
        old.setdefault("commands", [old["command"]]).append(rep["command"])
        rep = old
    done = list(rep["recipes"])
    recipes = args.recipes.split(",")
    for i, recipe in enumerate(recipes):
        n = sum(1 for d in done if d.split("#")[0] == recipe) + recipes[:i].count(recipe)
        label = recipe if n == 0 else f"{recipe}#{n + 1}"
        run_dir = os.path.join(args.work, "runs", label.replace("#", "_"))
        if os.path.isdir(run_dir):
            import shutil

            shutil.rmtree(run_dir)
        rep["recipes"][label] = run_recipe(recipe, args, store, run_dir, args.extra)
        r = rep["recipes"][label]
        r["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        r["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
        print(f"[bench_fp8] {label}: " + (f"{r['median_step_s']:.4f} s/step, {r['tokens_per_s']:.0f} tokens/s, "
                                          f"loss(last 20) {r['final_loss_mean_last20']:.4f}, peak "
                                          f"{r['max_memory_allocated_gib']} GiB" if "error" not in r
                                          else "error: " + r["error"]), flush=True)
        base = rep["recipes"].get("bf16", {})
        for name, x in rep["recipes"].items():
            if name != "bf16" and "median_step_s" in x and "median_step_s" in base:
                x["speedup_vs_bf16"] = base["median_step_s"] / x["median_step_s"]
                x["final_loss_rel_diff_vs_bf16"] = x["final_loss_mean_last20"] / base["final_loss_mean_last20"] - 1
        save(rep, args.out)  # after every recipe: a later timeout keeps what finished
        if args.breakdown and "error" not in r:
            r["breakdown"] = breakdown(recipe, args, store, run_dir)
            save(rep, args.out)
    print(json.dumps({k: v for k, v in rep.items() if k != "recipes"}, indent=1))
    for name, x in rep["recipes"].items():
        print(name, json.dumps({k: v for k, v in x.items() if k not in ("loss_every_10", "stderr_tail")}))


if __name__ == "__main__":
    main()
