"""Planning without the hardware: the per-GPU memory planner (``planner``), parameter accounting on the meta
device (``model_info``) and the fake-world build of chosen ranks of a planned layout (``simulate``)."""
