"""K3 on megatron-core: the parallel layout and its validation (``layout``), the FP8 policy (``precision``), the
TransformerConfig (``tconfig``), tensor/sequence/context-parallel layers, the per-stage model, per-rank
initialisation, the HF weight adapter, collectives, layer CUDA graphs, experts, MoE balancing, runtime glue and
the parallel equivalence check (``verify``)."""
