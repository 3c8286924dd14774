"""K3 pretraining on megatron-core: ``python -m megatron_k3.pretrain`` / ``launchers/pretrain_k3.py``.

One process per GPU (or CPU rank) launched by torchrun/srun; run alone it is a world of one. Flags use
megatron's names; ``--config FILE`` (YAML/TOML/JSON) may hold a ``model`` section (a preset name and/or
K3Config fields) and a ``train`` section with any flag (``train-iters`` or ``train_iters``); flags given
on the command line win. Everything is validated before the first forward pass.

The loop, per step: take this DP rank's micro-batches from the TokenLoader, run megatron's schedule
(1F1B / interleaved / no pipelining) with gradient accumulation over the micro-batches, finalize gradients
(DP/TP reductions, the MoE bias sign update from the counts of *all* micro-batches and DP ranks, then
re-centred to zero mean), clip, step AdamW, step the LR schedule (warmup given as a fraction of the steps),
log loss / lr / grad norm / tokens/s and per-MoE-layer routing statistics to the console, the run's
``metrics.jsonl`` and wandb (offline by default).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import torch

from .cli import UsageError, friendly_errors
from .config import ConfigError, get_preset
from .layout import ParallelLayout

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def build_parser():
    ap = argparse.ArgumentParser(prog="pretrain_k3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--config", help="YAML/TOML/JSON with optional 'model' and 'train' sections")
    a("--preset", default=None, help="model preset (k3-tiny, k3-mini, k3-full, kimi-linear-48b)")
    # parallel layout (megatron names)
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--virtual-pipeline-model-parallel-size", type=int, default=1)
    a("--decoder-first-pipeline-num-layers", type=int, default=None,
      help="layers of the first pipeline stage (uneven split; the middle stages share the rest evenly)")
    a("--decoder-last-pipeline-num-layers", type=int, default=None,
      help="layers of the last pipeline stage (e.g. k3-full at PP4: 21, giving 24,24,24,21 in whole AttnRes blocks)")
    a("--expert-model-parallel-size", type=int, default=1)
    a("--context-parallel-size", type=int, default=1)
    a("--sequence-parallel", action="store_true")
    a("--use-distributed-optimizer", action="store_true")
    # batch and schedule
    a("--micro-batch-size", type=int, default=4)
    a("--global-batch-size", type=int, default=8)
    a("--seq-length", type=int, default=None, help="default: the model config's seq_length")
    a("--train-iters", type=int, default=300)
    a("--lr", type=float, default=3e-3)
    a("--min-lr", type=float, default=3e-4)
    a("--lr-warmup-fraction", type=float, default=0.05, help="warmup steps = round(fraction x train iters)")
    a("--lr-decay-style", choices=["cosine", "WSD", "linear", "constant"], default="cosine")
    a("--lr-wsd-decay-fraction", type=float, default=0.2, help="WSD: fraction of the steps spent decaying")
    a("--optimizer", choices=["adam", "muon"], default="adam",
      help="adam: megatron's AdamW (optionally distributed); muon: per-head Muon + AdamW (megatron_k3/optim.py)")
    a("--optimizer-offload", choices=["none", "host-stream"], default="none",
      help="host-stream: AdamW state (fp32 master + moments) in pinned host memory, gradients streamed in "
           "chunks, update on the CPU (megatron_k3/offload.py); with or without the distributed optimizer")
    a("--offload-moments-dtype", choices=["bf16", "fp32"], default="bf16", help="host-stream moments")
    a("--weight-decay", type=float, default=0.1)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.95)
    a("--adam-eps", type=float, default=1e-8)
    a("--clip-grad", type=float, default=1.0)
    a("--bf16", action="store_true")
    a("--fp8-recipe", choices=["delayed", "tensorwise", "blockwise", "mxfp8"], default=None,
      help="FP8 through Transformer Engine (megatron_k3/precision.py): blockwise on Hopper, mxfp8 on Blackwell "
           "(refused on older GPUs); needs --bf16")
    a("--fp8-format", choices=["e4m3", "hybrid"], default=None, help="FP8 format (default e4m3 when FP8 is on)")
    # model extras
    a("--mtp-num-layers", type=int, default=None, help="MTP depth (default: the model config's)")
    a("--mtp-loss-scaling-factor", type=float, default=0.1)
    a("--recompute-granularity", choices=["none", "selective", "full"], default="none",
      help="selective: recompute the token mixers' cores and FFN activations; full: whole layers")
    a("--cuda-graph-impl", choices=["none", "local"], default="none",
      help="local: each decoder layer's forward and backward as CUDA graphs, captured before the first step "
           "(megatron_k3/megatron/graphs.py; one GPU stage, EP = TP = CP = 1, no full recompute, no FP8)")
    a("--moe-router-load-balancing-type", choices=["sign", "quantile", "none"], default="sign",
      help="aux-loss-free balancing of e_score_correction_bias: zero-centred sign update, K3's Quantile "
           "Balancing, or none (see megatron_k3/balancing.py)")
    a("--moe-router-bias-update-rate", type=float, default=1e-3, help="step of the sign update")
    # data
    a("--data-path", default=None, help="zarr token store (tools/prepare_data.py); default: the embedded corpus")
    a("--tokenizer-model", default=None, help="tokenizer.json or Kimi tiktoken.model (checked against the store)")
    a("--data-backend", choices=["default", "dali"], default="default",
      help="dali: the same windows through an NVIDIA DALI pipeline (extra 'dali')")
    a("--seed", type=int, default=1234)
    # output
    a("--run-dir", default="runs/pretrain")
    a("--log-interval", type=int, default=10)
    a("--export-weights", default=None,
      help="at the end, gather the weights into one HF-named state dict file (.pt, relative paths are in the "
           "run dir) on rank 0 (small models; e.g. for tools/probe_moe.py)")
    # checkpoints (checkpoints_io/k3ckpt.py)
    a("--save", default=None, help="checkpoint directory (iter_XXXXXXX/ + latest_checkpointed_iteration.txt)")
    a("--load", default=None, help="resume from this directory's latest checkpoint (or an iter_* dir); a directory "
                                   "without a checkpoint starts from scratch, so one command serves start and restart")
    a("--save-interval", type=int, default=None, help="save every N steps (and at the end) when --save is given")
    a("--ckpt-writer", choices=["odirect", "buffered"], default="odirect",
      help="DCP storage writer: O_DIRECT (falls back to buffered with a warning where unsupported) or buffered")
    a("--ckpt-keep-last", type=int, default=0, help="keep only the newest N checkpoints (0: keep all)")
    a("--no-load-optim", action="store_true", help="with --load: weights only; fresh optimizer")
    a("--no-load-rng", action="store_true", help="with --load: do not restore the RNG states")
    a("--exit-signal-handler", action="store_true",
      help="on SIGTERM/SIGUSR1: finish the step, save a checkpoint, exit with code 3 (EXIT_SAVED_ON_SIGNAL)")
    a("--exit-interval", type=int, default=None, help="stop (after saving, with --save) once the step is a multiple of N")
    a("--wandb-project", default=None, help="log online to this wandb project (default: offline run in the run dir)")
    a("--wandb-mode", choices=["offline", "online", "disabled"], default="offline")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    model_section = {}
    if args.config:
        from pathlib import Path

        p = Path(args.config)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        import tomllib

        import yaml

        text = p.read_text()
        data = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text) or {}
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                 if a.startswith("--")}
        for k, v in (data.get("train") or {}).items():
            key = k.replace("-", "_")
            if not hasattr(args, key):
                raise ConfigError(f"{p}: unknown train option '{k}'")
            if key not in given:
                setattr(args, key, v)
        model_section = data.get("model") or {}
    return args, model_section


def resolve_model_config(args, model_section):
    from .config import K3Config

    section = dict(model_section)
    file_preset = section.pop("preset", None)
    preset = args.preset or file_preset or "k3-tiny"
    cfg = get_preset(preset, **section) if section else get_preset(preset)
    over = {}
    if args.mtp_num_layers is not None:
        over["num_nextn_predict_layers"] = args.mtp_num_layers
    if args.seq_length is not None:
        over["seq_length"] = args.seq_length
    if over:
        cfg = cfg.replace(**over).validate()
    assert isinstance(cfg, K3Config)
    return cfg


def lr_schedule(args):
    """(warmup steps, lr(step)) with warmup as a fraction of the run (never silently shortened)."""
    T = args.train_iters
    if not 0 <= args.lr_warmup_fraction < 1:
        raise ConfigError("--lr-warmup-fraction must be in [0, 1)")
    warm = round(args.lr_warmup_fraction * T)
    if args.lr_warmup_fraction > 0 and warm == 0:
        raise ConfigError(f"--lr-warmup-fraction {args.lr_warmup_fraction} of {T} steps rounds to 0 warmup steps; "
                          "raise the fraction or the steps")

    def lr(step):
        if step < warm:
            return args.lr * (step + 1) / warm
        t = (step - warm) / max(1, T - warm)
        if args.lr_decay_style == "constant":
            return args.lr
        if args.lr_decay_style == "linear":
            return args.min_lr + (args.lr - args.min_lr) * (1 - t)
        if args.lr_decay_style == "WSD":
            d = max(1, round(args.lr_wsd_decay_fraction * T))
            if step < T - d:
                return args.lr
            return args.min_lr + (args.lr - args.min_lr) * (T - step) / d
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))

    return warm, lr


def _layout_from_args(args, world, num_layers):
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world % (tp * pp * cp):
        raise ConfigError(f"world size {world} is not divisible by TP*PP*CP = {tp * pp * cp}")
    return ParallelLayout(tp=tp, pp=pp, cp=cp, ep=args.expert_model_parallel_size, dp=world // (tp * pp * cp),
                          vpp=args.virtual_pipeline_model_parallel_size, sequence_parallel=args.sequence_parallel,
                          layers_per_stage=_uneven_split(args, num_layers))


def _uneven_split(args, num_layers):
    """megatron's --decoder-first/last-pipeline-num-layers -> layers per stage (None: even split)."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is None and last is None:
        return None
    pp = args.pipeline_model_parallel_size
    if pp < 2 or args.virtual_pipeline_model_parallel_size > 1:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need PP >= 2 and no virtual pipeline")
    rest, middle = num_layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and (rest % middle or rest == 0)):
        raise ConfigError(f"{num_layers} layers cannot be split as first={first}, last={last} over PP{pp} "
                          f"(the {max(middle, 0)} middle stage(s) must share the remaining {rest} layers evenly)")
    mid = [rest // middle] * middle if middle else []
    return ([first] if first is not None else []) + mid + ([last] if last is not None else [])


def default_data(cfg):
    """The embedded corpus tokenized with the embedded tokenizer (built once into data/cache/)."""
    tok = os.path.join(DEFAULT_DATA, "tokenizer", f"k3-tiny-bpe{cfg.vocab_size}.json")
    if not os.path.isfile(tok):
        raise ConfigError(f"no --data-path given and no embedded tokenizer for vocabulary {cfg.vocab_size} "
                          "(the embedded corpus ships a 512-token BPE for k3-tiny)")
    store = os.path.join(DEFAULT_DATA, "cache", f"python-docs-bpe{cfg.vocab_size}.zarr")
    return store, tok


def ensure_default_store(store, tok):
    """Build the default store once. Each builder writes its own temporary directory and renames it into
    place, so two processes that start at the same time (two jobs, two test workers) never write into one
    directory; the second rename finds the store there and its copy is dropped."""
    if os.path.exists(os.path.join(store, "zarr.json")):
        return
    import shutil
    import socket

    from .data.prepare import prepare

    tmp = f"{store}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    prepare([os.path.join(DEFAULT_DATA, "corpus")], tok, tmp, workers=2, progress=False)
    try:
        os.replace(tmp, store)
    except OSError:  # another builder's rename came first (a directory is not replaced when non-empty)
        if not os.path.exists(os.path.join(store, "zarr.json")):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------
@friendly_errors
def main(argv=None):
    args, model_section = parse_args(argv)
    cfg = resolve_model_config(args, model_section)
    from .launch_env import discover

    discover()  # torchrun / srun / mpiexec / single process
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    layout = _layout_from_args(args, world, cfg.num_hidden_layers)
    layout.validate(cfg, seq_length=cfg.seq_length, micro_batch_size=args.micro_batch_size,
                    global_batch_size=args.global_batch_size, world_size=world)
    if args.train_iters < 1:
        raise UsageError("--train-iters must be >= 1")
    if args.save_interval is not None and args.save_interval < 1:
        raise UsageError("--save-interval must be >= 1")
    if args.save and os.path.exists(args.save) and not os.path.isdir(args.save):
        raise UsageError(f"--save {args.save} exists and is not a directory")
    if args.load and not os.path.exists(args.load) and os.path.abspath(args.load) != os.path.abspath(args.save or ""):
        raise UsageError(f"--load {args.load}: no such directory (only --load equal to --save may not exist yet)")
    if (args.fp8_recipe or args.fp8_format) and not args.bf16:
        raise UsageError("--fp8-recipe/--fp8-format train the FP8 GEMMs of a bf16 model: add --bf16")
    from .precision import check_fp8_here

    check_fp8_here(args.fp8_recipe, args.fp8_format, args.recompute_granularity)
    from .megatron.graphs import check_cuda_graphs

    check_cuda_graphs(args.cuda_graph_impl, layout, args.recompute_granularity, args.fp8_recipe, bf16=args.bf16)
    if args.optimizer == "muon" and args.optimizer_offload != "none":
        raise UsageError("--optimizer-offload host-stream streams AdamW only; use --optimizer adam")
    if args.optimizer == "muon" and args.use_distributed_optimizer:
        raise UsageError("--optimizer muon runs without --use-distributed-optimizer (megatron's shards Adam state only)")
    warm, lr_at = lr_schedule(args)

    # data and tokenizer: checked before any compute
    from .data.store import open_store
    from .data.tokenizer import load_tokenizer

    if args.data_path is None:
        store, tok_path = default_data(cfg)
        if rank == 0:
            ensure_default_store(store, tok_path)
        else:  # rank 0 builds it once; the rename into place makes it appear complete
            deadline = time.time() + 600
            while not os.path.exists(os.path.join(store, "zarr.json")) and time.time() < deadline:
                time.sleep(0.5)
        args.data_path, args.tokenizer_model = store, args.tokenizer_model or tok_path
    _, _, manifest = open_store(args.data_path)
    tvocab = manifest["tokenizer"]["vocab_size"]
    if tvocab > cfg.vocab_size:
        raise ConfigError(f"the token store's tokenizer has {tvocab} ids but the model's vocabulary is "
                          f"{cfg.vocab_size}: token ids would fall outside the embedding")
    pad_id, args.tokenizer_identity = None, dict(manifest["tokenizer"])
    if args.tokenizer_model:
        tok = load_tokenizer(args.tokenizer_model)
        args.tokenizer_identity = {**tok.identity(), "path": os.path.abspath(str(tok.path))}
        if tok.identity()["sha256"] != manifest["tokenizer"]["sha256"]:
            raise ConfigError(f"tokenizer {args.tokenizer_model} is not the one the store {args.data_path} "
                              "was tokenized with (sha256 differs)")
        pad_id = tok.pad_id

    train(args, cfg, layout, warm, lr_at, pad_id)


EXIT_SAVED_ON_SIGNAL = 3


def _install_signal_handler():
    """SIGTERM/SIGUSR1 set a flag; the loop saves and exits at the next step boundary (all ranks agree)."""
    import signal

    state = {"flag": False}

    def handler(signum, frame):
        state["flag"] = True
        print(f"[pretrain] received signal {signum}: saving at the end of this step", flush=True)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, handler)
    return state


def _agree(flag: bool) -> bool:
    """True on every rank if any rank got the signal (a signal may reach only some ranks)."""
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _trainer_state(args, loader, step, tokens_seen):
    return {"consumed_tokens": tokens_seen, "loader": loader.state_dict(), "tokenizer": args.tokenizer_identity,
            "optimizer": args.optimizer, "data_path": os.path.abspath(args.data_path),
            "balancing": args.moe_router_load_balancing_type}


def _save(args, cfg, chunks, opt, loader, step, tokens_seen, hf_shapes):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from checkpoints_io.k3ckpt import save_checkpoint

    t = time.time()
    path = save_checkpoint(args.save, step, chunks, opt, cfg, _trainer_state(args, loader, step, tokens_seen),
                           tp_rank=ps.get_tensor_model_parallel_rank(), writer=args.ckpt_writer,
                           keep_last=args.ckpt_keep_last, hf_shapes=hf_shapes)
    if dist.get_rank() == 0:
        print(f"[pretrain] saved step {step} to {path} in {time.time() - t:.2f} s", flush=True)


def _resume(args, cfg, chunks, opt, loader, hf_shapes):
    """Load ``--load``'s latest checkpoint; returns (start step, consumed tokens)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from checkpoints_io.k3ckpt import CheckpointError, load_checkpoint

    meta = load_checkpoint(args.load, chunks, opt, cfg, tp_rank=ps.get_tensor_model_parallel_rank(),
                           load_optim=not args.no_load_optim, load_rng=not args.no_load_rng, hf_shapes=hf_shapes)
    if meta is None:
        if dist.get_rank() == 0:
            print(f"[pretrain] no checkpoint in {args.load}: starting from scratch", flush=True)
        return 0, 0
    if meta.get("weights_only"):
        if dist.get_rank() == 0:
            print(f"[pretrain] loaded weights from {meta['path']} (weights only: fresh optimizer and data order)",
                  flush=True)
        return 0, 0
    tok = meta.get("tokenizer") or {}
    if tok.get("sha256") and tok["sha256"] != args.tokenizer_identity.get("sha256"):
        raise CheckpointError(f"{meta['path']}: saved with tokenizer {tok.get('file')} (sha256 {tok['sha256'][:12]}) "
                              f"but this run uses {args.tokenizer_identity.get('file')} "
                              f"(sha256 {args.tokenizer_identity.get('sha256', '')[:12]})")
    if meta.get("optimizer") != args.optimizer and not args.no_load_optim:
        raise CheckpointError(f"{meta['path']}: saved with --optimizer {meta.get('optimizer')}, this run uses "
                              f"--optimizer {args.optimizer} (add --no-load-optim to load the weights only)")
    loader.load_state_dict(meta["loader"])
    if dist.get_rank() == 0:
        print(f"[pretrain] resumed from {meta['path']} at step {meta['step']} "
              f"({meta['consumed_tokens']:,} tokens consumed)", flush=True)
    return int(meta["step"]), int(meta["consumed_tokens"])


def train(args, cfg, layout, warm, lr_at, pad_id):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .data.dali import make_loader
    from .megatron import adapter
    from .megatron.runtime import (build_model_chunks, build_optimizer, init_distributed,
                                   make_forward_step, wrap_ddp)
    from .metrics import MetricsLogger, routing_stats
    from .model import K3ForCausalLM, hf_shapes

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    device = init_distributed(layout, seed=args.seed)
    from .megatron.graphs import use_graph_stream

    use_graph_stream(args.cuda_graph_impl)  # before the model and DDP (graphs.py, "Streams")
    rank = dist.get_rank()
    from .precision import resolve as fp8_fields

    chunks, tconfig = build_model_chunks(cfg, layout, params_dtype=dtype, device=device,
                                         recompute=args.recompute_granularity,
                                         **fp8_fields(args.fp8_recipe, args.fp8_format),
                                         moe_router_bias_update_rate=(args.moe_router_bias_update_rate
                                                                      if args.moe_router_load_balancing_type == "sign"
                                                                      else 0.0))
    from .megatron.runtime import moe_routers

    for _, r in moe_routers(chunks):
        r.k3_balancing = args.moe_router_load_balancing_type
    # from-scratch init: the golden model's explicit, seeded initialisation, sliced into this rank's shards
    golden_sd = K3ForCausalLM(cfg, seed=args.seed).state_dict()
    for c in chunks:
        adapter.load_hf_state_dict(c, golden_sd, ps.get_tensor_model_parallel_rank())
    del golden_sd
    ddp = wrap_ddp(chunks, tconfig, args.use_distributed_optimizer)
    if args.optimizer == "muon":
        from .megatron.runtime import build_muon, grad_norm_fp32
        from .optim import clip_coefficient

        opt = build_muon(chunks, lr=args.lr, weight_decay=args.weight_decay, adam_eps=args.adam_eps,
                         beta1=args.adam_beta1, beta2=args.adam_beta2)
    elif args.optimizer_offload == "host-stream":
        from .offload import build_host_stream_optimizer

        opt = build_host_stream_optimizer(ddp, lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                                          use_distributed_optimizer=args.use_distributed_optimizer, bf16=args.bf16,
                                          adam_eps=args.adam_eps, beta1=args.adam_beta1, beta2=args.adam_beta2,
                                          moments_dtype=(torch.bfloat16 if args.offload_moments_dtype == "bf16"
                                                         else torch.float32))
    else:
        opt = build_optimizer(ddp, lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                              use_distributed_optimizer=args.use_distributed_optimizer, bf16=args.bf16,
                              adam_eps=args.adam_eps, beta1=args.adam_beta1, beta2=args.adam_beta2)
    loader = make_loader(args.data_backend, args.data_path, cfg.seq_length, args.micro_batch_size,
                         args.global_batch_size, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                         seed=args.seed, pad_id=pad_id, device_id=(device.index if device.type == "cuda" else None))
    fb = get_forward_backward_func()
    fstep = make_forward_step(args.mtp_loss_scaling_factor)
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    log = MetricsLogger(args.run_dir, {**vars(args), "model": cfg.to_dict(), "layout": layout.describe()},
                        args.wandb_project, args.wandb_mode, enabled=(rank == 0))
    if rank == 0:
        print(f"[pretrain] {cfg.name}: {cfg.num_hidden_layers} layers, layout {layout.describe()}, "
              f"{n_params:,} parameters on rank 0; {args.train_iters} steps x {args.global_batch_size} x "
              f"{cfg.seq_length} tokens; warmup {warm} steps ({args.lr_warmup_fraction:.0%}); data "
              f"{args.data_path} ({loader.num_windows} windows)", flush=True)
    shapes = functools.cache(lambda: hf_shapes(cfg))  # HF name -> shape (a meta build), when first needed
    start_step, tokens_seen = 0, 0
    if args.load:
        start_step, tokens_seen = _resume(args, cfg, chunks, opt, loader, shapes())
    if args.cuda_graph_impl == "local":  # after the resume: the graphs read the parameters in place
        from .megatron.graphs import capture_layer_graphs

        n = capture_layer_graphs(chunks, ddp, args.micro_batch_size, cfg.seq_length // layout.cp)
        if rank == 0:
            print(f"[pretrain] captured CUDA graphs of {n} decoder layers", flush=True)
    stop = _install_signal_handler() if args.exit_signal_handler else None
    t0 = time.time()
    tokens_at_start = tokens_seen
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    for step in range(start_step, args.train_iters):
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        micro = [{k: v.to(device) for k, v in m.items()} for m in loader.next_step()]
        for d in ddp:
            d.zero_grad_buffer()
        opt.zero_grad()
        pre_counts = []
        tconfig.k3_capture_counts = pre_counts  # finalize_k3_grads records the step's counts here
        out = fb(forward_step_func=fstep, data_iterator=[iter(micro) for _ in ddp] if len(ddp) > 1 else iter(micro),
                 model=ddp if len(ddp) > 1 else ddp[0], num_microbatches=loader.num_micro,
                 seq_length=cfg.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)
        if args.optimizer == "muon":
            gnorm = grad_norm_fp32(chunks)
            opt.step(clip_coefficient(gnorm, args.clip_grad))
        else:
            ok, gnorm, _ = opt.step()
        tokens_seen += args.global_batch_size * cfg.seq_length
        # loss over the global batch (last stage), shared with every rank for logging
        sums = torch.zeros(3, dtype=torch.float64)
        if last_stage:
            for o in out:
                sums += torch.tensor([float(o["lm_sum"]), sum(float(s) for s in o["mtp_sums"]), float(o["n"])],
                                     dtype=torch.float64)
            dist.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
        dist.all_reduce(sums, op=dist.ReduceOp.MAX, group=ps.get_pipeline_model_parallel_group())
        loss = (sums[0] / sums[2]).item()
        if not math.isfinite(loss):
            raise SystemExit(f"[pretrain] non-finite loss at step {step + 1}; stopping (no checkpoint is written)")
        # routing stats from the step's counts (all micro-batches, all TP/DP/CP ranks), gathered to rank 0
        layer_stats = {name: routing_stats(c) for name, c in pre_counts}
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(layer_stats, gathered, dst=0)
        if rank == 0:
            stats = {}
            for g in gathered:
                stats.update(g)
            dt = time.time() - t0
            rec = {"step": step + 1, "loss": loss, "lm_loss": loss, "lr": lr, "grad_norm": float(gnorm or 0.0),
                   "tokens": tokens_seen, "tokens_per_s": (tokens_seen - tokens_at_start) / dt, "elapsed_s": round(dt, 3),
                   "epoch": loader.epoch}
            if sums[1] > 0:
                rec["mtp_loss"] = (sums[1] / sums[2]).item()
                rec["loss"] = loss + args.mtp_loss_scaling_factor * rec["mtp_loss"] / max(1, cfg.num_nextn_predict_layers)
            if stats:
                ents = [s["entropy"] for s in stats.values()]
                rec["routing_entropy_min"] = min(ents)
                rec["routing_entropy_mean"] = sum(ents) / len(ents)
                rec["dead_experts"] = sum(s["dead"] for s in stats.values())
                rec["max_mean_load_worst"] = max(s["max_mean"] for s in stats.values())
                for name, s in sorted(stats.items(), key=lambda kv: int(kv[0])):
                    for k, v in s.items():
                        rec[f"moe/{name}/{k}"] = v
            log.log(rec)
            if step % args.log_interval == 0 or step == args.train_iters - 1:
                extra = (f"  entropy {rec['routing_entropy_min']:.3f}/{rec['routing_entropy_mean']:.3f}  "
                         f"dead {rec['dead_experts']}") if stats else ""
                print(f"step {step + 1:6d}/{args.train_iters}  loss {loss:.4f}  lr {lr:.2e}  grad_norm "
                      f"{rec['grad_norm']:.3f}  {rec['tokens_per_s']:.0f} tok/s{extra}", flush=True)
        done = step + 1
        signalled = stop is not None and _agree(stop["flag"])
        exiting = signalled or (args.exit_interval and done % args.exit_interval == 0 and done < args.train_iters)
        if args.save and (done == args.train_iters or exiting or (args.save_interval and done % args.save_interval == 0)):
            _save(args, cfg, chunks, opt, loader, done, tokens_seen, shapes())
        if exiting:
            loader.close()
            if rank == 0:
                log.close()
                print(f"[pretrain] stopping after step {done} ({'signal' if signalled else '--exit-interval'})"
                      + (f"; checkpoint in {args.save}" if args.save else ""), flush=True)
            ps.destroy_model_parallel()
            dist.destroy_process_group()
            if signalled:
                raise SystemExit(EXIT_SAVED_ON_SIGNAL)
            return
    loader.close()
    if args.export_weights:
        from .megatron.adapter import assemble, local_pieces

        if not os.path.isabs(args.export_weights):  # relative to the run directory
            args.export_weights = os.path.join(args.run_dir, args.export_weights)
        pieces = [p for c in chunks for p in local_pieces(c, ps.get_tensor_model_parallel_rank(), shapes())]
        allp = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(pieces, allp, dst=0)
        if rank == 0:
            full, covered = assemble([p for g in allp for p in g], shapes())
            missing = [k for k in shapes() if k not in full or not bool(covered[k].all())]
            if missing:
                raise RuntimeError(f"export: {len(missing)} tensors not covered, e.g. {missing[0]}")
            torch.save(full, args.export_weights)
            print(f"[pretrain] exported {len(full)} tensors to {args.export_weights}", flush=True)
    if rank == 0:
        log.close()
        from .plots import plot_run

        plot_run(args.run_dir)
        print(f"[pretrain] done: {args.train_iters} steps, {tokens_seen - tokens_at_start:,} tokens in {time.time() - t0:.1f} s; "
              f"metrics: {os.path.join(args.run_dir, 'metrics.jsonl')}", flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
