"""Parallel layout: one dataclass and its up-front validation against a model config.

Every decision about how a K3 model is split lives here and in ``megatron_k3.parallel.tconfig`` (which
turns a layout into megatron-core settings); layers never look at launchers, checkpoints or data.

Rules checked before any rank starts (each failure is one ``LayoutError`` line):
- world size = TP x PP x CP x DP; EP divides TP x CP x DP (megatron's expert grid folds EP out of it);
- TP x CP divides the KDA heads and the MLA heads (context parallel is head-wise all-to-all, and a head
  never spans tensor-parallel ranks: per-head Muon needs whole heads on a rank);
- TP divides the widths it shards (dense FFN, shared experts, expert FFN, vocab);
- EP divides the routed experts;
- pipeline stages (and virtual stages) hold whole Attention-Residual blocks: every stage boundary is a
  multiple of ``attn_res_block_size`` layers;
- the sequence length is divisible by 2 x CP (and by TP under sequence parallelism);
- with sequence parallelism or MoE under TP, TP divides the per-CP-rank sequence (MoE layers shard tokens
  over TP themselves when the model is not sequence parallel: megatron-core's MoE requires it);
- global batch = micro batch x DP x (number of micro-batches), and PP > 1 needs >= PP micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, K3Config


class LayoutError(ConfigError):
    """A parallel layout that cannot work for this model."""


@dataclass
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int = 1
    vpp: int = 1  # virtual pipeline stages per rank (interleaved 1F1B)
    sequence_parallel: bool = False
    layers_per_stage: list[int] | None = None  # explicit split over pp * vpp (virtual) stages; None = even

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Layers per (virtual) stage, in model order: stage s = virtual chunk s // pp on rank s % pp."""
        if self.layers_per_stage is not None:
            return list(self.layers_per_stage)
        n = self.num_stages
        return [num_layers // n] * n

    def stage_boundaries(self, num_layers: int) -> list[int]:
        """First layer index of each (virtual) stage, plus num_layers at the end."""
        out = [0]
        for c in self.stage_layer_counts(num_layers):
            out.append(out[-1] + c)
        return out

    def describe(self) -> str:
        s = f"TP{self.tp} PP{self.pp} EP{self.ep} CP{self.cp} DP{self.dp}"
        if self.vpp > 1:
            s += f" VPP{self.vpp}"
        if self.sequence_parallel:
            s += " +SP"
        return s

    # ------------------------------------------------------------------------------------------------
    def validate(self, cfg: K3Config, seq_length: int | None = None, micro_batch_size: int | None = None,
                 global_batch_size: int | None = None, world_size: int | None = None) -> "ParallelLayout":
        def need(cond, msg):
            if not cond:
                raise LayoutError(f"layout {self.describe()}: {msg}")

        for name in ("tp", "pp", "ep", "cp", "dp", "vpp"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, f"{name} must be a positive integer (got {v!r})")
        if world_size is not None:
            need(world_size == self.world_size,
                 f"world size {world_size} != TP*PP*CP*DP = {self.world_size}")
        need((self.tp * self.cp * self.dp) % self.ep == 0,
             f"EP={self.ep} must divide TP*CP*DP = {self.tp * self.cp * self.dp} (the expert grid)")
        hp = self.tp * self.cp
        need(cfg.kda_num_heads % hp == 0,
             f"TP*CP = {hp} must divide the KDA heads ({cfg.kda_num_heads}): a head never spans ranks")
        need(cfg.num_attention_heads % hp == 0,
             f"TP*CP = {hp} must divide the MLA heads ({cfg.num_attention_heads}): a head never spans ranks")
        need(cfg.vocab_size % self.tp == 0, f"TP={self.tp} must divide the vocabulary ({cfg.vocab_size})")
        need(cfg.intermediate_size % self.tp == 0,
             f"TP={self.tp} must divide the dense FFN width ({cfg.intermediate_size})")
        if cfg.num_experts > 0:
            need(cfg.num_experts % self.ep == 0, f"EP={self.ep} must divide the routed experts ({cfg.num_experts})")
            shared = cfg.num_shared_experts * cfg.moe_intermediate_size
            need(shared % self.tp == 0, f"TP={self.tp} must divide the shared-expert width ({shared})")
        need(self.vpp == 1 or self.pp > 1, "virtual pipeline stages (VPP > 1) need PP > 1")
        counts = self.stage_layer_counts(cfg.num_hidden_layers)
        need(len(counts) == self.num_stages,
             f"layers_per_stage has {len(counts)} entries, expected PP*VPP = {self.num_stages}")
        need(all(c >= 1 for c in counts) and sum(counts) == cfg.num_hidden_layers,
             f"{cfg.num_hidden_layers} layers cannot be split into {self.num_stages} stages as {counts}"
             + ("" if self.layers_per_stage else " (give layers_per_stage for an uneven split)"))
        bs = cfg.attn_res_block_size
        if bs is not None and self.num_stages > 1:
            bad = [b for b in self.stage_boundaries(cfg.num_hidden_layers)[1:-1] if b % bs]
            need(not bad, f"pipeline stage boundaries {bad} split an Attention-Residual block "
                          f"(blocks are {bs} layers): stages must hold whole blocks")
        if cfg.num_nextn_predict_layers > 0:
            need(self.pp == 1, "MTP with PP > 1 is not supported yet (the MTP head needs the embedding table)")
        if seq_length is not None:
            need(seq_length % (2 * self.cp) == 0,
                 f"sequence length {seq_length} must be divisible by 2*CP = {2 * self.cp}")
            if self.sequence_parallel or cfg.num_experts > 0:
                need((seq_length // self.cp) % self.tp == 0,
                     f"sequence length per CP rank ({seq_length // self.cp}) must be divisible by TP={self.tp} "
                     "(sequence parallelism / MoE token sharding)")
        if global_batch_size is not None and micro_batch_size is not None:
            per_step = micro_batch_size * self.dp
            need(global_batch_size % per_step == 0,
                 f"global batch {global_batch_size} is not divisible by micro batch x DP = {per_step}")
            n_micro = global_batch_size // per_step
            if self.pp > 1:
                need(n_micro >= self.pp, f"{n_micro} micro-batches per step < PP={self.pp}: the pipeline cannot fill")
            if self.vpp > 1:
                need(n_micro % self.pp == 0,
                     f"interleaved pipeline needs micro-batches ({n_micro}) divisible by PP={self.pp}")
        return self
