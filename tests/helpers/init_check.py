"""Run by tests/parallel/test_init.py under torchrun with 2 ranks (gloo).

``layouts``: the per-rank initialisation (``runtime.build_model_chunks(init_seed=...)``) of DP2 (TP1 per rank),
TP2 (+SP), PP2 and EP2 gives, gathered through the weight adapter, exactly the golden
``K3ForCausalLM(cfg, seed)`` (bit for bit, every tensor covered).

``memory``: peak host memory of building and initialising this rank's chunks (VmHWM, reset through
/proc/self/clear_refs just before), next to this rank's shard bytes and the largest single full parameter;
then the same for the old way (the whole golden model built, its state dict sliced into the shards)."""
import json
import sys

import torch
import torch.distributed as dist

from megatron_k3.config import get_preset
from megatron_k3.parallel.layout import ParallelLayout
from megatron_k3.parallel import adapter
from megatron_k3.parallel.runtime import build_model_chunks, init_distributed
from megatron_k3.model import K3ForCausalLM, hf_shapes

mode = sys.argv[1]
SEED = 77


def gather_full(chunks, cfg, shapes):
    from megatron.core import parallel_state as ps

    pieces = [p for c in chunks for p in adapter.local_pieces(c, ps.get_tensor_model_parallel_rank(), shapes)]
    allp = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(pieces, allp, dst=0)
    return adapter.assemble([p for g in allp for p in g], shapes) if dist.get_rank() == 0 else (None, None)


if mode == "layouts":
    from megatron.core import parallel_state as ps

    cfg = get_preset("k3-tiny")
    shapes = hf_shapes(cfg)
    ref = K3ForCausalLM(cfg, seed=SEED).state_dict()
    out = {}
    for name, lay in (("DP2", ParallelLayout(dp=2)), ("TP2+SP", ParallelLayout(tp=2, sequence_parallel=True)),
                      ("PP2", ParallelLayout(pp=2)), ("EP2", ParallelLayout(ep=2, dp=2))):
        device = init_distributed(lay, seed=0)
        # three threads: the values must not depend on which thread generated a module, nor in what order
        chunks, _ = build_model_chunks(cfg, lay, device=device, init_seed=SEED, init_workers=3)
        full, covered = gather_full(chunks, cfg, shapes)
        if dist.get_rank() == 0:
            bad = [k for k in ref if k not in full or not bool(covered[k].all()) or not torch.equal(full[k], ref[k])]
            out[name] = {"tensors": len(ref), "mismatched_or_missing": bad[:5], "n_bad": len(bad)}
        del chunks
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out))
elif mode == "memory":
    import gc

    def hwm_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmHWM")

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

    def reset_peak():
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    # a vocabulary large enough that the embedding and the head dominate: the full model is ~4x one of them
    cfg = get_preset("k3-tiny", vocab_size=1 << 20)
    lay = ParallelLayout(tp=2)
    device = init_distributed(lay, seed=0)
    shapes = hf_shapes(cfg)
    largest = max(torch.Size(s).numel() for s in shapes.values()) * 4 / 2**20
    full_model = sum(torch.Size(s).numel() for s in shapes.values()) * 4 / 2**20
    build_model_chunks(cfg, lay, device=device, init_seed=SEED, init_workers=1)  # warm-up: imports, lazy caches
    gc.collect()
    reset_peak()
    base = rss_mb()
    chunks, _ = build_model_chunks(cfg, lay, device=device, init_seed=SEED, init_workers=1)
    new_peak = hwm_mb() - base
    shard = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()) / 2**20
    del chunks
    gc.collect()
    reset_peak()
    base = rss_mb()
    chunks, _ = build_model_chunks(cfg, lay, device=device, init_seed=SEED, init_workers=2)
    peak_two_workers = hwm_mb() - base
    del chunks
    gc.collect()
    reset_peak()
    base = rss_mb()
    chunks, _ = build_model_chunks(cfg, lay, device=device, init_seed=None)  # the old way: whole golden model
    sd = K3ForCausalLM(cfg, seed=SEED).state_dict()
    from megatron.core import parallel_state as ps

    adapter.load_hf_state_dict(chunks[0], sd, ps.get_tensor_model_parallel_rank())
    old_peak = hwm_mb() - base
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "peak_mb": new_peak, "peak_two_workers_mb": peak_two_workers, "shard_mb": shard, "largest_param_mb": largest,
                                  "full_model_mb": full_model, "old_way_peak_mb": old_peak}))
dist.barrier()
dist.destroy_process_group()
