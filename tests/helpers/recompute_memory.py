"""Saved-for-backward activation bytes of one k3-tiny forward (megatron model, world 1) for
--recompute-granularity none / selective / full, measured with autograd saved-tensor hooks.
Usage: python recompute_memory.py OUT.json"""
import json
import os
import sys

import torch



def main():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29655"), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    from megatron.core import parallel_state as ps

    from megatron_k3.config import get_preset
    from megatron_k3.parallel.layout import ParallelLayout
    from megatron_k3.parallel import adapter
    from megatron_k3.parallel.runtime import build_model_chunks, init_distributed
    from megatron_k3.model import K3ForCausalLM

    cfg = get_preset("k3-tiny")
    device = init_distributed(ParallelLayout(), seed=0)
    sd = K3ForCausalLM(cfg, seed=0).state_dict()
    ids = torch.randint(0, cfg.vocab_size, (4, 128))
    labels = torch.roll(ids, -1, 1)
    out = {}
    for mode in ("none", "selective", "full"):
        chunks, _ = build_model_chunks(cfg, ParallelLayout(), device=device, recompute=mode)
        adapter.load_hf_state_dict(chunks[0], sd, 0)
        seen, total = set(), [0]

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen and not isinstance(t, torch.nn.Parameter):
                seen.add(key)
                total[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lm, _ = chunks[0](input_ids=ids, labels=labels)
        lm.backward()
        grads = {n: p.grad.clone() for n, p in chunks[0].named_parameters() if p.grad is not None}
        out[mode] = {"saved_bytes": total[0], "loss": lm.item(), "grads": {n: g.norm().item() for n, g in grads.items()}}
    ps.destroy_model_parallel()
    json.dump(out, open(sys.argv[1], "w"))


if __name__ == "__main__":
    main()
