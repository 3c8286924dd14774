"""Run by tests/checkpoint/test_checkpoint.py under torchrun: with the distributed optimizer, saving and loading a
checkpoint moves no optimizer state between ranks. Every tensor collective of torch.distributed (all
threads: the background writer's too) is recorded with its element count while the trainer saves two steps'
state and loads it back; the largest must stay far below this rank's optimizer shard. Prints one RESULT line.
Flags: the trainer's (layout)."""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from megatron_k3.train.config import parse
from megatron_k3.train.trainer import Trainer

job = parse(sys.argv[1:] + ["--use-distributed-optimizer", "--micro-batch-size", "2", "--wandb-mode", "disabled",
                            "--lr-warmup-fraction", "0"])
t = Trainer(job).setup()
for s in range(2):
    t.train_step(t.loader.next_step(), t.lr_at(s))
calls = []


def wrap(name):
    """Record ``name`` in torch.distributed and in distributed_c10d, where the object collectives and DCP's
    helpers find it."""
    from torch.distributed import distributed_c10d as c10d

    orig = getattr(c10d, name)

    def f(*a, **k):
        ts = [x for x in list(a) + list(k.values()) if isinstance(x, torch.Tensor)]
        ts += [y for x in a if isinstance(x, (list, tuple)) for y in x if isinstance(y, torch.Tensor)]
        # uint8 tensors are pickled objects (plans, metadata); anything else would be numbers: state
        calls.append((name, sum(x.numel() for x in ts if x.dtype != torch.uint8),
                      sum(x.numel() for x in ts if x.dtype == torch.uint8)))
        return orig(*a, **k)

    setattr(dist, name, f)
    setattr(c10d, name, f)


for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "gather",
             "scatter", "reduce", "all_to_all_single", "send", "recv"):
    wrap(name)
shard = 0
from checkpoints_io.k3ckpt import _optimizers  # noqa: E402

for o in _optimizers(t.opt):
    for g in o.optimizer.param_groups:
        shard += sum(p.numel() for p in g["params"])
with tempfile.TemporaryDirectory() as d:
    d = d if dist.get_rank() == 0 else None
    obj = [d]
    dist.broadcast_object_list(obj, src=0)
    t.job.checkpoint.save = t.job.checkpoint.load = obj[0] + "/ckpt"
    t.save(2)
    t.wait_for_save()
    saved = list(calls)
    before = [p.detach().clone() for c in t.chunks for p in c.parameters()]
    t._resume()
    loaded = calls[len(saved):]
    after = [p.detach() for c in t.chunks for p in c.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(before, after))
    dist.barrier()
result = ("RESULT " + json.dumps({"rank": dist.get_rank(), "shard_elems": shard, "optimizer_state_elems": 3 * shard,
                              "max_numbers_save": max((n for _, n, _ in saved), default=0),
                              "max_numbers_load": max((n for _, n, _ in loaded), default=0),
                              "object_bytes_save": sum(b for _, _, b in saved),
                              "n_save": len(saved), "n_load": len(loaded), "weights_unchanged": same}) + "\n")
sys.stdout.flush()  # the ranks share one pipe: the line goes out in one write (< PIPE_BUF, so never interleaved)
os.write(1, result.encode())
t.close()
