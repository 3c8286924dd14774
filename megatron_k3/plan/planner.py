r"""Per-GPU memory of a K3 training layout: static state from the real parameter counts, activations from
what the code saves for backward, derived operation by operation (no fitted factors).

Units: bytes. ``a`` = bytes of an activation element (2 with ``--bf16``, else 4); fp32 math saves 4.

**Parameters** come from the golden model instantiated on the meta device (one decoder layer of each kind:
KDA/MLA x dense/MoE, plus embedding, head and final norms), each tensor classified by its official name as
tensor-parallel (divided by TP: head/column/row-split matrices, convolutions, vocabulary), replicated
(norms, AttnRes, KDA ``f_a_proj``/``o_norm``, MLA low-rank down projections, router, latent projections)
or routed expert (divided by EP). A pipeline stage holds its layers (whole AttnRes blocks), the first also
the embedding, the last the final mix/norm and ``lm_head``.

**Static bytes per parameter** (megatron DDP with ``grad_reduce_in_fp32``, megatron AdamW):

    weights  2 (bf16; the KDA A_log/dt_bias/convs/o_norm stay fp32: 4)      fp32 training: 4
    grads    4 (fp32 main_grad buffer)
    AdamW    12 = fp32 master 4 + exp_avg 4 + exp_avg_sq 4  (fp32 params: 8, no master copy)
             distributed optimizer: 12 / DP for dense params, 12 / (TP*CP*DP/EP) for expert params
             host-stream offload (megatron_k3/optim/offload.py): 0 on the GPU (+2 streaming buffers of 32 MiB);
             host: 4 master + 2 x 2 bf16 moments = 8 (/ DP with the distributed optimizer)

**Activations** saved for backward per micro-batch, with N = B*S/CP local tokens, h = heads/TP,
p = h*d (KDA), Tn = N/TP under sequence parallelism else N (the per-token replicated parts), Tm = N/TP
when TP > 1 else N (MoE tokens; megatron's MoE shards tokens over TP). The token mixers save one
batch-first copy of the layer input (``megatron.layers._batch_first``), shared by their projections; KDA's
six projections of it are one GEMM (``fused_linears``) over P = 3p + d + h + (p or d) outputs, whose
concatenated weight (a P D, per layer) is saved and whose output stays alive through its column slices:

    RMSNorm(w) of a bf16 input         Tn (8w + 4)        fp32 copy, normalised copy, rstd
    AttnRes mix over n candidates      Tn (4nD + 12n)     fp32 stack V, rstd, dot with the query, softmax
        (per layer: before attention n = blocks + 1 if any block exists; before the FFN n = blocks + 1,
        + 1 at a snapshot layer; the final output mix n = blocks + 1; blocks = ceil(layer / block size))
    KDA   inputs  N (a D + a P + a p) + a P D             x, the fused projection output, o_proj input; weight
          convs   N 3 * 4p ((S + K - 1)/S + 1)            fp32 padded input and conv output (SiLU)
          fla chunk_kda (0.6.0 saves, ``ChunkKDAFunction``):
                  N (3ap + ap + 8h + 4h + 2ahC)           l2-normed q, k, v; gate input; q/k rstd;
                                                          beta sigmoid (its logits: in P); Aqk, Akk
          output  N (16p + 4h)                            o_norm fp32 in/normed/out, sigmoid(gate), rstd
    MLA   inputs  N a D + N (8 rq + 4 + a rq + 8 rkv + 4 + a rkv) + N a h v (o_proj)
          core    N (2ah(dn + dr) + ah(dn + dv) + ahv + 4h ceil32(S)/S)   memory-efficient SDPA saves
                                                          q, k, the kv tensor v views, out, logsumexp
          gate    N 8hv                                   fp32 output, sigmoid(g_proj x)
    FFN(width f = F/TP) input a D N (shared by gate/up) + SiTU + a f N (down_proj input); SiTU saves
          2 a f (streaming op: its bf16 input) or 24 f (reference: six fp32 tensors)
    MoE   a D N (layer input, shared by router, latent down projection, shared experts)
          router Tm (4E + 8k + 4 + 4k); permutation indices Tm (8E + 8k)
          routed rows Tm k u (aL + SiTU(F) + aF + aF + 4)  fc1 input, activation, its output (saved by the
              probability product), fc2 input, probability; u = routing imbalance (1: balanced; EP keeps
              N k rows per rank on average)
          latent RMSNorm Tm (8L + 4), up projection input Tm a L; shared experts as an FFN of width
          n_shared F / TP on N tokens; the grouped experts (megatron_k3/parallel/experts.py) save the
          same (they re-stack the weights in backward instead of keeping a stacked copy)
    embedding N 9 (ids, mask); head: final mix + norm, then per CE call (LM head and each MTP depth)
          d hidden a D N and d weight a D V / TP (the fast CE forms them in forward,
          ``model/k3.py: linear_cross_entropy``); pipeline stages keep
          their received and sent states (blocks + 1) a D Tn per micro-batch in flight

Selective recompute keeps only the inputs of the recomputed cores (KDA: graw, ap, beside P, and the 8p output
stage; MLA: q, k, kv; SiTU: its bf16 input); full recompute keeps a D Tn per layer plus one layer's
activations while it is recomputed. Micro-batches in flight (1F1B): PP - stage on stage ``stage``;
interleaved: 2 (PP - 1 - stage) + (VPP - 1) PP + 1 model chunks (each 1/VPP of the stage's layers).

**Transient** at the peak (end of forward / start of backward): one cross-entropy chunk of
``c_ce = min(4096, N)`` tokens, bf16 logits plus their fp32 copy, c_ce (V/TP) (4 + a).
Peak = static + in-flight activations + transient, compared with the GPU's capacity less a margin
(CUDA context, NCCL buffers, allocator fragmentation; default 10%).

The derivation is checked against saved-tensor bytes measured with autograd hooks
(``measure_saved_activations``): on CPU with stand-ins that save exactly what fla's ``chunk_kda`` and the
memory-efficient SDPA kernel save (``tests/plan/test_plan.py``, tolerance 5% per component and 2% in total;
2026-12-02: KDA exact, MLA -0.03%, MoE -0.8% (the gather permutation's index tensors), AttnRes -0.3 to -0.7%,
total -0.3 to -0.5%). Before the 2026-12-02 glue cuts (batch-first copy, fused KDA projections, gather
permutation) it was also checked on an H200 with the real kernels (k3-mini, 1 x 4096: -0.006%) and against
measured peaks (k3-mini, 1 x H200, 4 x 4096: the committed benchmark 104.8 GiB vs 103.8 planned; with the
streaming SiTU op 85.1 vs 84.3); not re-checked on the GPU since.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

from ..config import ConfigError, K3Config
from ..parallel.layout import LayoutError, ParallelLayout

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class GPUSpec:
    name: str
    capacity: int  # bytes the driver reports as total
    note: str


GPUS = {
    "h100": GPUSpec("NVIDIA H100 80GB HBM3 (SXM)", 81559 * MiB, "nvidia-smi total 81,559 MiB (80 GB class)"),
    "h200": GPUSpec("NVIDIA H200", 143771 * MiB, "nvidia-smi total 143,771 MiB (141 GB HBM3e)"),
    "b300": GPUSpec("NVIDIA B300 (Blackwell Ultra)", 288 * 10 ** 9,
                    "288 GB HBM3e (8 stacks, 12-high) datasheet figure, decimal GB; not yet measured here"),
}

STREAM_BUFFERS = 2 * 32 * MiB  # host-stream offload: pinned chunk buffers' device side (offload.DEFAULT_CHUNK_BYTES)


def _layers_source() -> str:
    import os

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel", "layers.py")) as f:
        return f.read()


def default_situ() -> str:
    """The SiTU-GLU implementation the megatron layers use: "stream" (the streaming op) or "reference"."""
    return "stream" if "situ_glu_stream" in _layers_source() else "reference"


def default_experts() -> str:
    """How the megatron layers run the routed experts: "grouped" (two grouped GEMMs,
    megatron_k3/parallel/experts.py) or "sequential" (megatron's SequentialMLP loop)."""
    return "grouped" if "GroupedExperts(" in _layers_source() else "sequential"


# ------------------------------------------------------------------------------------------------
# parameters
# ------------------------------------------------------------------------------------------------
KDA_REPLICATED = ("f_a_proj", "o_norm", "g_a_proj")
MLA_REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
MOE_REPLICATED = ("gate.", "routed_expert_down_proj", "routed_expert_up_proj", "routed_expert_norm")


def _param_class(name: str) -> str:
    """'tp' (split over TP), 'rep' (replicated) or 'expert' (split over EP) for a golden parameter name
    relative to a decoder layer (``self_attn.q_proj.weight``) or the model (``embed_tokens.weight``)."""
    if name.startswith(("embed_tokens", "lm_head")):
        return "tp"
    if name.startswith("self_attn."):
        sub = name.split(".")[1]
        return "rep" if sub in KDA_REPLICATED or sub in MLA_REPLICATED else "tp"
    if name.startswith("mlp."):
        return "tp"
    if name.startswith("block_sparse_moe."):
        rest = name[len("block_sparse_moe."):]
        if rest.startswith("experts."):
            return "expert"
        if rest.startswith("shared_experts."):
            return "tp"
        if rest.startswith(MOE_REPLICATED):
            return "rep"
    return "rep"  # norms, AttnRes


@dataclass
class ParamCount:
    tp: int = 0
    rep: int = 0
    expert: int = 0
    fp32: int = 0       # of which kept in fp32 (KDA A_log/dt_bias/convs/o_norm); all tp or rep
    fp32_tp: int = 0

    def add(self, other: "ParamCount", times: int = 1) -> "ParamCount":
        for f in ("tp", "rep", "expert", "fp32", "fp32_tp"):
            setattr(self, f, getattr(self, f) + times * getattr(other, f))
        return self

    @property
    def total(self) -> int:
        return self.tp + self.rep + self.expert


def _count(module, prefix: str = "", fp32_names=()) -> ParamCount:
    c = ParamCount()
    for name, p in module.named_parameters():
        full = prefix + name
        cls = _param_class(full)
        setattr(c, cls, getattr(c, cls) + p.numel())
        if any(full.endswith(f) for f in fp32_names):
            c.fp32 += p.numel()
            if cls == "tp":
                c.fp32_tp += p.numel()
    return c


@functools.lru_cache(maxsize=16)
def _param_counts_cached(cfg_json: str):
    import json

    import torch

    from ..model.k3 import K3DecoderLayer
    from ..model.kda import KimiDeltaAttention

    cfg = K3Config.from_dict(json.loads(cfg_json))
    fp32_names = tuple("self_attn." + n for n in KimiDeltaAttention.fp32_params)
    per_kind = {}
    D, V = cfg.hidden_size, cfg.vocab_size
    with torch.device("meta"):
        for i in range(cfg.num_hidden_layers):
            key = (cfg.layer_kinds[i], cfg.is_moe_layer(i))
            if key not in per_kind:
                per_kind[key] = _count(K3DecoderLayer(cfg, i), "", fp32_names)
    norm = D * (1 + (2 if cfg.attn_res_block_size is not None else 0))  # norm, output_attn_res_{norm,proj}
    return per_kind, ParamCount(tp=V * D), ParamCount(tp=V * D, rep=norm)


def layer_params(cfg: K3Config, i: int) -> ParamCount:
    per_kind, _, _ = _param_counts_cached(_cfg_key(cfg))
    return per_kind[(cfg.layer_kinds[i], cfg.is_moe_layer(i))]


def _cfg_key(cfg: K3Config) -> str:
    import json

    d = cfg.to_dict()
    d.pop("name", None)
    return json.dumps(d, sort_keys=True)


def model_params(cfg: K3Config) -> ParamCount:
    """The whole model (without MTP) as tp/rep/expert counts; equals model_info's total."""
    _, emb, head = _param_counts_cached(_cfg_key(cfg))
    c = ParamCount().add(emb).add(head)
    for i in range(cfg.num_hidden_layers):
        c.add(layer_params(cfg, i))
    return c


# ------------------------------------------------------------------------------------------------
# activations
# ------------------------------------------------------------------------------------------------
@dataclass
class Geometry:
    """What one rank sees of one micro-batch."""
    B: int                 # micro-batch size
    S: int                 # full sequence length
    tp: int = 1
    cp: int = 1
    sp: bool = False
    a: int = 2             # activation element bytes
    situ: str = "stream"   # "stream" | "reference"
    recompute: str = "none"
    imbalance: float = 1.0
    experts: str = "grouped"  # "grouped" | "sequential"
    ep: int = 1

    @property
    def N(self) -> float:  # local tokens
        return self.B * self.S / self.cp

    @property
    def Tn(self) -> float:  # per-token replicated parts (norms, AttnRes, residual stream)
        return self.N / self.tp if (self.sp and self.tp > 1) else self.N

    @property
    def Tm(self) -> float:  # MoE tokens (sharded over TP with or without SP)
        return self.N / self.tp


def blocks_before(cfg: K3Config, i: int) -> int:
    bs = cfg.attn_res_block_size
    return 0 if bs is None else -(-i // bs)


def rms(T: float, w: int) -> float:
    return T * (8 * w + 4)


def mix_bytes(T: float, n: int, D: int) -> float:
    """The eager AttnRes mixer over n candidates saves, per row, the fp32 stack V and three fp32 [n]
    vectors: the RMS scale, the dot product with the pseudo-query and the softmax."""
    return T * (4 * n * D + 12 * n)


def situ_bytes(g: Geometry, width: float) -> float:
    """Per row: what the SiTU-GLU activation saves (its input for the streaming op / under selective
    recompute, six fp32 tensors for the reference)."""
    if g.situ == "reference" and g.recompute != "selective":
        return 24 * width
    return 2 * g.a * width


def kda_bytes(cfg: K3Config, g: Geometry) -> dict:
    a, N, D, d = g.a, g.N, cfg.hidden_size, cfg.kda_head_dim
    h = cfg.kda_num_heads / g.tp
    p = h * d
    C, K, S = cfg.kda_chunk_size, cfg.short_conv_kernel_size, g.S
    # the six projections of x run as one GEMM (megatron.layers.fused_linears): x (one batch-first copy) and
    # the concatenated weight are saved, and the column slices f_a / g_a / gate / beta logits (and q, k, v)
    # keep the whole projection output alive
    width = 3 * p + d + h + (p if cfg.use_full_rank_gate else d)
    inputs = N * (a * D + a * width + a * p) + a * width * D   # x, projection output, o_proj input; weight
    if g.recompute == "selective":
        core = N * a * p                            # mix input graw (q, k, v, beta logits: in the output)
        # the output norm runs with the gate, outside the recomputed core (common.rms_norm_gate_seq_first):
        # fp32 o, its rsqrt, normed o, o * weight and the sigmoid, as without recompute
        out = N * (16 * p + 4 * h)
        return {"kda_inputs": inputs, "kda_core": core, "kda_output": out}
    conv = N * 3 * 4 * p * ((S + K - 1) / S + 1)
    fla = N * (3 * a * p + a * p + 8 * h + 4 * h + 2 * a * h * C)  # beta logits: in the projection output
    out = N * (16 * p + 4 * h)
    return {"kda_inputs": inputs, "kda_conv": conv, "kda_core": fla, "kda_output": out}


def mla_bytes(cfg: K3Config, g: Geometry) -> dict:
    a, N, D = g.a, g.N, cfg.hidden_size
    h = cfg.num_attention_heads / g.tp
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    inputs = N * (a * D + a * h * dv)  # x (one batch-first copy, shared by the projections), o_proj input
    if cfg.q_lora_rank is not None:
        inputs += N * (8 * cfg.q_lora_rank + 4 + a * cfg.q_lora_rank)
    inputs += N * (8 * cfg.kv_lora_rank + 4 + a * cfg.kv_lora_rank)
    # q, k, v as saved by the attention: contiguous heads-first copies (mla.heads_first_qkv), v without k_nope
    core = N * (2 * a * h * (dn + dr) + a * h * dv)
    if g.recompute != "selective":
        core += N * (a * h * dv + 4 * h * (math.ceil(g.S / 32) * 32) / g.S)
    gate = N * 8 * h * dv if cfg.mla_use_output_gate else 0.0
    return {"mla_inputs": inputs, "mla_core": core, "mla_output": gate}


def ffn_bytes(g: Geometry, D: int, width: int, tokens: float, with_input: bool = True) -> float:
    f = width / g.tp
    return (g.a * D * tokens if with_input else 0.0) + tokens * (situ_bytes(g, f) + g.a * f)


def moe_bytes(cfg: K3Config, g: Geometry) -> dict:
    a, N, Tm, D = g.a, g.N, g.Tm, cfg.hidden_size
    E, k, F = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size
    L = cfg.expert_width
    out = {"moe_input": a * D * N,
           "moe_router": Tm * (4 * E + 8 * k + 4 + 4 * k + 8 * E + 8 * k),
           "moe_experts": Tm * k * g.imbalance * (a * L + situ_bytes(g, F) + a * F + a * F + 4)}
    if cfg.routed_expert_hidden_size is not None:
        out["moe_latent"] = (rms(Tm, L) if cfg.latent_moe_use_norm else 0.0) + Tm * a * L
    if cfg.num_shared_experts > 0:
        out["moe_shared"] = ffn_bytes(g, D, cfg.num_shared_experts * F, N, with_input=False)
    return out


def layer_bytes(cfg: K3Config, i: int, g: Geometry) -> dict:
    """Saved-for-backward bytes of decoder layer ``i`` for one micro-batch, by component (no recompute or
    selective; full recompute is handled by the caller)."""
    D = cfg.hidden_size
    out = {"norms": 2 * rms(g.Tn, D)}
    if cfg.attn_res_block_size is not None:
        nb = blocks_before(cfg, i)
        snap = i % cfg.attn_res_block_size == 0
        res = mix_bytes(g.Tn, nb + 1, D) if nb > 0 else 0.0
        res += mix_bytes(g.Tn, nb + 1 + (1 if snap else 0), D)
        out["attn_res"] = res
    out.update(kda_bytes(cfg, g) if cfg.is_kda_layer(i) else mla_bytes(cfg, g))
    if cfg.is_moe_layer(i):
        out.update(moe_bytes(cfg, g))
    else:
        out["dense_ffn"] = ffn_bytes(g, D, cfg.intermediate_size, g.N)
    return out


def _layer_bytes_cached(cfg: K3Config, i: int, g: Geometry, cache: dict) -> dict:
    bs = cfg.attn_res_block_size
    key = (cfg.is_kda_layer(i), cfg.is_moe_layer(i), blocks_before(cfg, i), bool(bs) and i % bs == 0)
    if key not in cache:
        cache[key] = layer_bytes(cfg, i, g)
    return cache[key]


def embedding_bytes(cfg: K3Config, g: Geometry) -> dict:
    return {"embedding": g.N * 9}


def head_bytes(cfg: K3Config, g: Geometry) -> dict:
    D = cfg.hidden_size
    out = {}
    if cfg.attn_res_block_size is not None:
        out["attn_res"] = mix_bytes(g.Tn, blocks_before(cfg, cfg.num_hidden_layers) + 1, D)
    # linear_cross_entropy keeps d hidden (full over TP) and d weight (this rank's V/TP rows, weight dtype)
    # from forward to backward, once per CE call (LM head and each MTP depth)
    ce_calls = 1 + cfg.num_nextn_predict_layers
    out["head"] = rms(g.Tn, D) + ce_calls * g.a * D * (g.N + cfg.vocab_size / g.tp)
    return out


def ce_transient(cfg: K3Config, g: Geometry, chunk_tokens: int = 4096) -> float:
    """One cross-entropy chunk: bf16 logits and their fp32 copy (the CE then works in place on it)."""
    c = min(chunk_tokens, g.N)
    return c * cfg.vocab_size / g.tp * (4 + g.a)


def _add(acc: dict, d: dict, times: float = 1.0):
    for k, v in d.items():
        acc[k] = acc.get(k, 0.0) + times * v
    return acc


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
@dataclass
class PlanSettings:
    micro_batch_size: int = 1
    seq_length: int | None = None
    global_batch_size: int | None = None
    bf16: bool = True
    distributed_optimizer: bool | None = None  # None: on when DP > 1
    optimizer_offload: str = "none"            # "none" | "host-stream"
    offload_moments_bytes: int = 2             # host-stream: bf16 moments (4 with fp32 moments)
    recompute: str = "none"
    situ: str | None = None                    # None: what the megatron layers use
    experts: str | None = None                 # None: what the megatron layers use
    moe_imbalance: float = 1.0
    memory_margin: float = 0.10
    ce_chunk_tokens: int = 4096


@dataclass
class StageReport:
    stage: int
    layers: list
    params: dict
    static: dict
    activations_per_microbatch: dict
    in_flight: float
    activations: float
    transient: float
    peak: float


def stage_layers(cfg: K3Config, layout: ParallelLayout, rank: int) -> list[list[int]]:
    """Layer indices of each model chunk of pipeline rank ``rank`` (VPP chunks: virtual stages r, r+PP, ...)."""
    b = layout.stage_boundaries(cfg.num_hidden_layers)
    return [list(range(b[v * layout.pp + rank], b[v * layout.pp + rank + 1])) for v in range(layout.vpp)]


def plan(cfg: K3Config, layout: ParallelLayout, s: PlanSettings, gpu: GPUSpec | None = None) -> dict:
    """Memory per GPU for every pipeline rank; the report of the fullest one decides whether it fits."""
    S = s.seq_length or cfg.seq_length
    gbs = s.global_batch_size or s.micro_batch_size * layout.dp * max(4 * layout.pp, 1)
    layout.validate(cfg, seq_length=S, micro_batch_size=s.micro_batch_size, global_batch_size=gbs)
    if s.optimizer_offload not in ("none", "host-stream"):
        raise ConfigError(f"--optimizer-offload must be none or host-stream (got {s.optimizer_offload!r})")
    if s.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"--recompute must be none, selective or full (got {s.recompute!r})")
    situ = s.situ or default_situ()
    experts = s.experts or default_experts()
    distopt = s.distributed_optimizer if s.distributed_optimizer is not None else layout.dp * layout.cp > 1
    g = Geometry(B=s.micro_batch_size, S=S, tp=layout.tp, cp=layout.cp, sp=layout.sequence_parallel and layout.tp > 1,
                 a=2 if s.bf16 else 4, situ=situ, recompute=s.recompute, imbalance=s.moe_imbalance,
                 experts=experts, ep=layout.ep)
    n_micro = gbs // (s.micro_batch_size * layout.dp)
    dp_dense = layout.dp * layout.cp
    dp_expert = layout.tp * layout.cp * layout.dp // layout.ep
    _, emb_p, head_p = _param_counts_cached(_cfg_key(cfg))
    D = cfg.hidden_size
    stages, cache = [], {}
    for r in range(layout.pp):
        chunks = stage_layers(cfg, layout, r)
        layers = [i for c in chunks for i in c]
        first, last = r == 0, r == layout.pp - 1
        pc = ParamCount()
        for i in layers:
            pc.add(layer_params(cfg, i))
        if first:
            pc.add(emb_p)
        if last:
            pc.add(head_p)
        dense_local = pc.tp / layout.tp + pc.rep
        expert_local = pc.expert / layout.ep
        fp32_local = pc.fp32_tp / layout.tp + (pc.fp32 - pc.fp32_tp)
        local = dense_local + expert_local
        bf16_local = local - fp32_local if s.bf16 else 0.0
        weights = 2 * bf16_local + 4 * (local - bf16_local)
        grads = 4 * local
        per_param_opt = 12 if s.bf16 else 8  # fp32 master only for bf16 params
        opt_dense = (dense_local - fp32_local) * per_param_opt + fp32_local * 8 if s.bf16 else dense_local * 8
        opt_expert = expert_local * per_param_opt
        host = 0.0
        if s.optimizer_offload == "host-stream":
            hb = 4 + 2 * s.offload_moments_bytes
            host = hb * (dense_local / (dp_dense if distopt else 1) + expert_local / (dp_expert if distopt else 1))
            opt = STREAM_BUFFERS
        elif distopt:
            opt = opt_dense / dp_dense + opt_expert / dp_expert
        else:
            opt = opt_dense + opt_expert
        static = {"weights": weights, "grads": grads, "optimizer": opt}

        # activations of one micro-batch on this rank
        act: dict = {}
        per_layer = {i: _layer_bytes_cached(cfg, i, g, cache) for i in layers}
        if s.recompute == "full":
            act["layer_inputs"] = len(layers) * g.a * D * g.Tn
            transient_layer = max((sum(v.values()) for v in per_layer.values()), default=0.0)
        else:
            for v in per_layer.values():
                _add(act, v)
            transient_layer = 0.0
        if first:
            _add(act, embedding_bytes(cfg, g))
        if last:
            _add(act, head_bytes(cfg, g))
        nb_state = lambda i: (blocks_before(cfg, i) + 1) if cfg.attn_res_block_size is not None else 1  # noqa: E731
        if not first:
            act["pipeline_recv"] = g.a * D * g.Tn * sum(nb_state(c[0]) for c in chunks)
        if not last:
            act["pipeline_send"] = g.a * D * g.Tn * sum(nb_state(c[-1] + 1) for c in chunks)
        per_mb = sum(act.values())
        if layout.vpp == 1:
            in_flight = min(layout.pp - r, n_micro)
        else:
            chunks_in_flight = min(2 * (layout.pp - 1 - r) + (layout.vpp - 1) * layout.pp + 1, n_micro * layout.vpp)
            in_flight = chunks_in_flight / layout.vpp
        activations = in_flight * per_mb
        transient = max(ce_transient(cfg, g, s.ce_chunk_tokens) if last else 0.0, transient_layer)
        peak = sum(static.values()) + activations + transient
        stages.append(StageReport(stage=r, layers=[layers[0], layers[-1]] if layers else [],
                                  params={"local": local, "dense": dense_local, "expert": expert_local,
                                          "host_optimizer_bytes": host},
                                  static=static, activations_per_microbatch=act, in_flight=in_flight,
                                  activations=activations, transient=transient, peak=peak))
    worst = max(stages, key=lambda st: st.peak)
    usable = gpu.capacity * (1 - s.memory_margin) if gpu else None
    return {
        "model": cfg.name,
        "layout": layout.describe(),
        "layers_per_stage": layout.stage_layer_counts(cfg.num_hidden_layers),
        "world_size": layout.world_size,
        "micro_batch_size": s.micro_batch_size, "seq_length": S, "global_batch_size": gbs, "num_micro": n_micro,
        "precision": "bf16" if s.bf16 else "fp32", "situ": situ, "experts": experts, "recompute": s.recompute,
        "distributed_optimizer": distopt, "optimizer_offload": s.optimizer_offload,
        "gpu": gpu.name if gpu else None,
        "capacity_bytes": gpu.capacity if gpu else None,
        "usable_bytes": usable,
        "peak_bytes": worst.peak, "peak_stage": worst.stage,
        "fits": (worst.peak <= usable) if usable else None,
        "stages": [asdict(st) for st in stages],
    }


# ------------------------------------------------------------------------------------------------
# layout search
# ------------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def block_split(cfg: K3Config, stages: int) -> list[int] | None:
    """Layers per stage holding whole AttnRes blocks, as even as possible (None: impossible)."""
    bs = cfg.attn_res_block_size or 1
    L = cfg.num_hidden_layers
    blocks = [min(bs, L - s) for s in range(0, L, bs)]
    if stages > len(blocks):
        return None
    out, b = [], 0
    for k in range(stages):
        n = len(blocks) * (k + 1) // stages - len(blocks) * k // stages
        out.append(sum(blocks[b:b + n]))
        b += n
    return out


def candidate_layouts(cfg: K3Config, world: int, gpus_per_node: int, seq: int, fixed: dict) -> list[ParallelLayout]:
    """Layouts for ``world`` GPUs: TP within a node, PP over whole AttnRes blocks, CP, EP dividing the experts;
    ``fixed`` pins any of tp/pp/cp/ep/vpp."""
    out = []
    tps = [fixed["tp"]] if fixed.get("tp") else [t for t in (1, 2, 4, 8) if t <= gpus_per_node]
    for tp in tps:
        for pp in ([fixed["pp"]] if fixed.get("pp") else _divisors(world)):
            # context parallelism only when asked for or for long sequences
            for cp in ([fixed["cp"]] if fixed.get("cp") else ((1, 2, 4, 8) if seq > 16384 else (1,))):
                if world % (tp * pp * cp):
                    continue
                dp = world // (tp * pp * cp)
                vpp = fixed.get("vpp") or 1
                lps = None
                if pp * vpp > 1:
                    even = cfg.num_hidden_layers % (pp * vpp) == 0 and (
                        cfg.attn_res_block_size is None or (cfg.num_hidden_layers // (pp * vpp)) % cfg.attn_res_block_size == 0)
                    if not even:
                        lps = block_split(cfg, pp * vpp)
                        if lps is None:
                            continue
                eps = [fixed["ep"]] if fixed.get("ep") else [e for e in _divisors(cfg.num_experts or 1)
                                                             if (tp * cp * dp) % e == 0]
                for ep in eps:
                    lay = ParallelLayout(tp=tp, pp=pp, ep=ep, cp=cp, dp=dp, vpp=vpp, sequence_parallel=tp > 1,
                                         layers_per_stage=lps)
                    try:
                        lay.validate(cfg, seq_length=seq)
                    except LayoutError:
                        continue
                    out.append(lay)
    return out


RECOMPUTE_ORDER = ("none", "selective", "full")


def search(cfg: K3Config, gpu: GPUSpec, world: int, gpus_per_node: int, s: PlanSettings, fixed: dict,
           recompute_options=None, offload_options=None) -> tuple[dict | None, dict | None]:
    """(first fitting plan, the closest non-fitting plan). Preference, in order: no optimizer offload before
    host-stream, no recompute before selective before full, then the least pipeline and tensor parallelism,
    no context parallelism, the largest expert parallelism (experts hold most of the weights): a memory
    feasibility search, not a speed model."""
    seq = s.seq_length or cfg.seq_length
    lays = candidate_layouts(cfg, world, gpus_per_node, seq, fixed)
    lays.sort(key=lambda l: (l.pp, l.tp, l.cp, -l.ep))
    best_fail = None
    for off in offload_options or ("none", "host-stream"):
        for rc in recompute_options or RECOMPUTE_ORDER:
            for lay in lays:
                st = PlanSettings(**{**asdict(s), "recompute": rc, "optimizer_offload": off})
                try:
                    p = plan(cfg, lay, st, gpu)
                except ConfigError:
                    continue
                if p["fits"]:
                    return p, None
                if best_fail is None or p["peak_bytes"] < best_fail["peak_bytes"]:
                    best_fail = p
    return None, best_fail


# ------------------------------------------------------------------------------------------------
# measurement (validation of the activation model)
# ------------------------------------------------------------------------------------------------
def measure_saved_activations(cfg: K3Config, micro_batch_size: int, seq_length: int, bf16: bool = True,
                              recompute: str = "none", gpu_kernels: bool | None = None, situ: str | None = None,
                              experts: str | None = None) -> dict:
    """Saved-for-backward bytes of one forward of the megatron model (world of one, this process),
    attributed to components, each storage counted once, parameters excluded; tensors held by activation
    checkpoints (their inputs) included. ``gpu_kernels`` (default: when running on the CPU): stand-ins that
    save exactly what the GPU kernels save (fla 0.6.0 ``chunk_kda`` with the gate/beta/l2norm in the kernel; the memory-efficient SDPA
    kernel: q, k, v, out, logsumexp) instead of the CPU paths (chunked KDA reference, math SDPA).
    ``situ="reference"`` swaps the streaming SiTU op for the reference one and ``experts="sequential"`` the
    grouped experts for megatron's SequentialMLP loop (what the layers used before them)."""
    import os

    import torch
    import torch.utils.checkpoint as tuc

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29763")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from ..parallel import layers as mlayers
    from ..parallel import model as mmodel
    from ..parallel.runtime import build_model_chunks, init_distributed
    from ..model import kda as kda_mod
    from ..model import mla as mla_mod
    from ..model.common import acc_dtype, rms_norm

    device = init_distributed(ParallelLayout(), seed=0)
    if gpu_kernels is None:
        gpu_kernels = device.type != "cuda"
    restore = []
    if situ == "reference" and hasattr(mlayers, "situ_glu_stream"):
        from ..model import situ as situ_mod

        restore += [(mlayers, "situ_glu_stream", mlayers.situ_glu_stream),
                    (mlayers, "glu_activation_stream", mlayers.glu_activation_stream)]
        mlayers.situ_glu_stream, mlayers.glu_activation_stream = situ_mod.situ_glu, situ_mod.glu_activation
    if experts == "sequential" and default_experts() == "grouped":
        from megatron.core.transformer.moe.experts import SequentialMLP

        from ..parallel.experts import GroupedExperts

        restore.append((GroupedExperts, "forward", GroupedExperts.forward))
        GroupedExperts.forward = SequentialMLP.forward
    if gpu_kernels:
        class FlaChunkKDA(torch.autograd.Function):
            """Saves what fla 0.6.0 ChunkKDAFunction.forward saves (disable_recompute=False,
            use_qk_l2norm/gate/beta_sigmoid in kernel): q, q_rstd, k, k_rstd, v, g, beta_raw, beta, A_log,
            dt_bias, Aqk, Akk (input_guard makes the inputs contiguous)."""

            @staticmethod
            def forward(ctx, q, k, v, g, beta, A_log, dt_bias, chunk):
                B, T, H, d = q.shape
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
                qf, kf = q.float(), k.float()
                q_rstd = torch.rsqrt(qf.pow(2).sum(-1) + 1e-6)
                k_rstd = torch.rsqrt(kf.pow(2).sum(-1) + 1e-6)
                qn, kn = (qf * q_rstd[..., None]).to(q.dtype), (kf * k_rstd[..., None]).to(k.dtype)
                bsig = torch.sigmoid(beta.float())
                Aqk = torch.empty(B, T, H, chunk, dtype=k.dtype, device=k.device)
                Akk = torch.zeros(B, T, H, chunk, dtype=k.dtype, device=k.device)
                ctx.save_for_backward(qn, q_rstd, kn, k_rstd, v, g, beta, bsig, A_log, dt_bias, Aqk, Akk)
                return torch.zeros_like(v)

            @staticmethod
            def backward(ctx, do):  # pragma: no cover (measurement only)
                raise RuntimeError("measurement stand-in: no backward")

        def mix(self, q, k, v, graw, blogit, heads=None, initial_state=None, conv_caches=None,
                output_final_state=False, impl="auto", normalize=True):
            # KimiDeltaAttention.mix's CUDA branch, with the fla stand-in
            B, T, h, d = q.shape
            hs = heads or slice(0, self.num_heads)
            ch = slice(hs.start * d, hs.stop * d)
            q = kda_mod.causal_conv1d(q.reshape(B, T, h * d), self.q_conv1d.weight[ch], True, None).view(B, T, h, d)
            k = kda_mod.causal_conv1d(k.reshape(B, T, h * d), self.k_conv1d.weight[ch], True, None).view(B, T, h, d)
            v = kda_mod.causal_conv1d(v.reshape(B, T, h * d), self.v_conv1d.weight[ch], True, None).view(B, T, h, d)
            o = FlaChunkKDA.apply(q, k, v, graw, blogit, self.A_log[hs], self.dt_bias[ch], self.cfg.kda_chunk_size)
            if not normalize:
                return o, None
            return rms_norm(o.to(acc_dtype(q)), self.o_norm.weight, self.o_norm.eps), None

        class EfficientSDPA(torch.autograd.Function):
            """Saves what PyTorch's memory-efficient attention saves: q, k, v, out [B, T, H, dv] and the
            logsumexp [B, H, ceil(T/32)*32] fp32 (flash attention needs equal q/v head dims; MLA's differ)."""

            @staticmethod
            def forward(ctx, q, k, v):
                B, T, H, dv = v.shape
                out = torch.zeros(B, T, H, dv, dtype=v.dtype, device=v.device)
                lse = torch.zeros(B, H, -(-T // 32) * 32, dtype=torch.float32, device=v.device)
                ctx.save_for_backward(q, k, v, out, lse)
                return out

            @staticmethod
            def backward(ctx, do):  # pragma: no cover
                raise RuntimeError("measurement stand-in: no backward")

        restore += [(kda_mod.KimiDeltaAttention, "mix", kda_mod.KimiDeltaAttention.mix),
                    (mla_mod, "causal_attention", mla_mod.causal_attention)]
        kda_mod.KimiDeltaAttention.mix = mix
        mla_mod.causal_attention = lambda q, k, v, scale: EfficientSDPA.apply(q, k, v)
    try:
        dtype = torch.bfloat16 if bf16 else torch.float32
        chunks, _ = build_model_chunks(cfg, ParallelLayout(), params_dtype=dtype, device=device, recompute=recompute)
        model = chunks[0]
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.02)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        stack, seen, by = [], set(), {}
        names = {m: n for n, m in model.named_modules()}

        def account(t, where=None):
            if isinstance(t, (list, tuple)):
                for x in t:
                    account(x, where)
                return
            if not isinstance(t, torch.Tensor):
                return
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in params or key in seen or st.nbytes() == 0:
                return
            seen.add(key)
            c = where or _component(stack[-1] if stack else "", cfg)
            by[c] = by.get(c, 0) + st.nbytes()

        def pack(t):
            account(t)
            return t

        def enter(mod, *a):
            stack.append(names[mod])

        def leave(mod, *a):
            stack.pop()

        hooks = []
        for mod in model.modules():
            hooks.append(mod.register_forward_pre_hook(enter))
            hooks.append(mod.register_forward_hook(leave))
        orig = tuc.checkpoint

        def ckpt(fn, *args, **kw):
            if torch.is_grad_enabled():  # a checkpoint keeps its inputs (whole layers: full recompute)
                account(list(args), "layer_inputs" if isinstance(fn, mlayers.ParallelK3Layer) else None)
            return orig(fn, *args, **kw)

        restore += [(mlayers, "checkpoint", mlayers.checkpoint), (mmodel, "checkpoint", mmodel.checkpoint)]
        mlayers.checkpoint = mmodel.checkpoint = ckpt
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (micro_batch_size, seq_length), generator=g).to(device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=torch.roll(ids, -1, 1))
        for hk in hooks:
            hk.remove()
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    finally:
        for obj, name, val in restore:
            setattr(obj, name, val)
    return by


def _component(module_name: str, cfg: K3Config) -> str:
    """Map a module name of the megatron model to a planner component."""
    import re

    m = re.match(r"layers\.(\d+)\.?(.*)", module_name)
    if not m:
        if module_name.startswith("embed_tokens"):
            return "embedding"
        return "head"
    rest = m.group(2)
    if rest == "":
        return "attn_res"
    if rest.startswith(("input_layernorm", "post_attention_layernorm")):
        return "norms"
    if rest.startswith("self_attn"):
        return "kda" if cfg.is_kda_layer(int(m.group(1))) else "mla"
    if rest.startswith("mlp"):
        return "dense_ffn"
    return "moe"


def planned_components(cfg: K3Config, micro_batch_size: int, seq_length: int, bf16: bool = True,
                       recompute: str = "none", situ: str | None = None, experts: str | None = None) -> dict:
    """The planner's activation bytes for one micro-batch on one GPU (no parallelism), grouped like
    ``measure_saved_activations``."""
    g = Geometry(B=micro_batch_size, S=seq_length, a=2 if bf16 else 4, situ=situ or default_situ(),
                 recompute=recompute, experts=experts or default_experts())
    out = {}
    for i in range(cfg.num_hidden_layers):
        if recompute == "full":
            out["layer_inputs"] = out.get("layer_inputs", 0.0) + g.a * cfg.hidden_size * g.Tn
            continue
        for k, v in layer_bytes(cfg, i, g).items():
            key = k.split("_")[0] if k.startswith(("kda", "mla", "moe")) else k
            out[key] = out.get(key, 0.0) + v
    _add(out, embedding_bytes(cfg, g))
    h = head_bytes(cfg, g)
    out["head"] = out.get("head", 0.0) + sum(h.values())
    return out
