"""Training metrics: routing statistics, the run's ``metrics.jsonl`` and wandb (offline by default).

Routing statistics per MoE layer, from the expert token counts of a whole step (all micro-batches, all
data-parallel ranks):

- ``entropy``: Shannon entropy of the load distribution divided by ``log(E)``: 1 = uniform, 0 = one expert;
- ``dead``: experts that received no token;
- ``max_mean``: max load / mean load (``E / k`` at worst when ``k`` experts take everything).

``max_mean`` alone cannot tell "4 experts take everything" (fatal) from "1 popular expert" (harmless);
entropy and the dead count can.
"""
from __future__ import annotations

import json
import math
import os
import struct

import torch


def routing_stats(counts: torch.Tensor) -> dict:
    c = counts.double().flatten()
    E = c.numel()
    total = c.sum().item()
    if total <= 0:
        return {"entropy": 0.0, "dead": E, "max_mean": 0.0}
    p = c / total
    nz = p[p > 0]
    ent = float(-(nz * nz.log()).sum() / math.log(E)) if E > 1 else 1.0
    return {"entropy": ent, "dead": int((c == 0).sum()), "max_mean": float(c.max() / c.mean())}


class MetricsLogger:
    """Rank-0 sink: console line, ``metrics.jsonl`` and wandb (``offline`` unless a project is given online)."""

    def __init__(self, run_dir: str, config: dict, wandb_project: str | None = None, wandb_mode: str = "offline",
                 enabled: bool = True):
        self.enabled = enabled
        self.run = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.f = open(self.path, "a")
        if wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            mode = "online" if (wandb_project and wandb_mode == "online") else "offline"
            self.run = wandb.init(project=wandb_project or "megatron-k3", dir=run_dir, mode=mode, config=config,
                                  reinit="finish_previous")

    def log(self, rec: dict):
        if not self.enabled:
            return
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=rec.get("step"))

    def close(self):
        if not self.enabled:
            return
        self.f.close()
        if self.run is not None:
            self.run.finish()


def read_wandb_history(path: str) -> list[dict]:
    """Read the history rows of an offline ``run-*.wandb`` file (LevelDB-log framed ``Record`` protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    pos = 7  # ":W&B" + 2-byte version + 1 byte: the file header
    block = 32768
    rows, pending = [], b""
    while pos + 7 <= len(data):
        left = block - (pos % block)
        if left < 7:
            pos += left
            continue
        _crc, length, typ = struct.unpack("<IHB", data[pos:pos + 7])
        if typ == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if typ in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if typ in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            if rec.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in rec.history.item})
            pending = b""
    return rows
