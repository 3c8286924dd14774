"""K3 on megatron-core: parallel layers, the per-stage model, the HF weight adapter and runtime glue."""
