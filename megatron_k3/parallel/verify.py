"""Parallel equivalence check: the split megatron model against the single-process golden model.

``python tools/verify_parallel.py --preset k3-tiny --tp 2 --sequence-parallel`` (see ``--help``):

1. validates the layout(s) before any rank starts;
2. initialises the golden model from ``--seed`` and trains it on one process for ``--steps`` steps on a
   fixed global batch (AdamW, grad clipping), recording the loss of every step, every gradient of step 1
   and the final weights;
3. launches the ranks (gloo on CPU, NCCL on GPU), builds the megatron model for each layout, loads the
   same initial weights through the HF adapter, and trains with megatron's schedules, DDP (optionally the
   distributed optimizer) and optimizer on the same global batch split over DP ranks and micro-batches;
4. gathers gradients and weights back to full HF shapes (the adapter's inverse; every element must be
   covered) and compares: per tensor ``||a - b|| / ||b||``, losses ``|a - b| / |b|``.

The last line is ``max_rel_err=<x> PASS`` or ``... FAIL`` and the exit code matches. Tolerance: 1e-4 by
default in fp32. Rationale: the split model sums the same terms in another order (TP partial sums,
all-reduces, micro-batch accumulation), which moves fp32 results by ~1e-7 relative per operation; a few
Adam steps amplify that for near-zero gradients (Adam divides by sqrt(v)), so observed errors are
1e-7..1e-5. Adam's first steps are ill-conditioned for elements whose gradient is near ``eps``
(d update / d g ~ lr / (4 eps)): with eps = 1e-8 a 1e-10 round-off difference in such an element moves
its update by ~1e-3 relative, which is why the check runs Adam with eps = 1e-4 (``--adam-eps``); the
moments, bias correction, decay, clipping and distributed-optimizer sharding are all still exercised.
A real defect (a wrong shard, a missing reduction, a dropped micro-batch) gives errors of
order 1e-2..1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from ..cli import ArgumentParser, UsageError, friendly_errors
from ..config import PRESETS, get_preset, load_config
from ..train.launch_env import free_port
from .layout import LayoutError, ParallelLayout
from .collectives import all_reduce_host

LAYOUT_KEYS = {"tp", "pp", "ep", "cp", "dp", "vpp", "sp", "distopt"}


def parse_layout_spec(spec: str) -> tuple[ParallelLayout, bool]:
    """'tp=2,sp=1' -> (ParallelLayout, distributed_optimizer)."""
    kv = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" not in part:
            raise UsageError(f"layout spec '{spec}': expected key=value items (keys: {', '.join(sorted(LAYOUT_KEYS))})")
        k, v = part.split("=", 1)
        if k not in LAYOUT_KEYS:
            raise UsageError(f"layout spec '{spec}': unknown key '{k}'")
        try:
            kv[k] = int(v)
        except ValueError:
            raise UsageError(f"layout spec '{spec}': '{k}' needs an integer") from None
    distopt = bool(kv.pop("distopt", 0))
    sp = bool(kv.pop("sp", 0))
    return ParallelLayout(sequence_parallel=sp, **kv), distopt


def make_batches(cfg, steps, global_batch, seq_length, seed, mtp_depth):
    """Deterministic token batches [steps][global_batch, seq] with labels (a few ignored positions)."""
    from ..model.k3 import IGNORE_INDEX
    from ..model.mtp import shift_left

    g = torch.Generator().manual_seed(seed + 17)
    out = []
    for _ in range(steps):
        toks = torch.randint(0, cfg.vocab_size, (global_batch, seq_length + 1), generator=g)
        ids, labels = toks[:, :-1].clone(), toks[:, 1:].clone()
        labels[:, ::7] = IGNORE_INDEX  # pad-like positions are skipped by the loss
        b = {"tokens": ids, "labels": labels}
        if mtp_depth:
            b["mtp_tokens"] = torch.stack([shift_left(ids, k, 0) for k in range(1, mtp_depth + 1)])
            b["mtp_labels"] = torch.stack([shift_left(labels, k, IGNORE_INDEX) for k in range(1, mtp_depth + 1)])
        out.append(b)
    return out


def run_golden(cfg, batches, args):
    from ..model import K3ForCausalLM

    from ..optim.muon import MuonAdamW, clip_coefficient

    model = K3ForCausalLM(cfg, seed=args.seed)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    if args.optimizer == "muon":
        opt = MuonAdamW(model.named_parameters(), lr=args.lr, weight_decay=0.1, adam_eps=args.adam_eps)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=args.adam_eps, weight_decay=0.1)
    losses, grads = [], None
    for step, b in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        out = model(b["tokens"], b["labels"], mtp_loss_weight=args.mtp_loss_weight)
        out["loss"].backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        for p in model.parameters():  # megatron steps every parameter (zero grad still decays); so do we
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if args.optimizer == "muon":
            norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()
            opt.step(clip_coefficient(norm, args.clip_grad))
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            opt.step()
        losses.append([out["lm_loss"].item()] + [x.item() for x in out["mtp_losses"]])
    final = {k: v.clone() for k, v in model.state_dict().items()}
    return init, losses, grads, final


# --------------------------------------------------------------------------------------------------------
def _worker(rank, world, port, tmpdir, cfg_dict, layouts, args_dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ..config import K3Config
    from . import adapter
    from .runtime import (build_model_chunks, build_optimizer, init_distributed,
                                   make_forward_step, wrap_ddp)

    args = SimpleNamespace(**args_dict)
    cfg = K3Config.from_dict(cfg_dict)
    golden = torch.load(os.path.join(tmpdir, "golden.pt"))
    init_sd, batches = golden["init"], golden["batches"]
    shapes = {k: v.shape for k, v in init_sd.items()}
    results = []
    for spec in layouts:
        layout, distopt = parse_layout_spec(spec)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        device = init_distributed(layout, seed=args.seed)
        chunks, tconfig = build_model_chunks(cfg, layout, device=device)
        tp_rank = ps.get_tensor_model_parallel_rank()
        for c in chunks:
            adapter.load_hf_state_dict(c, init_sd, tp_rank)
        ddp = wrap_ddp(chunks, tconfig, distopt)
        if os.environ.get("K3_VERIFY_FAULT") == "skip_tp_partial_sum":  # self-test: the check must catch this
            from megatron.core.distributed import finalize_model_grads

            tconfig.finalize_model_grads_func = finalize_model_grads
        if args.optimizer == "muon":
            from .runtime import build_muon, grad_norm_fp32
            from ..optim.muon import clip_coefficient

            opt = build_muon(chunks, lr=args.lr, adam_eps=args.adam_eps)
        else:
            opt = build_optimizer(ddp, lr=args.lr, clip_grad=args.clip_grad, use_distributed_optimizer=distopt,
                                  adam_eps=args.adam_eps)
        fb = get_forward_backward_func()
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        n_micro = args.global_batch // (args.micro_batch_size * dp)
        fstep = make_forward_step(args.mtp_loss_weight)
        losses, grad_pieces = [], []
        last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        for step, b in enumerate(batches):
            for d in ddp:
                d.zero_grad_buffer()
            opt.zero_grad()
            mine = {k: v[..., dp_rank * n_micro * args.micro_batch_size:(dp_rank + 1) * n_micro * args.micro_batch_size, :]
                    for k, v in b.items()}
            micro = [{k: v[..., m * args.micro_batch_size:(m + 1) * args.micro_batch_size, :].to(device)
                      for k, v in mine.items()} for m in range(n_micro)]
            its = [iter(micro) for _ in ddp]
            out = fb(forward_step_func=fstep, data_iterator=its if len(its) > 1 else its[0],
                     model=ddp if len(ddp) > 1 else ddp[0], num_microbatches=n_micro, seq_length=args.seq_length,
                     micro_batch_size=args.micro_batch_size, forward_only=False, force_all_reduce=(step == 0))
            if step == 0:
                for c in chunks:
                    grad_pieces += adapter.local_pieces(c, tp_rank, shapes, grads=True)
            if args.optimizer == "muon":
                opt.step(clip_coefficient(grad_norm_fp32(chunks), args.clip_grad))
            else:
                opt.step()
            if last_stage:
                sums = torch.tensor([[float(o["lm_sum"])] + [float(s) for s in o["mtp_sums"]] + [float(o["n"])]
                                     for o in out], dtype=torch.float64).sum(0)
                sums = all_reduce_host(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
                losses.append((sums[:-1] / sums[-1]).tolist())
        weight_pieces = []
        for c in chunks:
            weight_pieces += adapter.local_pieces(c, tp_rank, shapes, grads=False)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object({"losses": losses if last_stage and dp_rank == 0 and ps.get_tensor_model_parallel_rank() == 0
                            and ps.get_context_parallel_rank() == 0 else None,
                            "grads": grad_pieces, "weights": weight_pieces}, gathered, dst=0)
        if rank == 0:
            loss_seq = next(g["losses"] for g in gathered if g["losses"] is not None)
            results.append({"layout": spec, "losses": loss_seq,
                            "grads": [p for g in gathered for p in g["grads"]],
                            "weights": [p for g in gathered for p in g["weights"]]})
        dist.barrier()
    if rank == 0:
        torch.save(results, os.path.join(tmpdir, "result.pt"))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.double() - b.double()).norm().item()
    n = b.double().norm().item()
    return d / n if n > 0 else d


def compare(golden_losses, golden_grads, golden_final, res, shapes):
    from . import adapter

    errs = {}
    for s, (gl, ml) in enumerate(zip(golden_losses, res["losses"])):
        for j, (a, b) in enumerate(zip(ml, gl)):
            errs[f"loss[step{s + 1}]" + ("" if j == 0 else f".mtp{j}")] = abs(a - b) / max(abs(b), 1e-12)
    if len(res["losses"]) != len(golden_losses):
        errs["loss_steps"] = float("inf")
    for what, golden, pieces_ in (("grad", golden_grads, res["grads"]), ("weight", golden_final, res["weights"])):
        full, covered = adapter.assemble(pieces_, shapes)
        for name, ref in golden.items():
            if name not in full:
                if what == "grad" and ref.abs().max() == 0:
                    continue  # a parameter the math never uses (layer 0's attention mixer)
                errs[f"{what}:{name}:missing"] = float("inf")
                continue
            if not bool(covered[name].all()):
                errs[f"{what}:{name}:not-covered"] = float("inf")
                continue
            errs[f"{what}:{name}"] = _rel(full[name], ref.float())
    return errs


@friendly_errors
def main(argv=None):
    ap = ArgumentParser(prog="verify_parallel.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tiny", help=f"one of: {', '.join(PRESETS)}")
    ap.add_argument("--config", help="model config file instead of --preset")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--also", action="append", default=[], metavar="SPEC",
                    help="another layout to check in the same process group, e.g. 'tp=2,sp=1' or 'dp=2,distopt=1' "
                         "(keys: tp pp ep cp dp vpp sp distopt); the world size must match")
    ap.add_argument("--mtp", type=int, default=None, help="MTP depth (default: the config's)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-length", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                    help="muon: per-head Muon for hidden matrices + AdamW for the rest (megatron_k3/optim/muon.py)")
    ap.add_argument("--adam-eps", type=float, default=1e-4,
                    help="Adam epsilon for the check (1e-4: see the module docstring on conditioning)")
    ap.add_argument("--mtp-loss-weight", type=float, default=0.1)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--json", help="write every error to this JSON file")
    args = ap.parse_args(argv)

    cfg = load_config(args.config) if args.config else get_preset(args.preset)
    if args.mtp is not None:
        cfg = cfg.replace(num_nextn_predict_layers=args.mtp).validate()
    main_spec = (f"tp={args.tp},pp={args.pp},ep={args.ep},cp={args.cp},dp={args.dp},vpp={args.vpp},"
                 f"sp={int(args.sequence_parallel)},distopt={int(args.distributed_optimizer)}")
    specs = [main_spec] + args.also
    world = None
    for spec in specs:  # every layout is checked before any rank starts
        layout, distopt = parse_layout_spec(spec)
        if distopt and args.optimizer == "muon":
            raise LayoutError(f"layout {layout.describe()}: Muon runs without the distributed optimizer "
                              "(megatron's distributed optimizer shards flat buffers and supports Adam only)")
        layout.validate(cfg, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                        global_batch_size=args.global_batch)
        if world is None:
            world = layout.world_size
        elif layout.world_size != world:
            raise LayoutError(f"layout {layout.describe()}: world size {layout.world_size} != {world} of the first layout")

    batches = make_batches(cfg, args.steps, args.global_batch, args.seq_length, args.seed, cfg.num_nextn_predict_layers)
    init, g_losses, g_grads, g_final = run_golden(cfg, batches, args)
    with tempfile.TemporaryDirectory(prefix="k3verify-") as tmp:
        torch.save({"init": init, "batches": batches}, os.path.join(tmp, "golden.pt"))
        import torch.multiprocessing as mp

        mp.start_processes(_worker, args=(world, free_port(), tmp, cfg.to_dict(), specs, vars(args)),
                           nprocs=world, join=True, start_method="spawn")
        results = torch.load(os.path.join(tmp, "result.pt"), weights_only=False)  # our own temp file
    shapes = {k: v.shape for k, v in init.items()}
    worst_all = 0.0
    report = {}
    for res in results:
        errs = compare(g_losses, g_grads, g_final, res, shapes)
        worst_name = max(errs, key=errs.get)
        worst = errs[worst_name]
        worst_all = max(worst_all, worst)
        kinds = {k: max(v for n, v in errs.items() if n.startswith(k)) for k in ("loss", "grad", "weight")}
        print(f"[verify] {res['layout']}: loss {kinds['loss']:.2e}  grad {kinds['grad']:.2e}  "
              f"weight {kinds['weight']:.2e}  (worst: {worst_name})", flush=True)
        report[res["layout"]] = errs
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tolerance": args.tolerance, "max_rel_err": worst_all, "layouts": report}, f, indent=1)
    ok = worst_all <= args.tolerance
    print(f"max_rel_err={worst_all:.3e} {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
