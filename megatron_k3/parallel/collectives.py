"""Every tensor collective of this project goes through here: tensors on the process group's device.

NCCL takes CUDA tensors only; a CPU tensor fails deep inside the call ("No backend type associated with
device type cpu"), and gloo takes CPU tensors. On a CPU-only machine every group is gloo and every tensor
is on the CPU, so a collective given a host tensor works there and breaks on the first GPU run (it did:
the trainer's loss reduction, 2026-12-04). Two rules make that impossible:

- ``all_reduce`` / ``all_gather`` / ``all_gather_into_tensor`` check that the tensor is on the group's
  device (``group_device``) and raise ``CollectiveDeviceError`` naming both otherwise;
- values that live on the host (a flag, a step count, loss sums for logging) go through
  ``all_reduce_host``, which stages them through the group's device and returns a host tensor.

tests/parallel/test_collectives.py fails if any product module calls a ``torch.distributed`` tensor collective
directly, so the check above is on every path (object collectives, ``barrier`` and megatron-core's own
calls are outside its scope: they pick their device themselves).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


class CollectiveDeviceError(RuntimeError):
    """A tensor collective was given a tensor on a device its process group cannot take."""


def group_device(group=None) -> torch.device | None:
    """The device a tensor collective on ``group`` takes: CUDA (the current device) for NCCL, the CPU for gloo;
    None when any will do (torch's fake process group of ``simulate``)."""
    backend = str(dist.get_backend(group))
    devices = {part.split(":")[0] for part in backend.split(",") if ":" in part}  # "cpu:gloo,cuda:nccl" forms
    if "nccl" in backend or devices == {"cuda"}:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cuda")
    if "gloo" in backend or devices == {"cpu"}:
        return torch.device("cpu")
    return None


def _check(t: torch.Tensor, group, what: str) -> None:
    want = group_device(group)
    if want is not None and t.device.type != want.type:
        raise CollectiveDeviceError(f"{what}: a tensor on {t.device} given to a {dist.get_backend(group)} group, "
                                    f"which takes {want.type} tensors (stage host values through all_reduce_host)")


def all_reduce(t: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce of a tensor that lives on the group's device; returns it."""
    _check(t, group, "all_reduce")
    dist.all_reduce(t, op=op, group=group)
    return t


def all_reduce_host(t: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """All-reduce of host values: copied to the group's device, reduced, returned as a new CPU tensor."""
    dev = group_device(group) or t.device
    x = t.to(dev, copy=True)
    dist.all_reduce(x, op=op, group=group)
    return x.cpu()


def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group=None) -> list[torch.Tensor]:
    _check(t, group, "all_gather")
    dist.all_gather(parts, t, group=group)
    return parts


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group=None) -> torch.Tensor:
    _check(t, group, "all_gather_into_tensor")
    _check(out, group, "all_gather_into_tensor")
    dist.all_gather_into_tensor(out, t, group=group)
    return out


def all_to_all_single(out: torch.Tensor, t: torch.Tensor, group=None) -> torch.Tensor:
    _check(t, group, "all_to_all_single")
    dist.all_to_all_single(out, t, group=group)
    return out


def agree_any(flag: bool, group=None) -> bool:
    """True on every rank if ``flag`` is true on any (e.g. a signal that reached only some ranks)."""
    return bool(all_reduce_host(torch.tensor([1 if flag else 0], dtype=torch.int32), ReduceOp.MAX, group).item())


def agree_all(flag: bool, group=None) -> bool:
    """True on every rank only if ``flag`` is true on all of them."""
    return bool(all_reduce_host(torch.tensor([1 if flag else 0], dtype=torch.int32), ReduceOp.MIN, group).item())
