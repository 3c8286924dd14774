"""The Trainer: one object owns a run, and ``train_step`` is the one training step.

``launchers/pretrain_k3.py`` (``python -m megatron_k3 train``), ``benchmarks/benchmark.py`` and the tests all run
this class; a throughput figure is the time of ``Trainer.train_step``.

    trainer = Trainer(job)      # config -> model config, layout, schedule; validated (one ConfigError line)
    trainer.setup()             # process group, this rank's model chunks (initialised per rank), DDP,
                                # optimizer, data, metrics, resume from --load, CUDA graphs
    trainer.fit()               # the loop: data -> train_step -> log -> save / signal / exit
    trainer.close()

One step (``train_step``), for the micro-batches of this data-parallel rank:
1. zero megatron DDP's gradient buffers;
2. megatron's schedule (no pipelining / 1F1B / interleaved) runs forward and backward of every micro-batch,
   accumulating into the fp32 ``main_grad`` buffers; at the end ``runtime.finalize_k3_grads`` reduces the
   gradients over DP/TP, and applies the MoE bias update from the step's expert counts;
3. the optimizer clips by the global norm and steps (megatron's AdamW, per-head Muon or the host-stream
   offload);
4. the loss sums (LM, MTP, token count) are reduced over DP x CP on the device and read once.
Everything else (learning-rate schedule, logging, checkpoints, signals) belongs to ``fit``.
"""
from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, field

import torch

from ..cli import UsageError
from ..config import ConfigError
from ..parallel.layout import ParallelLayout
from ..model.skeleton import GoldenSkeleton
from .config import JobConfig, describe

EXIT_SAVED_ON_SIGNAL = 3
EXPORT_WEIGHTS_MAX_PARAMS = 2_000_000_000
DEFAULT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")


@dataclass
class StepResult:
    """What one ``train_step`` returns (identical on every rank)."""
    lm_loss: float          # token-mean LM loss over the global batch
    mtp_loss: float | None  # token-mean MTP loss (mean over depths' sums), if the model has MTP heads
    loss: float             # lm_loss + MTP weight x mtp_loss / depths
    tokens: int             # loss tokens in the global batch
    grad_norm_t: object = None  # the optimizer's norm (a device tensor or a float): read it with grad_norm
    counts: list = field(default_factory=list)  # [(layer name, expert counts)] of this rank's MoE layers

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_t or 0.0)


# ------------------------------------------------------------------------------------------------------
# configuration -> layout and schedule (no process group needed)
def layout_from(job: JobConfig, world: int, num_layers: int) -> ParallelLayout:
    p = job.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--context-parallel-size", cp), ("--expert-model-parallel-size", p.expert_model_parallel_size),
                    ("--virtual-pipeline-model-parallel-size", p.virtual_pipeline_model_parallel_size)):
        if v < 1:
            raise ConfigError(f"{flag} must be >= 1 (got {v})")
    if world % (tp * pp * cp):
        raise ConfigError(f"world size {world} is not divisible by TP*PP*CP = {tp * pp * cp}")
    return ParallelLayout(tp=tp, pp=pp, cp=cp, ep=p.expert_model_parallel_size, dp=world // (tp * pp * cp),
                          vpp=p.virtual_pipeline_model_parallel_size, sequence_parallel=p.sequence_parallel,
                          layers_per_stage=uneven_split(job, num_layers))


def uneven_split(job: JobConfig, num_layers: int):
    """megatron's --decoder-first/last-pipeline-num-layers -> layers per stage (None: even split)."""
    p = job.parallel
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is None and last is None:
        return None
    pp = p.pipeline_model_parallel_size
    if pp < 2 or p.virtual_pipeline_model_parallel_size > 1:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need PP >= 2 and no virtual pipeline")
    rest, middle = num_layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and (rest % middle or rest == 0)):
        raise ConfigError(f"{num_layers} layers cannot be split as first={first}, last={last} over PP{pp} "
                          f"(the {max(middle, 0)} middle stage(s) must share the remaining {rest} layers evenly)")
    mid = [rest // middle] * middle if middle else []
    return ([first] if first is not None else []) + mid + ([last] if last is not None else [])


def lr_schedule(job: JobConfig):
    """(warmup steps, lr(step)): warmup = round(fraction x steps), at least one step when the fraction is > 0."""
    o, T = job.optim, job.train.train_iters
    if not 0 <= o.lr_warmup_fraction < 1:
        raise ConfigError(f"--lr-warmup-fraction must be in [0, 1) (got {o.lr_warmup_fraction})")
    warm = max(1, round(o.lr_warmup_fraction * T)) if o.lr_warmup_fraction > 0 else 0

    def lr(step):
        if step < warm:
            return o.lr * (step + 1) / warm
        t = (step - warm) / max(1, T - warm)
        if o.lr_decay_style == "constant":
            return o.lr
        if o.lr_decay_style == "linear":
            return o.min_lr + (o.lr - o.min_lr) * (1 - t)
        if o.lr_decay_style == "WSD":
            d = max(1, round(o.lr_wsd_decay_fraction * T))
            if step < T - d:
                return o.lr
            return o.min_lr + (o.lr - o.min_lr) * (T - step) / d
        return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * t))

    return warm, lr


def validate(job: JobConfig, cfg, layout: ParallelLayout, world: int) -> None:
    """Every check that needs no process group, before anything is built (one clear line each)."""
    t, c, o, pf = job.train, job.checkpoint, job.optim, job.perf
    for flag, v in (("--micro-batch-size", t.micro_batch_size), ("--global-batch-size", t.global_batch_size),
                    ("--train-iters", t.train_iters)):
        if v < 1:
            raise UsageError(f"{flag} must be >= 1 (got {v})")
    for flag, v in (("--save-interval", c.save_interval), ("--exit-interval", t.exit_interval),
                    ("--log-interval", job.logging.log_interval)):
        if v is not None and v < 1:
            raise UsageError(f"{flag} must be >= 1 (got {v})")
    if c.ckpt_keep_last < 0:
        raise UsageError(f"--ckpt-keep-last must be >= 0 (got {c.ckpt_keep_last})")
    for flag, v in (("--lr", o.lr), ("--min-lr", o.min_lr), ("--weight-decay", o.weight_decay),
                    ("--clip-grad", o.clip_grad), ("--adam-eps", o.adam_eps)):
        if not (math.isfinite(v) and v >= 0):
            raise UsageError(f"{flag} must be a finite number >= 0 (got {v})")
    layout.validate(cfg, seq_length=cfg.seq_length, micro_batch_size=t.micro_batch_size,
                    global_batch_size=t.global_batch_size, world_size=world)
    if c.save and os.path.exists(c.save) and not os.path.isdir(c.save):
        raise UsageError(f"--save {c.save} exists and is not a directory")
    if c.load and not os.path.exists(c.load) and os.path.abspath(c.load) != os.path.abspath(c.save or ""):
        raise UsageError(f"--load {c.load}: no such directory (only --load equal to --save may not exist yet)")
    if c.load and os.path.exists(c.load):
        check_load_dir(c.load)
    if (pf.fp8_recipe or pf.fp8_format) and not pf.bf16:
        raise UsageError("--fp8-recipe/--fp8-format train the FP8 GEMMs of a bf16 model: add --bf16")
    from ..parallel.graphs import check_cuda_graphs
    from ..parallel.precision import check_fp8_here

    check_fp8_here(pf.fp8_recipe, pf.fp8_format, pf.recompute_granularity)
    check_cuda_graphs(pf.cuda_graph_impl, layout, pf.recompute_granularity, pf.fp8_recipe, bf16=pf.bf16)
    if o.optimizer == "muon" and o.optimizer_offload != "none":
        raise UsageError("--optimizer-offload host-stream streams AdamW only; use --optimizer adam")
    if o.offload_chunk_mb < 1 or o.offload_buffers < 2:
        raise UsageError(f"--offload-chunk-mb must be >= 1 and --offload-buffers >= 2 "
                         f"(got {o.offload_chunk_mb} and {o.offload_buffers})")
    if o.optimizer == "muon" and job.parallel.use_distributed_optimizer:
        raise UsageError("--optimizer muon runs without --use-distributed-optimizer (megatron's shards Adam state only)")
    lr_schedule(job)


def check_load_dir(path: str) -> None:
    """``--load`` must be a checkpoint directory (``latest`` or ``iter_*``), an ``iter_*`` directory, or an empty
    one (a first start): a directory of other files is a mistyped path, not a fresh start."""
    if not os.path.isdir(path):
        raise UsageError(f"--load {path} is not a directory")
    names = os.listdir(path)
    if not names or os.path.basename(os.path.normpath(path)).startswith("iter_"):
        return
    ours = [n for n in names if n.startswith(("iter_", "latest_checkpointed_iteration"))]
    if not ours:
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise UsageError(f"--load {path} holds no checkpoint (no latest_checkpointed_iteration.txt or iter_*) but "
                         f"other files ({shown}): name the checkpoint directory, or an empty or new one to start "
                         "from scratch")


def default_data(cfg):
    """The embedded corpus tokenized with the embedded 512-token BPE (built once into data/cache/); any model
    whose vocabulary holds those ids can train on it."""
    tok = os.path.join(DEFAULT_DATA, "tokenizer", "k3-tiny-bpe512.json")
    if cfg.vocab_size < 512:
        raise ConfigError(f"no --data-path given and the model's vocabulary ({cfg.vocab_size}) is smaller than the "
                          "embedded tokenizer's 512 ids: pass --data-path and --tokenizer-model")
    return os.path.join(DEFAULT_DATA, "cache", "python-docs-bpe512.zarr"), tok


def ensure_default_store(store, tok):
    """Build the default store once. Each builder writes its own temporary directory and renames it into
    place, so two processes that start at the same time (two jobs, two test workers) never write into one
    directory; the second rename finds the store there and its copy is dropped."""
    if os.path.exists(os.path.join(store, "zarr.json")):
        return
    import shutil
    import socket

    from ..data.prepare import prepare

    tmp = f"{store}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    prepare([os.path.join(DEFAULT_DATA, "corpus")], tok, tmp, workers=2, progress=False)
    try:
        os.replace(tmp, store)
    except OSError:  # another builder's rename came first (a directory is not replaced when non-empty)
        if not os.path.exists(os.path.join(store, "zarr.json")):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def use_kernel_cache(path: str) -> str:
    """Point Triton's and Inductor's on-disk caches at ``path`` (``triton/``, ``inductor/``) and keep Triton's
    autotune results there too (``TRITON_CACHE_AUTOTUNING``: fla's KDA kernels autotune on first use, minutes on
    a fresh machine). The libraries read these variables when they first compile, so this runs before
    anything is built. Keys include the source, options and GPU, so one cache serves every node of a
    cluster and every later job."""
    path = os.path.abspath(path)
    dirs = kernel_cache_dirs(path)
    for sub, var in (("triton", "TRITON_CACHE_DIR"), ("inductor", "TORCHINDUCTOR_CACHE_DIR")):
        os.makedirs(dirs[sub], exist_ok=True)
        os.environ[var] = dirs[sub]
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
    return path


def kernel_cache_dirs(path: str) -> dict:
    """The Triton and Inductor caches under a kernel-cache directory (``use_kernel_cache``'s layout)."""
    return {"triton": os.path.join(path, "triton"), "inductor": os.path.join(path, "inductor")}


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat starttime against /proc/uptime), so the
    start-up figure includes the Python and library imports; None where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def count_files(path: str | None) -> int:
    """Files under ``path`` (0 if it does not exist): the kernel cache's size before the run."""
    return sum(len(fs) for _, _, fs in os.walk(path)) if path and os.path.isdir(path) else 0


def root_cause(e: BaseException) -> str:
    """The innermost OSError (or the last exception) behind ``e``, in one line: DCP wraps a writer's error in
    its own ``CheckpointException`` (per-rank failures) and megatron in more."""
    seen, stack, found = set(), [e], None
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            found = x
            break
        stack += [x.__cause__, x.__context__]
        for v in (getattr(x, "failures", None) or {}).values():  # torch.distributed.checkpoint's per-rank errors
            stack.append(v[0] if isinstance(v, tuple) else v)
    x = found or e
    if isinstance(x, OSError) and x.strerror:
        return f"{x.strerror}" + (f": {x.filename}" if x.filename else "")
    return f"{type(x).__name__}: {' '.join(str(x).split())[:300]}"


# ------------------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, job: JobConfig):
        from .launch_env import discover
        from ..patches import check_megatron_core

        check_megatron_core()  # one line, before anything, if megatron-core is not a version the patches know
        self.job = job
        self.cfg = job.model_config()
        discover()  # torchrun / srun / mpiexec / single process
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.layout = layout_from(job, self.world, self.cfg.num_hidden_layers)
        validate(job, self.cfg, self.layout, self.world)
        self.warmup, self.lr_at = lr_schedule(job)
        self.num_micro = job.train.global_batch_size // (job.train.micro_batch_size * self.layout.dp)
        self.pad_id = None
        self.tokenizer_identity: dict = {}
        self.start_step, self.tokens_seen = 0, 0
        self.loader = self.log = None
        self._stop = None
        self._built = False
        self.saver, self._pending_save, self.save_stalls = None, None, []

    # -- setup ---------------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Resolve and check the token store and tokenizer (before any compute)."""
        from ..data.store import open_store
        from ..data.tokenizer import load_tokenizer

        d = self.job.data
        if d.data_path is None:
            store, tok_path = default_data(self.cfg)
            if self.rank == 0:
                ensure_default_store(store, tok_path)
            else:  # rank 0 builds it once; the rename into place makes it appear complete
                deadline = time.time() + 600
                while not os.path.exists(os.path.join(store, "zarr.json")) and time.time() < deadline:
                    time.sleep(0.5)
            d.data_path, d.tokenizer_model = store, d.tokenizer_model or tok_path
        _, _, manifest = open_store(d.data_path)
        tvocab = manifest["tokenizer"]["vocab_size"]
        if tvocab > self.cfg.vocab_size:
            raise ConfigError(f"the token store's tokenizer has {tvocab} ids but the model's vocabulary is "
                              f"{self.cfg.vocab_size}: token ids would fall outside the embedding")
        self.tokenizer_identity = dict(manifest["tokenizer"])
        if not d.tokenizer_model:  # the store's own copy of its tokenizer (tools/prepare_data.py ships one)
            from ..data.prepare import store_tokenizer

            d.tokenizer_model = store_tokenizer(d.data_path)
        if d.tokenizer_model:
            tok = load_tokenizer(d.tokenizer_model)
            self.tokenizer_identity = {**tok.identity(), "path": os.path.abspath(str(tok.path))}
            if tok.identity()["sha256"] != manifest["tokenizer"]["sha256"]:
                raise ConfigError(f"tokenizer {d.tokenizer_model} is not the one the store {d.data_path} "
                                  "was tokenized with (sha256 differs)")
            self.pad_id = tok.pad_id

    def setup(self, data: bool = True) -> "Trainer":
        """Build everything of this rank (module docstring). ``data=False``: no token store (the caller feeds
        ``train_step`` itself)."""
        from .. import perf
        from ..parallel.graphs import use_graph_stream
        from ..parallel.runtime import build_model_chunks, init_distributed, moe_routers, wrap_ddp
        from ..parallel.precision import resolve as fp8_fields

        job, cfg, layout = self.job, self.cfg, self.layout
        perf.configure(**vars(job.perf.kernels()))  # before the device setup (compat reads lean_grad_clip)
        if job.perf.kernel_cache_dir or "TRITON_CACHE_DIR" not in os.environ:  # the environment's own cache stays
            self.kernel_cache = use_kernel_cache(job.perf.kernel_cache_dir or os.path.join(job.logging.run_dir,
                                                                                             "kernel_cache"))
        self.startup = {"setup_started_s": process_age_s(),
                        "kernel_cache_files_before": count_files(os.environ.get("TRITON_CACHE_DIR"))}
        t_data = time.time()
        if data:
            self.prepare_data()
        t_dist = time.time()
        self.device = init_distributed(layout, seed=job.train.seed)
        self.startup.update(data_s=t_dist - t_data, distributed_init_s=time.time() - t_dist)
        self._built = True
        use_graph_stream(job.perf.cuda_graph_impl)  # before the model and DDP (graphs.py, "Streams")
        dtype = torch.bfloat16 if job.perf.bf16 else torch.float32
        balancing = job.optim.moe_router_load_balancing_type
        t0 = time.time()
        self.chunks, self.tconfig = build_model_chunks(
            cfg, layout, params_dtype=dtype, device=self.device, recompute=job.perf.recompute_granularity,
            init_seed=job.train.seed, **fp8_fields(job.perf.fp8_recipe, job.perf.fp8_format),
            moe_router_bias_update_rate=job.optim.moe_router_bias_update_rate if balancing == "sign" else 0.0)
        self.build_s = time.time() - t0
        for _, r in moe_routers(self.chunks):
            r.k3_balancing = balancing
        t_opt = time.time()
        self.ddp = wrap_ddp(self.chunks, self.tconfig, job.parallel.use_distributed_optimizer)
        self.opt = self._build_optimizer(dtype)
        self.startup["ddp_optimizer_s"] = time.time() - t_opt
        if data:
            from megatron.core import parallel_state as ps

            from ..data.dali import make_loader

            dev = self.device
            self.loader = make_loader(job.data.data_backend, job.data.data_path, cfg.seq_length,
                                      job.train.micro_batch_size, job.train.global_batch_size,
                                      ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                                      seed=job.train.seed, pad_id=self.pad_id,
                                      device_id=(dev.index if dev.type == "cuda" else None))
        self.n_params = sum(p.numel() for c in self.chunks for p in c.parameters())
        self.shapes = GoldenSkeleton(cfg).shapes  # HF name -> shape, one golden layer at a time on meta
        if job.checkpoint.load:
            self.start_step, self.tokens_seen = self._resume()
        self.graph_capture_s = None
        if job.perf.cuda_graph_impl == "local":  # after the resume: the graphs read the parameters in place
            from ..parallel.graphs import capture_layer_graphs

            t1 = time.time()
            n = capture_layer_graphs(self.chunks, self.ddp, job.train.micro_batch_size, cfg.seq_length // layout.cp)
            self.graph_capture_s = time.time() - t1
            self._print(f"[pretrain] captured CUDA graphs of {n} decoder layers in {self.graph_capture_s:.1f} s")
        if job.checkpoint.save and job.checkpoint.async_save:  # page-lock the staging buffer now, off the loop
            self.saver = self.new_saver()
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from ..parallel.runtime import make_forward_step

        self._fb = get_forward_backward_func()
        self._fstep = make_forward_step(job.model.mtp_loss_scaling_factor)
        self.startup["setup_done_s"] = process_age_s()
        return self

    def checkpoint_bytes_estimate(self) -> int:
        """Bytes this rank stages per checkpoint: its parameters and, for the optimizer state it writes, an fp32
        master and two fp32 moments per element (an upper bound; 0 where this rank writes no optimizer state:
        a data-parallel replica other than the first without the distributed optimizer)."""
        from megatron.core import parallel_state as ps

        params = [p for c in self.chunks for p in c.parameters()]
        distopt = self.job.parallel.use_distributed_optimizer
        if not distopt and ps.get_data_parallel_rank() != 0:
            return 0
        owned = sum(p.numel() for p in params)
        if distopt:
            from checkpoints_io.k3ckpt import _optimizers

            owned = sum(q.numel() for o in _optimizers(self.opt) for g in getattr(o, "optimizer", o).param_groups
                        for q in g["params"])
        return sum(p.numel() * p.element_size() for p in params) + 12 * owned + 64 * 4 * len(params)

    def _build_optimizer(self, dtype):
        o, p = self.job.optim, self.job.parallel
        bf16 = dtype == torch.bfloat16
        if o.optimizer == "muon":
            from ..parallel.runtime import build_muon

            return build_muon(self.chunks, lr=o.lr, weight_decay=o.weight_decay, adam_eps=o.adam_eps,
                              beta1=o.adam_beta1, beta2=o.adam_beta2)
        if o.optimizer_offload == "host-stream":
            from ..optim.offload import build_host_stream_optimizer

            return build_host_stream_optimizer(
                self.ddp, lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad,
                use_distributed_optimizer=p.use_distributed_optimizer, bf16=bf16, adam_eps=o.adam_eps,
                beta1=o.adam_beta1, beta2=o.adam_beta2,
                moments_dtype=torch.bfloat16 if o.offload_moments_dtype == "bf16" else torch.float32,
                chunk_bytes=o.offload_chunk_mb << 20, num_buffers=o.offload_buffers, impl=o.offload_update,
                build_dir=os.path.join(self.kernel_cache, "host") if getattr(self, "kernel_cache", None) else None)
        from ..parallel.runtime import build_optimizer

        return build_optimizer(self.ddp, lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad,
                               use_distributed_optimizer=p.use_distributed_optimizer, bf16=bf16, adam_eps=o.adam_eps,
                               beta1=o.adam_beta1, beta2=o.adam_beta2)

    def _print(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    # -- the step ------------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict], lr: float | None = None) -> StepResult:
        """One optimizer step over this rank's micro-batches (dicts of ``tokens``/``labels`` [B, S], on any
        device), at learning rate ``lr`` (default: leave it)."""
        from megatron.core import parallel_state as ps
        from torch.profiler import record_function

        from ..parallel.collectives import ReduceOp, all_reduce

        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        dev = self.device
        micro = [{k: v.to(dev, non_blocking=True) for k, v in m.items()} for m in micro_batches]
        with record_function("k3.zero_grad"):  # the k3.* ranges name the host phases (benchmark idle_gaps)
            for d in self.ddp:
                d.zero_grad_buffer()
            self.opt.zero_grad()
        counts: list = []
        self.tconfig.k3_capture_counts = counts  # finalize_k3_grads records the step's expert counts here
        fstep = self._fstep

        def forward_step(data_iterator, model):
            with record_function("k3.forward"):
                return fstep(data_iterator, model)

        ddp = self.ddp
        with record_function("k3.forward_backward"):
            out = self._fb(forward_step_func=forward_step,
                           data_iterator=[iter(micro) for _ in ddp] if len(ddp) > 1 else iter(micro),
                           model=ddp if len(ddp) > 1 else ddp[0], num_microbatches=len(micro),
                           seq_length=self.cfg.seq_length, micro_batch_size=self.job.train.micro_batch_size,
                           forward_only=False)
        with record_function("k3.optimizer_step"):
            if self.job.optim.optimizer == "muon":
                from ..parallel.runtime import grad_norm_fp32
                from ..optim.muon import clip_coefficient

                gnorm = grad_norm_fp32(self.chunks)
                self.opt.step(clip_coefficient(gnorm, self.job.optim.clip_grad))
            else:
                _, gnorm, _ = self.opt.step()
        # loss sums over the global batch: (LM, MTP, tokens), on the device, reduced, read once
        sums = torch.zeros(3, dtype=torch.float64, device=dev)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            for o in out:
                mtp = sum((s.double() for s in o["mtp_sums"]), torch.zeros((), dtype=torch.float64, device=dev))
                sums += torch.stack([o["lm_sum"].double(), mtp, o["n"].double()])
            all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
        all_reduce(sums, ReduceOp.MAX, ps.get_pipeline_model_parallel_group())
        lm, mtp, n = sums.tolist()
        lm_loss = lm / n
        mtp_loss = mtp / n if mtp > 0 else None
        loss = lm_loss
        if mtp_loss is not None:
            loss = lm_loss + self.job.model.mtp_loss_scaling_factor * mtp_loss / max(1, self.cfg.num_nextn_predict_layers)
        return StepResult(lm_loss=lm_loss, mtp_loss=mtp_loss, loss=loss, tokens=int(n), grad_norm_t=gnorm,
                          counts=counts)

    # -- the loop ------------------------------------------------------------------------------------------
    def fit(self, max_steps: int | None = None) -> list[dict]:
        """Train from the current step to ``--train-iters`` (or ``max_steps`` more steps); returns the metrics
        records of rank 0 (empty elsewhere). Saves and exits as the checkpoint flags say."""
        import torch.distributed as dist

        from ..parallel.collectives import agree_any
        from .metrics import MetricsLogger, routing_stats

        job, cfg = self.job, self.cfg
        T = job.train.train_iters
        if self.log is None:
            self.log = MetricsLogger(job.logging.run_dir, self.record(), job.logging.wandb_project,
                                     job.logging.wandb_mode, enabled=(self.rank == 0))
            self._print(f"[pretrain] {cfg.name}: {cfg.num_hidden_layers} layers, layout {self.layout.describe()}, "
                        f"{self.n_params:,} parameters on rank 0; {T} steps x {job.train.global_batch_size} x "
                        f"{cfg.seq_length} tokens; warmup {self.warmup} steps ({job.optim.lr_warmup_fraction:.0%}); "
                        f"data {job.data.data_path} ({self.loader.num_windows} windows)\n" + describe(job))
            if self.rank == 0:
                os.makedirs(job.logging.run_dir, exist_ok=True)
                with open(os.path.join(job.logging.run_dir, "config.json"), "w") as f:
                    import json

                    json.dump(self.record(), f, indent=1, default=str)
        if job.train.exit_signal_handler and self._stop is None:
            self._stop = self._install_signal_handler()
        records = []
        t0 = time.time()
        tokens_at_start = self.tokens_seen
        end = T if max_steps is None else min(T, self.start_step + max_steps)
        first_step = self.start_step if not getattr(self, "_fit_ran", False) else -1
        self._fit_ran = True
        last = time.perf_counter()
        for step in range(self.start_step, end):
            lr = self.lr_at(step)
            res = self.train_step(self.loader.next_step(), lr)
            if not math.isfinite(res.loss):
                from ..cli import RunError

                kept = (f"; the checkpoints in {job.checkpoint.save} are untouched" if job.checkpoint.save else "")
                raise RunError(f"non-finite loss ({res.loss}) at step {step + 1}: stopping without saving{kept} "
                               "(lower --lr or check the data)")
            self.tokens_seen += job.train.global_batch_size * cfg.seq_length
            # routing stats from the step's counts (all micro-batches, all TP/DP/CP ranks), gathered to rank 0
            counts = torch.stack([c for _, c in res.counts]).cpu() if res.counts else []  # one device read
            layer_stats = {name: routing_stats(c) for (name, _), c in zip(res.counts, counts)}
            gathered = [None] * dist.get_world_size() if self.rank == 0 else None
            dist.gather_object(layer_stats, gathered, dst=0)
            now = time.perf_counter()
            step_s, last = now - last, now
            if self.rank == 0:
                stats = {}
                for g in gathered:
                    stats.update(g)
                dt = time.time() - t0
                rec = {"step": step + 1, "loss": res.loss, "lm_loss": res.lm_loss, "lr": lr,
                       "grad_norm": res.grad_norm, "tokens": self.tokens_seen,
                       "tokens_per_s": (self.tokens_seen - tokens_at_start) / dt, "elapsed_s": round(dt, 3),
                       "step_time_s": step_s, "epoch": self.loader.epoch}
                if res.mtp_loss is not None:
                    rec["mtp_loss"] = res.mtp_loss
                if torch.cuda.is_available():  # this rank's device peak so far (allocator counters: no sync)
                    rec["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 3)
                if step == first_step:  # how long a job takes to reach its first step (imports, build, kernels)
                    rec.update(self.startup_record(step_s))
                if stats:
                    ents = [s["entropy"] for s in stats.values()]
                    rec["routing_entropy_min"] = min(ents)
                    rec["routing_entropy_mean"] = sum(ents) / len(ents)
                    rec["dead_experts"] = sum(s["dead"] for s in stats.values())
                    rec["max_mean_load_worst"] = max(s["max_mean"] for s in stats.values())
                    for name, s in sorted(stats.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 10**6):
                        for k, v in s.items():
                            rec[f"moe/{name}/{k}"] = v
                self.log.log(rec)
                records.append(rec)
                if step % job.logging.log_interval == 0 or step == T - 1:
                    extra = (f"  entropy {rec['routing_entropy_min']:.3f}/{rec['routing_entropy_mean']:.3f}  "
                             f"dead {rec['dead_experts']}") if stats else ""
                    print(f"step {step + 1:6d}/{T}  loss {res.loss:.4f}  lr {lr:.2e}  grad_norm "
                          f"{rec['grad_norm']:.3f}  {rec['tokens_per_s']:.0f} tok/s{extra}", flush=True)
            done = step + 1
            self.start_step = done
            signalled = self._stop is not None and agree_any(self._stop["flag"])
            ei = job.train.exit_interval
            exiting = signalled or (ei and done % ei == 0 and done < T)
            si = job.checkpoint.save_interval
            if job.checkpoint.save and (done == T or exiting or (si and done % si == 0)):
                self.save(done)
            if exiting:
                self._print(f"[pretrain] stopping after step {done} ({'signal' if signalled else '--exit-interval'})"
                            + (f"; checkpoint in {job.checkpoint.save}" if job.checkpoint.save else ""))
                self.close()
                if signalled:
                    raise SystemExit(EXIT_SAVED_ON_SIGNAL)
                self.exited = True
                return records
            last = time.perf_counter()  # the save is not part of the next step's time
        if self.start_step >= T:
            self.finish(time.time() - t0, self.tokens_seen - tokens_at_start)
        return records

    exited = False

    def finish(self, seconds: float, tokens: int) -> None:
        """After the last step: export weights if asked, close the metrics, plots."""
        if self.job.train.export_weights:
            self.export_weights(self.job.train.export_weights)
        if self.rank == 0 and self.log is not None:
            self.log.close()
            self.log = None
            from .plots import plot_run

            plot_run(self.job.logging.run_dir)
            print(f"[pretrain] done: {self.job.train.train_iters} steps, {tokens:,} tokens in {seconds:.1f} s; "
                  f"metrics: {os.path.join(self.job.logging.run_dir, 'metrics.jsonl')}", flush=True)

    def close(self, destroy_process_group: bool = True) -> None:
        """Wait for a checkpoint still being written, stop the data thread, close the metrics, release the
        model, its graphs, megatron's parallel state and (unless told not to: the benchmark's baselines use
        it) the process group. Idempotent."""
        try:
            self.wait_for_save()
        finally:
            self._close(destroy_process_group)

    def _close(self, destroy_process_group: bool) -> None:
        if self.saver is not None:
            self.saver.close()
            self.saver = None
        if self.loader is not None:
            self.loader.close()
        if self.rank == 0 and self.log is not None:
            self.log.close()
            self.log = None
        if self._built:
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            from ..parallel.graphs import release_layer_graphs

            release_layer_graphs(self.chunks)
            self.chunks = self.ddp = self.opt = self._fb = self._fstep = None
            ps.destroy_model_parallel()
            if destroy_process_group and dist.is_initialized():
                dist.destroy_process_group()
            self._built = False

    def startup_record(self, first_step_s: float) -> dict:
        """The start-up of this process up to the end of its first step, for the first metrics record and
        one console line: ``startup_s`` (process start to the end of the first step, imports included),
        ``setup_started_s`` (process start to ``setup``: imports), ``build_s`` (model chunks),
        ``graph_capture_s``, ``first_step_s`` (the first step itself: kernel compilation and autotuning unless
        the kernel cache has them), the kernel cache's file count before the run, and the smaller parts of the
        setup: ``data_s`` (token store and tokenizer checks), ``distributed_init_s`` (process group, parallel
        state, the device's context) and ``ddp_optimizer_s`` (gradient buffers and the optimizer)."""
        age = process_age_s()
        st = dict(self.startup, build_s=self.build_s, graph_capture_s=self.graph_capture_s,
                  first_step_s=first_step_s, startup_s=age)
        st = {k: round(v, 2) if isinstance(v, float) else v for k, v in st.items()}
        if age is not None:
            graphs = "" if st["graph_capture_s"] is None else f", graphs {st['graph_capture_s']} s"
            self._print(f"[pretrain] first step done {st['startup_s']} s after the process started (imports "
                        f"{st.get('setup_started_s')} s, setup {st.get('setup_done_s')} s in all: model "
                        f"{st['build_s']} s{graphs}; first step {st['first_step_s']} s; the kernel cache had "
                        f"{st.get('kernel_cache_files_before')} files)")
        return {f"startup/{k}": v for k, v in st.items()}

    def record(self) -> dict:
        """What is written with the run (wandb config, config.json): every setting, the model and layout."""
        from .. import perf

        return {**self.job.to_dict(), "model_config": self.cfg.to_dict(), "layout": self.layout.describe(),
                "world_size": self.world, "kernels": vars(perf.current())}

    # -- weights export ------------------------------------------------------------------------------------
    def export_weights(self, path: str) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from ..parallel.adapter import assemble, local_pieces
        from ..model import hf_shapes
        from ..plan.model_info import model_info

        total = model_info(self.cfg)["total_params"]
        if total > EXPORT_WEIGHTS_MAX_PARAMS:
            raise UsageError(f"--export-weights gathers the whole model on rank 0; {self.cfg.name} has {total:,} "
                             "parameters: use --save and tools/convert_to_hf.py instead")
        if not os.path.isabs(path):  # relative to the run directory
            path = os.path.join(self.job.logging.run_dir, path)
        shapes = hf_shapes(self.cfg)  # the whole model's names: small models only (checked above)
        pieces = [p for c in self.chunks for p in local_pieces(c, ps.get_tensor_model_parallel_rank(), shapes)]
        allp = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(pieces, allp, dst=0)
        if self.rank == 0:
            full, covered = assemble([p for g in allp for p in g], shapes)
            missing = [k for k in shapes if k not in full or not bool(covered[k].all())]
            if missing:
                raise RuntimeError(f"export: {len(missing)} tensors not covered, e.g. {missing[0]}")
            torch.save(full, path)
            print(f"[pretrain] exported {len(full)} tensors to {path}", flush=True)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        return {"consumed_tokens": self.tokens_seen, "loader": self.loader.state_dict(),
                "tokenizer": self.tokenizer_identity, "optimizer": self.job.optim.optimizer,
                "data_path": os.path.abspath(self.job.data.data_path),
                "balancing": self.job.optim.moe_router_load_balancing_type}

    def save(self, step: int) -> str:
        """Save step ``step``: staged and written in the background with ``--async-save`` (the default; the
        next save and the exit wait for it), else written before returning. A failed save (disk full, ...) is
        one ``RunError`` line that names the step and the checkpoint ``latest`` still names (the save writes
        into ``iter_*.tmp`` and switches last)."""
        from megatron.core import parallel_state as ps

        from checkpoints_io.k3ckpt import AsyncSaver, save_checkpoint

        c = self.job.checkpoint
        if c.async_save and self.saver is None:
            self.saver = AsyncSaver(processes=self._write_processes())
        self.wait_for_save()  # one write at a time (raises the previous write's error)
        t = time.perf_counter()
        with self._save_errors(step):
            path = save_checkpoint(c.save, step, self.chunks, self.opt, self.cfg, self._trainer_state(),
                                   tp_rank=ps.get_tensor_model_parallel_rank(), writer=c.ckpt_writer,
                                   keep_last=c.ckpt_keep_last, hf_shapes=self.shapes,
                                   saver=self.saver if c.async_save else None, thread_count=c.ckpt_write_threads,
                                   limit_bytes_per_s=c.ckpt_write_limit_mbps * 1e6)
        stall = time.perf_counter() - t
        self.save_stalls.append(stall)
        if c.async_save:
            self._print(f"[pretrain] step {step}: checkpoint staged in {stall:.2f} s, writing {path} in the background")
            self._pending_save = (step, path, time.perf_counter())
        else:
            self._print(f"[pretrain] saved step {step} to {path} in {stall:.2f} s")
        return path

    def new_saver(self):
        """An ``AsyncSaver`` with the configured writers, its staging buffer reserved in the background."""
        from checkpoints_io.k3ckpt import AsyncSaver

        saver = AsyncSaver(processes=self._write_processes())
        est = self.checkpoint_bytes_estimate()
        if est:
            saver.reserve(est, cuda=self.device.type == "cuda")
        return saver

    def _write_processes(self) -> int:
        """Writer processes of an asynchronous save (``--ckpt-write-workers``): 0 means threads."""
        c = self.job.checkpoint
        procs = c.ckpt_write_workers == "processes" or (c.ckpt_write_workers == "auto" and self.device.type == "cuda")
        return c.ckpt_write_threads if procs else 0

    def wait_for_save(self) -> None:
        """Block until the background checkpoint write (if any) is durable; a failed write is a ``RunError``."""
        if self.saver is None or self._pending_save is None:
            return
        step, path, t = self._pending_save
        self._pending_save = None
        with self._save_errors(step):
            self.saver.wait()
        early = "; files started from the local plan" if self.saver.last.get("early_write") else ""
        self._print(f"[pretrain] saved step {step} to {path} ({time.perf_counter() - t:.1f} s in the background{early})")

    def _save_errors(self, step: int):
        """A context that turns a failed save of ``step`` into one ``RunError`` line."""
        import contextlib

        from torch.distributed.checkpoint.api import CheckpointException as DCPException

        from checkpoints_io.k3ckpt import CheckpointError, latest_step

        from ..cli import RunError

        save_dir = self.job.checkpoint.save

        @contextlib.contextmanager
        def ctx():
            try:
                yield
            except CheckpointError:
                raise
            except (Exception, DCPException) as e:  # noqa: BLE001  (DCP wraps the writer's OSError in a BaseException)
                try:
                    prev = latest_step(save_dir)
                except CheckpointError:
                    prev = None
                kept = (f"latest still names step {prev} (intact)" if prev is not None
                        else "no earlier checkpoint exists")
                raise RunError(f"saving step {step} to {save_dir} failed: {root_cause(e)}; nothing was replaced: "
                               f"{kept}") from e

        return ctx()

    def _resume(self):
        """Load ``--load``'s latest checkpoint; returns (start step, consumed tokens)."""
        from megatron.core import parallel_state as ps

        from checkpoints_io.k3ckpt import CheckpointError, load_checkpoint

        c = self.job.checkpoint
        meta = load_checkpoint(c.load, self.chunks, self.opt, self.cfg, tp_rank=ps.get_tensor_model_parallel_rank(),
                               load_optim=not c.no_load_optim, load_rng=not c.no_load_rng, hf_shapes=self.shapes)
        if meta is None:
            self._print(f"[pretrain] no checkpoint in {c.load}: starting from scratch")
            return 0, 0
        if meta.get("weights_only"):
            self._print(f"[pretrain] loaded weights from {meta['path']} (weights only: fresh optimizer and data order)")
            return 0, 0
        tok = meta.get("tokenizer") or {}
        if tok.get("sha256") and tok["sha256"] != self.tokenizer_identity.get("sha256"):
            raise CheckpointError(f"{meta['path']}: saved with tokenizer {tok.get('file')} (sha256 {tok['sha256'][:12]}) "
                                  f"but this run uses {self.tokenizer_identity.get('file')} "
                                  f"(sha256 {self.tokenizer_identity.get('sha256', '')[:12]})")
        if meta.get("optimizer") != self.job.optim.optimizer and not c.no_load_optim:
            raise CheckpointError(f"{meta['path']}: saved with --optimizer {meta.get('optimizer')}, this run uses "
                                  f"--optimizer {self.job.optim.optimizer} (add --no-load-optim to load the weights only)")
        self.loader.load_state_dict(meta["loader"])
        self._print(f"[pretrain] resumed from {meta['path']} at step {meta['step']} "
                    f"({meta['consumed_tokens']:,} tokens consumed)")
        return int(meta["step"]), int(meta["consumed_tokens"])

    @staticmethod
    def _install_signal_handler():
        """SIGTERM/SIGUSR1 set a flag; the loop saves and exits at the next step boundary (all ranks agree)."""
        state = {"flag": False}

        def handler(signum, frame):
            state["flag"] = True
            print(f"[pretrain] received signal {signum}: saving at the end of this step", flush=True)

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)
        return state
