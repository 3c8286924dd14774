"""Pick or check a parallel layout for K3 training and print the per-GPU memory it needs.

    python tools/plan_layout.py --preset k3-full --nodes 64 --gpu b300                  # pick a layout
    python tools/plan_layout.py --preset k3-full --nodes 256 --gpu h100 --tp 8 --pp 8 --ep 128 \\
        --recompute selective --json                                                    # check one
    python tools/plan_layout.py --preset k3-mini --nodes 1 --gpu h100 --micro-batch-size 2

Any of --tp/--pp/--ep/--cp/--vpp/--recompute/--optimizer-offload that is given is fixed; the rest is
searched (feasibility only: no offload before host-stream offload, no recompute before selective before
full, then the least pipeline and tensor parallelism, no context parallelism below 16K tokens, the largest
expert parallelism). Data parallelism is what is left of nodes x GPUs per node. A layout that does not fit
(or no layout, when searching) is refused with the reason and exit code 2; an invalid one (heads, experts
or AttnRes blocks that do not divide) likewise, before any arithmetic. The memory model (bytes per
parameter, saved activations per token, in-flight micro-batches, the cross-entropy transient) is in the
docstring of megatron_k3/plan/planner.py and in slurm/README.md. ``--measure`` instead compares the activation model
with saved-tensor bytes measured on this CPU for a small config.
"""
import argparse
import json
import sys


from megatron_k3.plan import planner as P
from megatron_k3.cli import ArgumentParser, UsageError, friendly_errors
from megatron_k3.config import ConfigError, get_preset, load_config
from megatron_k3.parallel.layout import ParallelLayout

GiB = 1 << 30


def build_parser():
    ap = ArgumentParser(prog="plan_layout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--preset", default="k3-full", help="model preset (default k3-full)")
    a("--config", default=None, help="model config file instead of --preset (YAML/JSON/TOML, 'model' section)")
    a("--nodes", type=int, default=1)
    a("--gpus-per-node", type=int, default=8)
    a("--gpu", choices=sorted(P.GPUS), default="h100")
    a("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=None)
    a("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=None)
    a("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=None)
    a("--cp", "--context-parallel-size", dest="cp", type=int, default=None)
    a("--vpp", "--virtual-pipeline-model-parallel-size", dest="vpp", type=int, default=None)
    a("--layers-per-stage", default=None, help="explicit split over PP x VPP stages, e.g. 24,24,24,21")
    a("--no-sequence-parallel", action="store_true", help="TP without sequence parallelism (default: SP when TP > 1)")
    a("--micro-batch-size", type=int, default=1)
    a("--seq-length", type=int, default=None, help="default: the model config's")
    a("--global-batch-size", type=int, default=None, help="default: micro batch x DP x 4 PP")
    a("--fp32", action="store_true", help="fp32 training (default: bf16 weights and activations)")
    a("--recompute", "--recompute-granularity", dest="recompute", choices=P.RECOMPUTE_ORDER, default=None)
    a("--optimizer-offload", choices=["none", "host-stream"], default=None)
    a("--no-distributed-optimizer", action="store_true", help="default: distributed optimizer when DP x CP > 1")
    a("--situ", choices=["stream", "reference"], default=None,
      help="SiTU-GLU implementation to plan for (default: the package's; reference = before the streaming op)")
    a("--experts", choices=["grouped", "sequential"], default=None,
      help="routed experts as grouped GEMMs over per-forward weight stacks or megatron's SequentialMLP loop "
           "(default: what the megatron layers use)")
    a("--moe-imbalance", type=float, default=1.0, help="routed rows on the fullest rank / mean (default 1.0)")
    a("--memory-margin", type=float, default=0.10,
      help="fraction of the GPU kept free for CUDA context, NCCL buffers, fragmentation (default 0.10)")
    a("--json", action="store_true", help="print the plan as JSON")
    a("--measure", action="store_true",
      help="compare the activation model with saved-tensor bytes measured on this machine (small configs)")
    return ap


def load_model(args):
    if args.config:
        return load_config(args.config)
    return get_preset(args.preset)


def trainer_flags(p: dict, layout: ParallelLayout) -> str:
    f = [f"--tensor-model-parallel-size {layout.tp}", f"--pipeline-model-parallel-size {layout.pp}",
         f"--expert-model-parallel-size {layout.ep}", f"--context-parallel-size {layout.cp}"]
    if layout.vpp > 1:
        f.append(f"--virtual-pipeline-model-parallel-size {layout.vpp}")
    c = layout.layers_per_stage
    if c is not None and layout.vpp == 1 and len(set(c[1:-1])) <= 1:  # megatron's first/last-stage flags
        mid = c[1] if len(c) > 2 else None
        if mid is None or c[0] != mid:
            f.append(f"--decoder-first-pipeline-num-layers {c[0]}")
        if mid is None or c[-1] != mid:
            f.append(f"--decoder-last-pipeline-num-layers {c[-1]}")
    if layout.sequence_parallel and layout.tp > 1:
        f.append("--sequence-parallel")
    if p["distributed_optimizer"]:
        f.append("--use-distributed-optimizer")
    if p["recompute"] != "none":
        f.append(f"--recompute-granularity {p['recompute']}")
    if p["optimizer_offload"] != "none":
        f.append(f"--optimizer-offload {p['optimizer_offload']}")
    f.append(f"--micro-batch-size {p['micro_batch_size']}")
    if p["precision"] == "bf16":
        f.append("--bf16")
    return " ".join(f)


def layout_of(p: dict) -> ParallelLayout:
    import re

    d = dict(re.findall(r"([A-Z]+)(\d+)", p["layout"]))
    lps = p["layers_per_stage"]
    even = len(set(lps)) == 1
    return ParallelLayout(tp=int(d["TP"]), pp=int(d["PP"]), ep=int(d["EP"]), cp=int(d["CP"]), dp=int(d["DP"]),
                          vpp=int(d.get("VPP", 1)), sequence_parallel="+SP" in p["layout"],
                          layers_per_stage=None if even else lps)


def report(p: dict) -> str:
    st = p["stages"][p["peak_stage"]]
    g = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
    lines = [f"{p['model']} on {p['world_size']} x {p['gpu']}: {p['layout']}, layers per stage "
             f"{p['layers_per_stage']}",
             f"  micro-batch {p['micro_batch_size']} x {p['seq_length']} tokens, {p['num_micro']} micro-batches per "
             f"step, {p['precision']}, recompute {p['recompute']}, SiTU {p['situ']}, {p['experts']} experts, "
             f"distributed optimizer "
             f"{'on' if p['distributed_optimizer'] else 'off'}, optimizer offload {p['optimizer_offload']}",
             f"  fullest GPU: pipeline stage {st['stage']} (layers {st['layers'][0]}-{st['layers'][-1]}), "
             f"{st['params']['local'] / 1e9:.3f}B parameters ({st['params']['expert'] / 1e9:.3f}B expert)",
             f"    weights        {g(st['static']['weights'])}",
             f"    grads (fp32)   {g(st['static']['grads'])}",
             f"    optimizer      {g(st['static']['optimizer'])}"
             + (f"   (host: {st['params']['host_optimizer_bytes'] / GiB:.1f} GiB per GPU)"
                if p["optimizer_offload"] != "none" else ""),
             f"    activations    {g(st['activations'])}   ({st['in_flight']:g} micro-batches in flight x "
             f"{sum(st['activations_per_microbatch'].values()) / GiB:.2f} GiB)",
             f"    transient      {g(st['transient'])}",
             f"    peak           {g(st['peak'])}   of {p['usable_bytes'] / GiB:.1f} GiB usable "
             f"({p['capacity_bytes'] / GiB:.1f} GiB less the margin)"]
    top = sorted(st["activations_per_microbatch"].items(), key=lambda kv: -kv[1])[:6]
    lines.append("  largest activation parts per micro-batch: " +
                 ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in top))
    if p["stages"] and len(p["stages"]) > 1:
        lines.append("  peak per stage: " + " ".join(f"{s['peak'] / GiB:.1f}" for s in p["stages"]) + " GiB")
    lay = layout_of(p)
    lines.append(f"  trainer flags: {trainer_flags(p, lay)}")
    if lay.layers_per_stage is not None:
        lines.append(f"  note: uneven pipeline split {lay.layers_per_stage} (whole AttnRes blocks)")
    return "\n".join(lines)


def measure(args, cfg):
    S = args.seq_length or min(cfg.seq_length, 512)
    m = P.measure_saved_activations(cfg, args.micro_batch_size, S, bf16=not args.fp32,
                                    recompute=args.recompute or "none", situ=args.situ, experts=args.experts)
    p = P.planned_components(cfg, args.micro_batch_size, S, bf16=not args.fp32, recompute=args.recompute or "none",
                             situ=args.situ, experts=args.experts)
    N = args.micro_batch_size * S
    out = {"measured": m, "planned": p, "tokens": N}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{cfg.name}: saved-for-backward bytes per token, micro-batch {args.micro_batch_size} x {S}")
    for k in sorted(set(m) | set(p)):
        print(f"  {k:14s} measured {m.get(k, 0) / N:12.1f}   planned {p.get(k, 0) / N:12.1f}")
    tm, tp = sum(m.values()), sum(p.values())
    print(f"  {'total':14s} measured {tm / N:12.1f}   planned {tp / N:12.1f}   ({(tp / tm - 1) * 100:+.2f}%)")


@friendly_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    cfg = load_model(args)
    if args.measure:
        return measure(args, cfg)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise UsageError("--nodes and --gpus-per-node must be >= 1")
    world = args.nodes * args.gpus_per_node
    gpu = P.GPUS[args.gpu]
    s = P.PlanSettings(micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                       global_batch_size=args.global_batch_size, bf16=not args.fp32,
                       distributed_optimizer=False if args.no_distributed_optimizer else None,
                       situ=args.situ, experts=args.experts, moe_imbalance=args.moe_imbalance,
                       memory_margin=args.memory_margin)
    fixed = {k: getattr(args, k) for k in ("tp", "pp", "ep", "cp", "vpp") if getattr(args, k)}
    lps = [int(x) for x in args.layers_per_stage.split(",")] if args.layers_per_stage else None
    if all(k in fixed for k in ("tp", "pp", "ep")) or lps:
        tp, pp, cp = fixed.get("tp", 1), fixed.get("pp", 1), fixed.get("cp", 1)
        if world % (tp * pp * cp):
            raise UsageError(f"{world} GPUs are not divisible by TP*PP*CP = {tp * pp * cp}")
        vpp = fixed.get("vpp", 1)
        if lps is None and pp * vpp > 1:
            L = cfg.num_hidden_layers
            bs = cfg.attn_res_block_size
            if L % (pp * vpp) or (bs and (L // (pp * vpp)) % bs):
                lps = P.block_split(cfg, pp * vpp)  # whole AttnRes blocks, as even as possible
        lay = ParallelLayout(tp=tp, pp=pp, ep=fixed.get("ep", 1), cp=cp, dp=world // (tp * pp * cp), vpp=vpp,
                             sequence_parallel=tp > 1 and not args.no_sequence_parallel, layers_per_stage=lps)
        s.recompute = args.recompute or "none"
        s.optimizer_offload = args.optimizer_offload or "none"
        p = P.plan(cfg, lay, s, gpu)
        ok = p["fits"]
    else:
        if args.no_sequence_parallel:
            raise UsageError("--no-sequence-parallel needs a fixed layout (--tp --pp --ep)")
        p, fail = P.search(cfg, gpu, world, args.gpus_per_node, s, fixed,
                           recompute_options=[args.recompute] if args.recompute else None,
                           offload_options=[args.optimizer_offload] if args.optimizer_offload else None)
        ok = p is not None
        if not ok:
            if fail is None:
                raise ConfigError(f"no valid layout of {world} GPUs for {cfg.name} with {fixed or 'no fixed sizes'}")
            p = fail
    print(json.dumps(p, indent=1) if args.json else report(p))
    if not ok:
        st = p["stages"][p["peak_stage"]]
        what = "layout" if "tp" in fixed else "no layout found; closest:"
        print(f"error: {what} {p['layout']} does not fit: {st['peak'] / GiB:.1f} GiB on pipeline stage {st['stage']} "
              f"> {p['usable_bytes'] / GiB:.1f} GiB usable on {p['gpu']} (static "
              f"{sum(st['static'].values()) / GiB:.1f} + activations {st['activations'] / GiB:.1f} + transient "
              f"{st['transient'] / GiB:.1f} GiB)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
