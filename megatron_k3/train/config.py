"""The typed configuration of a training run: one dataclass per section, read from a file and from flags.

Sections (``python -m megatron_k3 train --help`` lists every field as a flag, by section)::

    model       preset, MTP depth and loss weight; in a file also any K3Config field (overrides the preset)
    parallel    megatron's layout flags: --tensor-model-parallel-size, --pipeline-..., --expert-..., ...
    train       batch sizes, sequence length, steps, seed, exit conditions
    optim       optimizer, schedule, clipping, MoE bias balancing
    data        token store, tokenizer, loader backend
    checkpoint  --save / --load / interval / writer / retention
    perf        precision (bf16, FP8), recompute, CUDA graphs and the kernel choices (``megatron_k3/perf.py``)
    logging     run directory, log interval, wandb

A config file (YAML, TOML or JSON) holds any of these sections as mappings, keys spelled with ``_`` or
``-``; flags given on the command line win over the file, the file over the defaults. Everything is checked
when read: an unknown section, a key in the wrong section (the error names the right one), a value of the
wrong type or outside its choices is one ``ConfigError`` line naming the file and the key. The resolved
configuration (every field) is printed at start-up and written to the run's wandb config and
``config.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .. import perf as perf_mod
from ..cli import ArgumentParser
from ..config import ConfigError


def F(default, help: str, flag: str | None = None, choices=None):  # noqa: A002
    """A config field with its command-line help (and flag name when it differs from ``--field-name``)."""
    md = {"help": help}
    if flag:
        md["flag"] = flag
    if choices:
        md["choices"] = tuple(choices)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=md)
    return field(default=default, metadata=md)


@dataclass
class ModelSection:
    preset: str | None = F(None, "model preset: k3-tiny (default), k3-mini, k3-full, kimi-linear-48b")
    mtp_num_layers: int | None = F(None, "MTP depth (default: the model config's)")
    mtp_loss_scaling_factor: float = F(0.1, "weight of the mean MTP loss")
    overrides: dict = F({}, "K3Config fields over the preset (config files only: the model section's other keys)")


@dataclass
class ParallelSection:
    tensor_model_parallel_size: int = F(1, "tensor parallel size (heads, FFN columns, vocabulary)")
    pipeline_model_parallel_size: int = F(1, "pipeline stages (whole Attention-Residual blocks each)")
    virtual_pipeline_model_parallel_size: int = F(1, "virtual stages per pipeline rank (interleaved 1F1B)")
    decoder_first_pipeline_num_layers: int | None = F(
        None, "layers of the first pipeline stage (uneven split; the middle stages share the rest evenly)")
    decoder_last_pipeline_num_layers: int | None = F(
        None, "layers of the last pipeline stage (e.g. k3-full at PP4: 21, giving 24,24,24,21 in whole AttnRes blocks)")
    expert_model_parallel_size: int = F(1, "expert parallel size (routed experts)")
    context_parallel_size: int = F(1, "context parallel size (head-wise all-to-all)")
    sequence_parallel: bool = F(False, "sequence parallelism with TP")
    use_distributed_optimizer: bool = F(False, "megatron's distributed optimizer (Adam state sharded over DP)")


@dataclass
class TrainSection:
    micro_batch_size: int = F(4, "sequences per micro-batch per data-parallel rank")
    global_batch_size: int = F(8, "sequences per optimizer step over all ranks (gradient accumulation)")
    seq_length: int | None = F(None, "tokens per sequence (default: the model config's seq_length)")
    train_iters: int = F(300, "optimizer steps")
    seed: int = F(1234, "seed of the initialisation, the data order and every RNG")
    exit_interval: int | None = F(None, "stop (after saving, with --save) once the step is a multiple of N")
    exit_signal_handler: bool = F(False, "on SIGTERM/SIGUSR1: finish the step, save a checkpoint, exit with code 3")
    export_weights: str | None = F(
        None, "at the end, gather the weights into one HF-named state dict file (.pt, relative paths are in the run "
              "dir) on rank 0; small models only (refused above 2B parameters: use --save and tools/convert_to_hf.py)")


@dataclass
class OptimSection:
    optimizer: str = F("adam", "adam: megatron's AdamW (optionally distributed); muon: per-head Muon + AdamW",
                       choices=("adam", "muon"))
    optimizer_offload: str = F("none", "host-stream: AdamW state in pinned host memory, gradients streamed in chunks, "
                                       "update on the CPU (megatron_k3/optim/offload.py)", choices=("none", "host-stream"))
    offload_moments_dtype: str = F("bf16", "host-stream moments", choices=("bf16", "fp32"))
    offload_chunk_mb: int = F(32, "host-stream: MiB of fp32 gradient per streamed chunk (the pinned host buffers "
                                  "are offload-buffers x 2 x this, fixed, not per parameter)")
    offload_buffers: int = F(2, "host-stream: chunk buffers in flight (>= 2: one copied while the CPU updates another)")
    offload_update: str = F("auto", "host-stream update kernel: onepass = megatron_k3/optim/host_adamw.c (one pass "
                                    "over the state, built with the system C compiler, checked bit for bit against "
                                    "torch's fused CPU AdamW before use; an error if it cannot be); fused / torch: "
                                    "torch's CPU kernels; auto = onepass where it builds and passes, else fused",
                            choices=("auto", "onepass", "fused", "torch"))
    lr: float = F(3e-3, "peak learning rate")
    min_lr: float = F(3e-4, "final learning rate of the decay")
    lr_warmup_fraction: float = F(0.05, "warmup steps = fraction x train iters, rounded, at least 1 when > 0")
    lr_decay_style: str = F("cosine", "decay after warmup", choices=("cosine", "WSD", "linear", "constant"))
    lr_wsd_decay_fraction: float = F(0.2, "WSD: fraction of the steps spent decaying")
    weight_decay: float = F(0.1, "AdamW / Muon weight decay")
    adam_beta1: float = F(0.9, "Adam beta1")
    adam_beta2: float = F(0.95, "Adam beta2")
    adam_eps: float = F(1e-8, "Adam epsilon")
    clip_grad: float = F(1.0, "gradient clipping by global norm")
    moe_router_load_balancing_type: str = F(
        "sign", "aux-loss-free balancing of e_score_correction_bias: zero-centred sign update, K3's Quantile "
                "Balancing, or none (megatron_k3/parallel/balancing.py)", choices=("sign", "quantile", "none"))
    moe_router_bias_update_rate: float = F(1e-3, "step of the sign update")


@dataclass
class DataSection:
    data_path: str | None = F(None, "zarr token store (tools/prepare_data.py); default: the embedded corpus")
    tokenizer_model: str | None = F(None, "tokenizer.json or Kimi tiktoken.model (checked against the store)")
    data_backend: str = F("default", "dali: the same windows through an NVIDIA DALI pipeline",
                          choices=("default", "dali"))


@dataclass
class CheckpointSection:
    save: str | None = F(None, "checkpoint directory (iter_XXXXXXX/ + latest_checkpointed_iteration.txt)")
    load: str | None = F(None, "resume from this directory's latest checkpoint (or an iter_* dir); a directory "
                               "without a checkpoint starts from scratch, so one command serves start and restart")
    save_interval: int | None = F(None, "save every N steps (and at the end) when --save is given")
    ckpt_writer: str = F("odirect", "DCP storage writer: O_DIRECT (falls back to buffered with a warning where "
                                    "unsupported) or buffered", choices=("odirect", "buffered"))
    ckpt_keep_last: int = F(0, "keep only the newest N checkpoints (0: keep all)")
    async_save: bool = F(True, "stage the checkpoint in host memory and write it in the background while training "
                               "goes on (latest moves only once every rank's files are durable)")
    ckpt_write_threads: int = F(8, "writer threads (and files) per rank and checkpoint (H200 host: 8 threads "
                                   "reach 2.2 GB/s, 78% of the disk's O_DIRECT bandwidth; benchmarks/README.md)")
    ckpt_write_workers: str = F("auto", "where an asynchronous save's files are written: threads (of the "
                                        "trainer's process), processes (--ckpt-write-threads writer processes "
                                        "sharing the staging buffer: no GIL shared with the training loop; "
                                        "checkpoints_io/write_procs.py; H200: 1.54 GB/s against the threads' 1.03, "
                                        "benchmarks/README.md), auto: processes on CUDA, threads on CPU",
                                choices=("threads", "processes", "auto"))
    ckpt_write_limit_mbps: float = F(0.0, "cap each writer thread's write rate, MB/s (0: no cap), to leave a shared "
                                          "file system's bandwidth to the data loader")
    no_load_optim: bool = F(False, "with --load: weights only; fresh optimizer")
    no_load_rng: bool = F(False, "with --load: do not restore the RNG states")


@dataclass
class PerfSection:
    bf16: bool = F(False, "bf16 weights and activations (fp32 master weights in the optimizer)")
    fp8_recipe: str | None = F(None, "FP8 GEMMs in the decoder layers' projections (megatron_k3/parallel/precision.py): "
                                     "delayed/tensorwise/blockwise/mxfp8 through Transformer Engine (mxfp8 on "
                                     "Blackwell only), torchao-tensorwise/torchao-rowwise/torchao-rowwise-gw-hp "
                                     "through torchao.float8 (stateless: works with --cuda-graph-impl local); needs "
                                     "--bf16",
                               choices=("delayed", "tensorwise", "blockwise", "mxfp8", "torchao-tensorwise",
                                        "torchao-rowwise", "torchao-rowwise-gw-hp"))
    fp8_format: str | None = F(None, "FP8 format of the Transformer Engine recipes (default e4m3 when FP8 is on)",
                               choices=("e4m3", "hybrid"))
    recompute_granularity: str = F("none", "selective: recompute the token mixers' cores and FFN activations; "
                                           "full: whole layers", choices=("none", "selective", "full"))
    cuda_graph_impl: str = F("none", "local: each decoder layer's forward and backward as CUDA graphs, captured "
                                     "before the first step (megatron_k3/parallel/graphs.py; one GPU stage, "
                                     "EP = TP = CP = 1, no full recompute, FP8 only through torchao)",
                                choices=("none", "local"))
    compile: str = F("auto", "torch.compile of the element-wise glue: auto (CUDA training calls), off, all (every "
                             "device)", choices=perf_mod.CHOICES["compile"])
    compile_backend: str = F("inductor", "torch.compile backend")
    attn_res: str = F("triton", "Attention-Residual mixer on CUDA", flag="--attn-res-impl",
                      choices=perf_mod.CHOICES["attn_res"])
    short_conv: str = F("fla", "KDA short convolutions on CUDA: fla's causal_conv1d, the compiled reference, or this "
                               "project's Triton kernels", flag="--short-conv-impl",
                        choices=perf_mod.CHOICES["short_conv"])
    sdpa_backend: str = F("auto", "MLA attention kernel order on CUDA (cudnn: cuDNN first)",
                          choices=perf_mod.CHOICES["sdpa_backend"])
    cross_entropy: str = F("triton", "LM-head cross-entropy chunks on CUDA: this project's Triton kernel (each logits "
                                     "row read twice) or ce_sum_and_grad compiled", flag="--cross-entropy-impl",
                           choices=perf_mod.CHOICES["cross_entropy"])
    graph_shared_inputs: bool = F(True, "layer graphs read AttnRes snapshots from the snapshot layer's static input")
    graph_main_grad: bool = F(True, "layer graphs add parameter gradients to main_grad inside the backward graph")
    lean_grad_clip: bool = F(True, "grad norm and clip without host reads (patches/lean_grad_clip.py)")
    lean_adamw: bool = F(True, "fused AdamW stepped from cached lists (patches/foreach_kernels.py)")
    kernel_cache_dir: str | None = F(
        None, "persistent compiler cache: Triton kernels with their autotune results and Inductor's graphs, kept "
              "across runs (default: TRITON_CACHE_DIR if the environment sets it, else RUN_DIR/kernel_cache; point "
              "it at shared storage so a job on fresh nodes skips the minutes of first-step autotuning)")

    def kernels(self) -> perf_mod.Kernels:
        return perf_mod.Kernels(**{k: getattr(self, k) for k in perf_mod.fields()})


@dataclass
class LoggingSection:
    run_dir: str = F("runs/pretrain", "run directory: metrics.jsonl, config.json, wandb, plots")
    log_interval: int = F(10, "console line every N steps (metrics.jsonl gets every step)")
    wandb_project: str | None = F(None, "log online to this wandb project (default: offline run in the run dir)")
    wandb_mode: str = F("offline", "wandb mode", choices=("offline", "online", "disabled"))


SECTIONS = {"model": ModelSection, "parallel": ParallelSection, "train": TrainSection, "optim": OptimSection,
            "data": DataSection, "checkpoint": CheckpointSection, "perf": PerfSection, "logging": LoggingSection}


@dataclass
class JobConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    perf: PerfSection = field(default_factory=PerfSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    config_file: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def model_config(self):
        """The K3Config: preset, then the file's model overrides, then --mtp-num-layers / --seq-length."""
        from ..config import K3Config, get_preset

        over = dict(self.model.overrides)
        try:
            cfg = (get_preset(self.model.preset or "k3-tiny", **over) if over
                   else get_preset(self.model.preset or "k3-tiny"))
        except ConfigError as e:
            raise ConfigError(f"{self.config_file}: model section: {e}" if self.config_file else str(e)) from None
        extra = {}
        if self.model.mtp_num_layers is not None:
            extra["num_nextn_predict_layers"] = self.model.mtp_num_layers
        if self.train.seq_length is not None:
            extra["seq_length"] = self.train.seq_length
        if extra:
            cfg = cfg.replace(**extra).validate()
        assert isinstance(cfg, K3Config)
        return cfg


# ------------------------------------------------------------------------------------------------------
# fields, flags and types
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _base_type(hint):
    """(python type, optional?) of a field annotation such as ``int | None``."""
    args = typing.get_args(hint)
    if args:
        non_none = [a for a in args if a is not type(None)]
        return non_none[0], len(non_none) != len(args)
    return hint, False


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def section_fields():
    """[(section name, field, python type, optional)] for every flag-backed field."""
    out = []
    for sname, cls in SECTIONS.items():
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "overrides":
                continue
            t, opt = _base_type(hints[f.name])
            out.append((sname, f, t, opt))
    return out


def _owner_of(key: str) -> str | None:
    for sname, f, _, _ in section_fields():
        if f.name == key or flag_of(f).lstrip("-").replace("-", "_") == key:
            return sname
    return None


def _field_by_key(section: str, key: str):
    for sname, f, t, opt in section_fields():
        if sname == section and (f.name == key or flag_of(f).lstrip("-").replace("-", "_") == key):
            return f, t, opt
    return None


def coerce(value, t, optional: bool, where: str, choices=None):
    """``value`` as type ``t`` (ints accepted for floats), or a ConfigError naming ``where``."""
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: a value is required (got null)")
    ok = (isinstance(value, bool) if t is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if t is float else
          isinstance(value, int) and not isinstance(value, bool) if t is int else
          isinstance(value, t))
    if not ok:
        kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(t, t.__name__)
        raise ConfigError(f"{where}: expected {kind}, got {value!r}")
    value = float(value) if t is float else value
    if choices and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
    return value


# ------------------------------------------------------------------------------------------------------
# files
def read_file(path: str | Path) -> dict:
    """A config file's top-level mapping (YAML/TOML/JSON), or a one-line ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}" if not p.exists() else f"config file {p} is not a file")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None
    try:
        if p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"{p}: unsupported config format '{p.suffix}' (use .yaml, .toml or .json)")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  (parse errors of three libraries -> one line)
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{p}: cannot parse: {first}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    return data


def apply_file(job: JobConfig, path: str | Path, skip: set[str] = frozenset()) -> JobConfig:
    """Set ``job``'s fields from a config file; keys whose field name is in ``skip`` (given as flags) are left."""
    data = read_file(path)
    for sname, body in data.items():
        key = str(sname).replace("-", "_")
        if key not in SECTIONS:
            owner = _owner_of(key)
            hint = (f" ('{sname}' is a setting of section '{owner}': put it under '{owner}:')" if owner
                    else "")
            raise ConfigError(f"{path}: unknown section '{sname}'{hint}; sections are {', '.join(SECTIONS)}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: section '{sname}' must be a mapping of settings, got {type(body).__name__}")
        section = getattr(job, key)
        for k, v in body.items():
            name = str(k).replace("-", "_")
            if key == "model" and name not in ("preset", "mtp_num_layers", "mtp_loss_scaling_factor"):
                section.overrides[name] = v  # K3Config fields: checked by get_preset when the model is built
                continue
            found = _field_by_key(key, name)
            if found is None:
                owner = _owner_of(name)
                raise ConfigError(f"{path}: '{k}' is not a setting of section '{sname}'"
                                  + (f" (it belongs to '{owner}')" if owner else
                                     f"; its settings are {', '.join(f.name for f in dataclasses.fields(section) if f.name != 'overrides')}"))
            f, t, opt = found
            if f.name in skip:
                continue
            setattr(section, f.name, coerce(v, t, opt, f"{path}: {sname}.{k}", f.metadata.get("choices")))
    job.config_file = str(path)
    return job


# ------------------------------------------------------------------------------------------------------
# flags
def add_arguments(ap: argparse.ArgumentParser, sections=None) -> None:
    """One argparse group per section, one flag per field (defaults suppressed: only given flags are set)."""
    ap.add_argument("--config", default=argparse.SUPPRESS,
                    help="YAML/TOML/JSON config file with any of the sections below (flags win over it)")
    for sname, cls in SECTIONS.items():
        if sections and sname not in sections:
            continue
        grp = ap.add_argument_group(sname)
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "overrides":
                continue
            t, _ = _base_type(hints[f.name])
            flag, hlp = flag_of(f), f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
            default = f.default if f.default is not dataclasses.MISSING else None
            kw = dict(dest=f"{sname}.{f.name}", default=argparse.SUPPRESS)
            if t is bool:
                if default:
                    grp.add_argument(flag, action=argparse.BooleanOptionalAction, help=f"{hlp} (default: on)", **kw)
                else:
                    grp.add_argument(flag, action="store_true", help=hlp, **kw)
                continue
            choices = f.metadata.get("choices")
            grp.add_argument(flag, type=t, choices=choices, help=f"{hlp} (default: {default})",
                             metavar=None if choices else f.name.upper(), **kw)


def from_namespace(ns: argparse.Namespace) -> JobConfig:
    """A JobConfig from parsed flags: defaults, then the --config file (for fields not given as flags), then flags."""
    given = {k: v for k, v in vars(ns).items() if "." in k}
    job = JobConfig()
    if getattr(ns, "config", None):
        apply_file(job, ns.config, skip={k.split(".", 1)[1] for k in given})
    for k, v in given.items():
        sname, fname = k.split(".", 1)
        setattr(getattr(job, sname), fname, v)
    return job


def parse(argv=None, prog: str = "train", description: str | None = None) -> JobConfig:
    ap = build_parser(prog, description)
    return from_namespace(ap.parse_args(argv))


def build_parser(prog: str = "train", description: str | None = None) -> argparse.ArgumentParser:
    ap = ArgumentParser(prog=prog, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return ap


def describe(job: JobConfig) -> str:
    """The resolved configuration, one section per line (printed at start-up)."""
    lines = []
    for sname in SECTIONS:
        d = dataclasses.asdict(getattr(job, sname))
        if sname == "model" and not d["overrides"]:
            d.pop("overrides")
        lines.append(f"  {sname}: " + ", ".join(f"{k}={v}" for k, v in d.items()))
    return "\n".join(lines)
