"""Will this layout of this model start? Build chosen ranks of a planned world on the meta device.

    python -m megatron_k3 simulate --preset k3-full --nodes 64 --gpu b300            # the planner's layout
    python -m megatron_k3 simulate --preset k3-full --nodes 64 --gpu b300 --tp 8 --pp 4 --ep 128 --ranks 0,511

For each chosen rank (default: the first rank of the first and of the last pipeline stage) one process joins
a *fake* world of ``nodes x GPUs per node`` ranks (torch's fake process group: collectives return at once),
builds megatron-core's parallel state for the layout and then runs the trainer's own construction code on the
meta device: ``runtime.build_model_chunks`` (this rank's stages, TP/EP shards), megatron's DDP (its fp32
gradient buffers) and megatron's optimizer (distributed or not: fp32 master shards; Adam's two moments
counted per optimizer element, as they are created at the first step). Nothing is allocated, so k3-full's
2.78T parameters cost a few seconds per rank on a laptop.

It reports per rank the local parameters and the bytes of weights, gradient buffers and optimizer state,
next to ``tools/plan_layout.py``'s figures for that pipeline stage (``megatron_k3/plan/planner.py``), and the
relative difference of each. What it tells a user: the code the cluster will run builds this layout
(no shape, divisibility or construction error on any of these ranks), and the static memory the planner
promised is what that code allocates. Activations are not simulated (the planner's activation model is
checked against measured saved tensors in tests/plan/test_plan.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from ..cli import ArgumentParser, UsageError, friendly_errors

GiB = 1 << 30


def build_parser():
    ap = ArgumentParser(prog="simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--preset", default="k3-full")
    a("--nodes", type=int, default=1)
    a("--gpus-per-node", type=int, default=8)
    a("--gpu", default="h100", help="GPU of the plan (tools/plan_layout.py --gpu)")
    a("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=None)
    a("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=None)
    a("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=None)
    a("--cp", "--context-parallel-size", dest="cp", type=int, default=None)
    a("--micro-batch-size", type=int, default=1)
    a("--ranks", default=None, help="comma list of global ranks (default: first rank of the first and last stage)")
    a("--tolerance", type=float, default=0.05, help="largest relative difference to the plan that passes (0.05)")
    a("--json", action="store_true", help="print the report as JSON")
    a("--out", default=None, help="also write the JSON report here")
    a("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def plan_for(args):
    """The planner's result (and its layout) for these arguments, exactly as tools/plan_layout.py decides it."""
    from . import planner as P
    from ..config import get_preset

    cfg = get_preset(args.preset)
    argv = ["--preset", args.preset, "--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node),
            "--gpu", args.gpu, "--micro-batch-size", str(args.micro_batch_size), "--json"]
    for k in ("tp", "pp", "ep", "cp"):
        if getattr(args, k):
            argv += [f"--{k}", str(getattr(args, k))]
    import contextlib
    import io

    from ..commands import plan as plan_layout  # tools/plan_layout.py: the same layout choice users see

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        plan_layout.main(argv)
    p = json.loads(buf.getvalue())
    return cfg, p, plan_layout.layout_of(p), P


def main_worker(spec: dict) -> dict:
    """One simulated rank (runs in its own process: megatron's parallel state is global)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .. import compat
    from ..config import get_preset
    from ..parallel.layout import ParallelLayout

    if compat.has_gpu():
        raise UsageError("simulate runs on the meta device of a CPU process; hide the GPUs (CUDA_VISIBLE_DEVICES=)")
    compat.setup_device(0)
    compat.play_cuda_on("meta")
    cfg = get_preset(spec["preset"])
    lay = ParallelLayout(**spec["layout"])
    rank, world = spec["rank"], lay.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    new_group = dist.new_group

    def fake_new_group(*a, backend=None, **k):  # megatron's gloo side groups: fake ones too (no rendezvous)
        return new_group(*a, **k)

    dist.new_group = fake_new_group
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                                 virtual_pipeline_model_parallel_size=lay.vpp if lay.vpp > 1 else None,
                                 context_parallel_size=lay.cp, expert_model_parallel_size=lay.ep,
                                 expert_tensor_parallel_size=1)
    from ..parallel.runtime import build_model_chunks, build_optimizer, wrap_ddp

    dtype = torch.bfloat16 if spec["bf16"] else torch.float32
    chunks, tconfig = build_model_chunks(cfg, lay, params_dtype=dtype, device="meta", init_seed=None)
    params = [p for c in chunks for p in c.parameters()]
    n_params = sum(p.numel() for p in params)
    expert = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
    weights = sum(p.numel() * p.element_size() for p in params)
    ddp = wrap_ddp(chunks, tconfig, spec["distributed_optimizer"])
    grads = 0
    for d in ddp:
        for buf in list(d.buffers) + list(d.expert_parallel_buffers):
            grads += buf.grad_data.numel() * buf.grad_data.element_size()
    opt = build_optimizer(ddp, lr=1e-4, bf16=spec["bf16"], use_distributed_optimizer=spec["distributed_optimizer"],
                          coalesce=False)
    masters = moments = 0
    for o in getattr(opt, "chained_optimizers", [opt]):
        for g in getattr(o, "shard_fp32_from_float16_groups", None) or getattr(o, "fp32_from_float16_groups", []):
            masters += sum(p.numel() * 4 for p in g)
        inner = getattr(o, "optimizer", None)
        for g in (inner.param_groups if inner is not None else []):
            moments += sum(p.numel() * 8 for p in g["params"])  # exp_avg + exp_avg_sq, fp32, made at step 1
    out = {"rank": rank, "pipeline_stage": ps.get_pipeline_model_parallel_rank(),
           "tp_rank": ps.get_tensor_model_parallel_rank(), "ep_rank": ps.get_expert_model_parallel_rank(),
           "dp_rank": ps.get_data_parallel_rank(), "layers": [c.layer_start for c in chunks] + [chunks[-1].layer_end],
           "params": n_params, "expert_params": expert,
           "bytes": {"weights": weights, "grads": grads, "optimizer": masters + moments},
           "optimizer_detail": {"fp32_masters": masters, "adam_moments": moments}}
    dist.destroy_process_group()
    return out


def run_rank(spec: dict) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "megatron_k3.plan.simulate", "--worker", json.dumps(spec)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"rank {spec['rank']} failed to build:\n{tail}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def compare(sim: dict, stage: dict) -> dict:
    planned = {"params": stage["params"]["local"], **{k: stage["static"][k] for k in ("weights", "grads", "optimizer")}}
    got = {"params": sim["params"], **sim["bytes"]}
    return {k: {"simulated": got[k], "planned": planned[k],
                "rel_diff": (got[k] - planned[k]) / planned[k] if planned[k] else 0.0} for k in planned}


@friendly_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        print(json.dumps(main_worker(json.loads(args.worker))))
        return
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise UsageError("--nodes and --gpus-per-node must be >= 1")
    cfg, p, lay, _ = plan_for(args)
    world = lay.world_size
    per_stage = world // lay.pp
    ranks = ([int(x) for x in args.ranks.split(",")] if args.ranks else sorted({0, world - per_stage}))
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise UsageError(f"--ranks {bad}: the world has ranks 0..{world - 1}")
    spec = {"preset": args.preset, "bf16": p["precision"] == "bf16", "distributed_optimizer": p["distributed_optimizer"],
            "layout": {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "cp": lay.cp, "dp": lay.dp, "vpp": lay.vpp,
                       "sequence_parallel": lay.sequence_parallel, "layers_per_stage": lay.layers_per_stage}}
    results = []
    for r in ranks:
        sim = run_rank({**spec, "rank": r})
        cmp = compare(sim, p["stages"][sim["pipeline_stage"]])
        results.append({**sim, "vs_plan": cmp, "within_tolerance": all(abs(v["rel_diff"]) <= args.tolerance
                                                                       for v in cmp.values())})
    rep = {"model": cfg.name, "world_size": world, "layout": p["layout"], "layers_per_stage": p["layers_per_stage"],
           "gpu": p["gpu"], "precision": p["precision"], "distributed_optimizer": p["distributed_optimizer"],
           "tolerance": args.tolerance, "ranks": results, "pass": all(x["within_tolerance"] for x in results)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        print(f"{cfg.name} on {world} x {p['gpu']}: {p['layout']}, layers per stage {p['layers_per_stage']} "
              f"(meta device, fake process group of {world} ranks)")
        for x in results:
            print(f"  rank {x['rank']} (pipeline stage {x['pipeline_stage']}, layers {x['layers'][0]}-{x['layers'][-1] - 1}, "
                  f"TP rank {x['tp_rank']}, EP rank {x['ep_rank']}): built")
            for k, v in x["vs_plan"].items():
                unit = (lambda b: f"{b / 1e9:.3f}B") if k == "params" else (lambda b: f"{b / GiB:.2f} GiB")
                print(f"    {k:10s} simulated {unit(v['simulated']):>12s}   planned {unit(v['planned']):>12s}   "
                      f"{v['rel_diff'] * 100:+.2f}%")
        print("PASS: every figure within {:.0%} of the plan".format(args.tolerance) if rep["pass"] else
              "FAIL: a figure differs from the plan by more than {:.0%}".format(args.tolerance))
    if not rep["pass"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
