"""K3 checkpoints: sharded, layout-independent, atomic, checksummed; megatron-core ``dist_checkpointing`` on
PyTorch distributed checkpointing (DCP) with the O_DIRECT writer.

**Format.** Every tensor is stored as one *global* tensor under its official HF name (the golden model's
``state_dict`` names, e.g. ``model.layers.3.block_sparse_moe.experts.5.w1.weight``); each rank contributes
its shards as megatron ``ShardedTensor`` s with global offsets taken from the weight adapter
(``megatron_k3/parallel/adapter.py``: ``local[local_index] == hf[hf_name][hf_index]``). A shard held by
several ranks (DP replicas, TP-replicated norms, expert-DP replicas) is written once, by the lowest rank
holding it. Optimiser state is stored the same way, in *parameter space*: for every parameter its
param-shaped fp32 states (``master`` weights when the model is bf16, ``exp_avg``/``exp_avg_sq`` for Adam,
``momentum`` for Muon) under ``optimizer.<state>.<hf_name>``; megatron's distributed optimiser's flat DP
shards are assembled into parameter space on save and sliced back on load. Hence **any checkpoint loads
into any TP/PP/EP/CP/DP layout** (resharding is just a different set of global offsets), and HF export reads
the ``model.*``/``lm_head.*`` keys directly. Per-rank RNG states are a ``ShardedObject`` ``rng`` (restored
when the world size is unchanged). Trainer state (step, consumed tokens, loader position, config,
tokenizer identity) lives in ``k3_checkpoint.json``.

**Layout on disk**::

    SAVE/iter_0000020/                 __<rank>_0.distcp, .metadata, metadata.json (DCP + megatron)
                      k3_checkpoint.json   trainer state + per-file size and CRC32 (written last)
    SAVE/latest_checkpointed_iteration.txt   "20": the newest complete checkpoint

**Atomicity.** A checkpoint is written into ``iter_XXXXXXX.tmp``; after every rank has finished and
rank 0 has written ``k3_checkpoint.json`` and fsynced the files and the directory, the directory is renamed
to ``iter_XXXXXXX`` (fsync of the parent), and only then ``latest_checkpointed_iteration.txt`` is replaced
through a temporary file + ``os.replace`` (+ fsync). A crash at any moment leaves ``latest`` pointing at
the previous complete checkpoint; ``.tmp`` leftovers are ignored and removed by the next save. Retention
(keep last N) deletes only older complete checkpoints, never the one ``latest`` names. Weights with a
NaN/Inf are refused before anything is written.

**Verification on load.** Missing ``k3_checkpoint.json`` (incomplete), missing DCP metadata, a file whose
size or CRC32 differs from the recorded one, or a model config that differs from the running one raise
``CheckpointError`` naming the file; nothing on disk is modified by loading.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_k3.config import ConfigError
from megatron_k3.parallel.collectives import ReduceOp, all_reduce_host
from megatron_k3.model import hf_shapes as model_hf_shapes
from megatron_k3.model.skeleton import GoldenSkeleton

import logging  # noqa: E402

# torch's checkpoint telemetry logger records every planned item at DEBUG (tens of thousands of records per
# save, ~10% of a save's host time); its handler discards them anyway
logging.getLogger("c10d-NullHandler-dcp_logger").setLevel(logging.WARNING)

FORMAT = "megatron-k3/1"
LATEST = "latest_checkpointed_iteration.txt"
META = "k3_checkpoint.json"
OPT_PREFIX = "optimizer."
TOKENIZER_PREFIX = "tokenizer-"  # the checkpoint's copy of its tokenizer file: iter_*/tokenizer-<name>


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (incomplete, corrupt, or for another model); names the file."""


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


# storage: the checksumming wrapper around the O_DIRECT / buffered DCP writers lives in odirect.py
from checkpoints_io.odirect import checksumming_writer as _checksumming_writer  # noqa: E402


def _save_strategy(kind: str, digests_out: dict, saver=None, group=None, thread_count: int = 1, after_write=None,
                   limit_bytes_per_s: float = 0.0):
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner, TorchDistSaveShardedStrategy,
                                                                   _replace_state_dict_keys_with_sharded_keys,
                                                                   mcore_to_pyt_state_dict)

    class K3SaveStrategy(TorchDistSaveShardedStrategy):
        """megatron's torch_dist format written through our storage writer: here (synchronously), or by the
        ``saver``'s background thread on its process group (``AsyncSaver``), followed by ``after_write``."""

        def save(self, sharded_state_dict, checkpoint_dir):
            import torch.distributed.checkpoint as dcp

            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            pyt = mcore_to_pyt_state_dict(sd, False)
            writer = _checksumming_writer(str(checkpoint_dir), kind, thread_count=thread_count,
                                          limit_bytes_per_s=limit_bytes_per_s)
            planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False,
                                       flatten_sharded_tensors=False)
            if saver is not None and saver.pool is not None:
                import torch.distributed as dist

                from checkpoints_io.write_procs import pooled

                # the files start as soon as this rank's local plan exists (write_procs.pooled: early start);
                # DCP names them after this rank's position in the save's group
                writer = pooled(writer, saver.pool, kind, limit_bytes_per_s, planner=planner,
                                rank=dist.get_rank(group) if dist.is_initialized() else 0)

            def write():
                import time

                t = time.perf_counter()
                dcp.save(pyt, storage_writer=writer, process_group=group, planner=planner)
                digests_out.update(writer.fs.digests)
                if saver is not None:  # the save's phases: planning, the data files, metadata and the rest
                    end = time.perf_counter()
                    span = writer.fs.span
                    saver.last.update(write_s=end - t, files_s=(span[1] - span[0]) if span else None,
                                      plan_s=(span[0] - t) if span else None, finish_s=(end - span[1]) if span else None,
                                      early_write=getattr(writer, "early_write", None))
                if after_write is not None:
                    after_write()

            if saver is None:
                write()
            else:
                saver.start(write)

    return K3SaveStrategy()


def _fsync_path(p):
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_crc(path, bufsize=16 << 20):
    crc, n = 0, 0
    with open(path, "rb") as f:
        while True:
            b = f.read(bufsize)
            if not b:
                return {"bytes": n, "crc32": crc}
            crc = zlib.crc32(b, crc)
            n += len(b)


# ------------------------------------------------------------------------------------------------------
# optimiser state in parameter space
def _optimizers(opt):
    subs = getattr(opt, "chained_optimizers", None)
    return list(subs) if subs is not None else [opt]


def _state_tensors(st: dict) -> dict:
    return {k: v for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0}


def _fp32_masters(o) -> dict:
    """{fp32 main param: model param} for megatron's Float16OptimizerWithFloat16Params (else empty)."""
    if not hasattr(o, "float16_groups"):
        return {}
    return {fp: mp for mg, fg in zip(o.float16_groups, o.fp32_from_float16_groups) for mp, fp in zip(mg, fg)}


def optimizer_param_states(opt, params) -> tuple[dict, int]:
    """``({param: {state_name: param-shaped fp32 tensor}}, steps)`` for every parameter in ``params``; ``steps``
    is this rank's largest per-parameter step count (ranks may differ: reduce with MAX). The tensors are the
    optimizers' own (fp32 already: no copy on the device).

    Knows megatron's FP32Optimizer / Float16OptimizerWithFloat16Params (in a ChainedOptimizer or alone),
    ``megatron_k3.optim.muon.MuonAdamW`` and the host-stream offload; the DistributedOptimizer's state is saved per
    rank by ``_distopt_entries`` instead (no collective)."""
    from megatron_k3.optim.muon import MuonAdamW

    out, steps = {}, 0
    for o in _optimizers(opt):
        if hasattr(o, "param_states") and hasattr(o, "load_param_states"):  # megatron_k3.optim.offload host stream
            st = o.param_states()
            for p, n in o._names().items():
                if n in st["params"]:
                    out[p] = dict(st["params"][n])  # host tensors: written from the host
            steps = max(steps, int(st["step"]))
            continue
        if isinstance(o, MuonAdamW):
            for group in o.param_groups:
                for p in group["params"]:
                    st = o.state.get(p, {})
                    out[p] = {k: v.float() for k, v in _state_tensors(st).items()}
                    steps = max(steps, int(st.get("step", 0)))
            continue
        if hasattr(o, "model_param_gbuf_map"):  # DistributedOptimizer: saved per rank (_distopt_entries)
            continue
        inner, masters = o.optimizer, _fp32_masters(o)
        for group in inner.param_groups:
            for q in group["params"]:
                model_p = masters.get(q, q)
                st = inner.state.get(q, {})
                d = {k: v.detach().float() for k, v in _state_tensors(st).items()}  # fp32: views, no copy
                if q is not model_p:
                    d["master"] = q.detach().float()
                if "step" in st:
                    steps = max(steps, int(float(st["step"])))
                out[model_p] = d
    return out, steps


def _restore(main, st: dict, d: dict, steps: int):
    """Write the saved tensors ``d`` into one torch-optimizer parameter ``main`` (``master``) and its state
    ``st`` (Adam moments, with ``step``)."""
    for k, v in d.items():
        if k == "master":
            main.data.copy_(v.to(main.dtype))
        else:
            st[k] = v.to(device=main.device, dtype=main.dtype).clone()
    if any(k != "master" for k in d):
        st["step"] = torch.tensor(float(steps))


def load_optimizer_param_states(opt, states: dict, steps: int):
    """Inverse of :func:`optimizer_param_states`: ``states`` maps parameters to param-shaped tensors."""
    from megatron_k3.optim.muon import MuonAdamW

    for o in _optimizers(opt):
        if hasattr(o, "param_states") and hasattr(o, "load_param_states"):  # host stream: full tensors per name
            params = {}
            for p, n in o._names().items():
                d = states.get(p)
                if d is None:
                    raise CheckpointError(f"the checkpoint has no optimizer state for parameter {n}")
                params[n] = {k: v.cpu() for k, v in d.items()}
            o.load_param_states({"step": steps, "params": params})
            continue
        if isinstance(o, MuonAdamW):
            for group in o.param_groups:
                for p in group["params"]:
                    d = states.get(p)
                    if not d:
                        continue
                    st = o.state[p]
                    for k, v in d.items():
                        st[k] = v.to(device=p.device, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32).clone()
                    if "exp_avg" in d:
                        st["step"] = steps
            continue
        if hasattr(o, "model_param_gbuf_map"):  # loaded per rank (load_distopt_states)
            continue
        inner, masters = o.optimizer, _fp32_masters(o)
        for group in inner.param_groups:
            for q in group["params"]:
                d = states.get(masters.get(q, q))
                if d:
                    _restore(q, inner.state[q], d, steps)


# ------------------------------------------------------------------------------------------------------
# sharded state dict in HF names
def _offsets(hidx, gshape, lshape, key):
    off, frag = [], []
    for d, (s, G, L) in enumerate(zip(hidx, gshape, lshape)):
        start = s.start or 0
        if L == 0 or G % L or start % L:
            raise CheckpointError(f"{key}: shard of shape {tuple(lshape)} at offset {start} on axis {d} does not "
                                  f"tile the global shape {tuple(gshape)}")
        off.append(start)
        frag.append(G // L)
    return tuple(off), tuple(frag)


def model_pieces(chunks, tp_rank: int, hf_shapes: dict):
    """[(hf_name, param_or_buffer, hf_index, local_index)] for every local tensor of ``chunks`` (found once per
    chunk list: a built model's structure does not change)."""
    from megatron_k3.parallel import adapter

    key = (tuple(id(c) for c in chunks), tp_rank)
    hit = _PIECES.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], chunks)):
        return hit[1]
    out = []
    for c in chunks:
        for name, t in adapter._named_tensors(c).items():
            for hf, hidx, lidx in adapter.pieces(c, name, t, tp_rank, hf_shapes):
                out.append((hf, t, hidx, lidx))
    _PIECES.clear()  # one model at a time
    _PIECES[key] = (list(chunks), out)
    return out


_PIECES: dict = {}


def _owners(entries):
    """replica_id per (key, offset): 0 on the lowest rank holding that shard, 1 elsewhere (collective)."""
    import torch.distributed as dist

    mine = [(k, off) for k, off in entries]
    allr = [None] * dist.get_world_size()
    dist.all_gather_object(allr, mine)
    owner = {}
    for r, lst in enumerate(allr):
        for e in lst:
            owner.setdefault(tuple(e), r)
    me = dist.get_rank()
    return [0 if owner[(k, off)] == me else 1 for k, off in mine]


def _sharded(entries, replica):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sd = {}
    for (key, data, gshape, off, frag), rid in zip(entries, replica):
        sd[key + "@" + ",".join(map(str, off))] = ShardedTensor(
            key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape), global_shape=tuple(gshape),
            global_offset=off, axis_fragmentations=frag, replica_id=rid)
    return sd


def _rng_state():
    import random

    import numpy as np

    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        st["tracker"] = get_cuda_rng_tracker().get_states()
    except Exception:  # noqa: BLE001  (no tracker on this backend)
        pass
    return st


def _set_rng_state(st):
    import random

    import numpy as np

    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    if "tracker" in st:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(st["tracker"])


def flat_range_boxes(shape, start: int, end: int) -> list[tuple]:
    """The flat (row-major) element range [start, end) of a tensor of ``shape`` as boxes (tuples of slices),
    each a contiguous range itself: a partial first row, whole middle rows, a partial last row, recursively.
    A distributed-optimizer shard (a flat range of a parameter) is written as these boxes, each at its
    global offset in the HF-named tensor, so every rank writes only its own range and any layout reads them."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [(slice(start, end),)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(end, inner)
    if r0 == r1:
        return [(slice(r0, r0 + 1),) + b for b in flat_range_boxes(shape[1:], o0, o1)]
    out = []
    if o0:
        out += [(slice(r0, r0 + 1),) + b for b in flat_range_boxes(shape[1:], o0, inner)]
        r0 += 1
    if r1 > r0:
        out.append((slice(r0, r1),) + tuple(slice(0, n) for n in shape[1:]))
    if o1:
        out += [(slice(r1, r1 + 1),) + b for b in flat_range_boxes(shape[1:], 0, o1)]
    return out


def _box_flat(box, shape) -> tuple[int, int]:
    """[start, end) of a contiguous box in the flat index space of ``shape``."""
    stride, start, n = 1, 0, 1
    for sl, dim in zip(reversed(box), reversed(shape)):
        start += sl.start * stride
        stride *= dim
        n *= sl.stop - sl.start
    return start, start + n


def _intersect(box, lidx, shape):
    """``box`` restricted to the local slice ``lidx`` (None if empty)."""
    out = []
    for b, l, dim in zip(box, lidx, shape):
        lo, hi = max(b.start, l.start or 0), min(b.stop, dim if l.stop is None else l.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def _distopt_entries(o, pieces_by_param, hf_shapes, names_by_hf=None):
    """Distributed optimizer, this rank only: ``(entries, tensors, steps)``. ``entries`` are
    ``(key, data, global shape, global offset, None)`` boxes of this rank's flat range of every parameter it
    owns, for each state (``master``: the fp32 main parameter; Adam's ``exp_avg``, ``exp_avg_sq``). Saving
    (``names_by_hf`` None): ``data`` are views of the optimizer's own tensors (nothing is gathered or copied).
    Loading: ``data`` are views of new flat buffers, returned in ``tensors`` {param: {state: flat buffer}}
    for ``load_distopt_states``."""
    entries, tensors, steps = [], {}, 0
    for p, pieces in pieces_by_param.items():
        if p not in o.model_param_group_index_map:
            continue
        r = o._get_model_param_range_map(p)["param"]
        if names_by_hf is None:
            st = o._get_main_param_and_optimizer_states(p)
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() == 0:
                    steps = max(steps, int(v.item()))
            flat = {("master" if k == "param" else k): v.detach().view(-1) for k, v in st.items()
                    if isinstance(v, torch.Tensor) and v.dim() > 0}
        else:
            names = sorted({n for hf, _, _ in pieces for n in names_by_hf.get(hf, [])})
            flat = {n: torch.zeros(r.size, dtype=torch.float32, device=p.device) for n in names}
        if not flat:
            continue
        tensors[p] = flat
        for box in flat_range_boxes(tuple(p.shape), r.start, r.end):
            for hf, hidx, lidx in pieces:
                sub = _intersect(box, lidx, p.shape)
                if sub is None:
                    continue
                a, b = _box_flat(sub, tuple(p.shape))
                local_shape = tuple(sl.stop - sl.start for sl in sub)
                off = tuple((h.start or 0) + (x.start - (l.start or 0)) for h, x, l in zip(hidx, sub, lidx))
                for n, v in flat.items():
                    entries.append((f"{OPT_PREFIX}{n}.{hf}", v[a - r.start:b - r.start].view(local_shape),
                                    hf_shapes[hf], off, None))
    return entries, tensors, steps


def load_distopt_states(o, tensors: dict, steps: int):
    """Write loaded flat shards (``_distopt_entries`` on load) into the distributed optimizer."""
    for p, flat in tensors.items():
        gi, go = o.model_param_group_index_map[p]
        main = o.optimizer.param_groups[gi]["params"][go]
        _restore(main, o.optimizer.state[main], {k: v.view(main.shape) for k, v in flat.items()}, steps)


def _sharded_state(chunks, opt, tp_rank, hf_shapes, with_optimizer=True, opt_state_names=None):
    """(sharded_state_dict, [(hf, param, hidx, lidx)], opt_states, this rank's optimizer steps, distopt) for save
    (``opt_state_names`` None) or load. Optimizer state: param-shaped per parameter, except the distributed
    optimizer's, which is this rank's flat ranges as boxes (``_distopt_entries``; ``distopt``: [(optimizer,
    {param: {state: flat}})] for the load)."""
    pieces = model_pieces(chunks, tp_rank, hf_shapes)
    entries = []
    for hf, t, hidx, lidx in pieces:
        data = t.data[lidx]
        off, frag = _offsets(hidx, hf_shapes[hf], data.shape, hf)
        entries.append((hf, data, hf_shapes[hf], off, frag))
    opt_states, steps, distopt = {}, 0, []
    if with_optimizer and opt is not None:
        by_param: dict = {}
        for hf, t, hidx, lidx in pieces:
            if isinstance(t, torch.nn.Parameter):
                by_param.setdefault(t, []).append((hf, hidx, lidx))
        done = set()
        for o in _optimizers(opt):
            if hasattr(o, "model_param_gbuf_map"):  # DistributedOptimizer: each rank its own flat ranges
                ents, tens, st = _distopt_entries(o, by_param, hf_shapes, opt_state_names)
                entries += ents
                steps = max(steps, st)
                distopt.append((o, tens))
                done |= {p for b in o.buffers for p in b.params}  # all its params: saved by their ranges' owners
        if opt_state_names is None:  # saving: read the other optimizers' states (param-shaped, in place)
            opt_states, st = optimizer_param_states(opt, [p for p in by_param if p not in done])
            steps = max(steps, st)
        for hf, t, hidx, lidx in pieces:
            if t in done:
                continue
            if opt_state_names is None:
                names = sorted(opt_states.get(t, {}))
            else:  # loading: allocate param-shaped targets for the states the checkpoint has
                names = opt_state_names.get(hf, [])
                if names and t not in opt_states:
                    opt_states[t] = {n: torch.zeros(t.shape, dtype=torch.float32, device=t.device) for n in names}
            for n in names:
                data = opt_states[t][n][lidx]
                off, frag = _offsets(hidx, hf_shapes[hf], data.shape, hf)
                entries.append((f"{OPT_PREFIX}{n}.{hf}", data, hf_shapes[hf], off, frag))
    replica = _owners([(e[0], e[3]) for e in entries])
    return _sharded(entries, replica), pieces, opt_states, steps, distopt


# ------------------------------------------------------------------------------------------------------
# save
def _all_finite(chunks) -> bool:
    flags = [torch.isfinite(p.data).all() for c in chunks for p in c.parameters()]
    ok = torch.stack(flags).all().to(torch.int32).reshape(1).cpu() if flags else torch.ones(1, dtype=torch.int32)
    return bool(all_reduce_host(ok, ReduceOp.MIN).item())


class AsyncSaver:
    """Checkpoint writes in the background, one at a time.

    ``save_checkpoint(..., saver=AsyncSaver())`` returns once this rank's tensors are *staged*: copied into a
    host buffer (pinned on CUDA, allocated once and reused; the copies are the only device work, so a save
    needs no extra device memory) and the DCP plan is made. A background thread then writes the staged bytes
    through the storage writer (O_DIRECT by default) and finalises: size and CRC32 of every file, the metadata
    file, the rename of ``iter_*.tmp`` and only then ``latest`` (atomicity as for a synchronous save: a crash
    before the end leaves the previous ``latest`` and an ``iter_*.tmp`` that the next save removes). The
    thread's collectives run on a gloo process group of their own, beside the training's. ``wait()`` blocks
    until the write is durable and raises its error, if any; a new save waits for the previous one first,
    and the trainer waits before it exits (end, ``--exit-interval``, SIGTERM)."""

    def __init__(self, processes: int = 0):
        self.thread = None
        self.error = None
        self.group = None
        self.buffer = None
        # processes > 0: the files are written by that many writer processes sharing the staging buffer
        # (checkpoints_io/write_procs.py: no GIL shared with the training loop); 0: threads of this process
        self.processes = processes
        self.shared = None
        self.pool = None
        self.pending = None  # (step, root) of the write in flight
        self.validated = None  # signature of the last sharding megatron validated
        self._reserving = None  # the thread of reserve(), joined by the first stage()
        self.last = {}       # timings of the last save: stage_s, write_s, bytes

    def process_group(self):
        import torch.distributed as dist

        if self.group is None:  # collective: every rank's first save reaches it
            self.group = dist.new_group(backend="gloo")
        return self.group

    def reserve(self, nbytes: int, cuda: bool) -> None:
        """Allocate the host buffer (``nbytes``; pinned on CUDA) in a background thread, so that page-locking
        tens of GB does not stall the first save (the trainer calls this after its setup with an estimate)."""
        import threading

        def alloc():
            try:
                if self.shared is not None:
                    self.shared.ensure(nbytes)
                    self.buffer = self.shared.tensor
                else:
                    self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
            except Exception:  # noqa: BLE001  (an estimate only: stage() allocates what it needs and reports)
                pass

        if self.processes:
            try:
                self._start_pool(self.processes, cuda)  # here, in the calling (main) thread: see write_procs
            except OSError:
                pass  # stage() tries again and falls back to threads with a warning

        self._reserving = threading.Thread(target=alloc, name="k3-checkpoint-buffer", daemon=True)
        self._reserving.start()

    def wait_reserved(self) -> None:
        """Block until ``reserve()``'s allocation is done (``stage()`` waits for it too)."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def _start_pool(self, n: int, cuda: bool) -> None:
        from checkpoints_io.write_procs import SharedBuffer, WriterPool

        if self.shared is None:
            self.shared = SharedBuffer(0, pin=cuda)
        if self.pool is not None and self.pool.n != n:
            self.pool.close()
            self.pool = None
        if self.pool is None:
            self.pool = WriterPool(n, self.shared)
        self.pool.start()  # no-op while all are alive; replaces exited ones

    def close(self) -> None:
        """Stop the writer processes and free the staging buffer (after ``wait()``)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.buffer = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def stage(self, sd, workers: int = 0) -> int:
        """Replace the data of every ShardedTensor this rank writes (main replicas) in ``sd`` by a copy in the
        host buffer; returns the bytes staged. Each copy is handed on as a tensor whose storage is exactly its
        bytes (``torch.frombuffer`` over the buffer), so DCP's writer takes it as it is, without a clone."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        self.wait_reserved()
        tens = [v for v in sd.values() if isinstance(v, ShardedTensor) and v.replica_id == 0]
        total = sum(-(-t.data.numel() * t.data.element_size() // 64) * 64 for t in tens)
        cuda = any(t.data.is_cuda for t in tens)
        if self.processes:
            try:
                self._start_pool(workers or self.processes, cuda)
                self.shared.ensure(total)
                self.buffer = self.shared.tensor
            except OSError as e:  # e.g. a file-size limit also refuses the shared memory file
                import warnings

                warnings.warn(f"checkpoint writer processes unavailable ({e}); writing with threads",
                              RuntimeWarning, stacklevel=2)
                self.close()
                self.processes = 0
        if not self.processes and (self.buffer is None or self.buffer.numel() < total):
            self.buffer = None
            self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
        mv = memoryview(self.buffer.numpy())
        off, out = 0, []
        for t in tens:
            n = t.data.numel() * t.data.element_size()
            self.buffer[off:off + n].view(t.data.dtype).view(t.data.shape).copy_(t.data, non_blocking=cuda)
            out.append((t, torch.frombuffer(mv[off:off + n], dtype=t.data.dtype).view(t.data.shape) if n
                        else torch.empty(t.data.shape, dtype=t.data.dtype)))
            off += -(-n // 64) * 64
        if cuda:
            torch.cuda.synchronize()
        for t, staged in out:
            t.data = staged
        return total

    def start(self, fn):
        import threading

        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001  (reported by wait())
                self.error = e

        self.error = None
        self.thread = threading.Thread(target=run, name="k3-checkpoint-writer", daemon=True)
        self.thread.start()

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self):
        """Block until the write in flight is durable; raise its error (once)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        err, self.error = self.error, None
        if err is not None:
            raise err


def save_checkpoint(root: str, step: int, chunks, opt, cfg, trainer_state: dict, *, tp_rank: int,
                    writer: str = "odirect", keep_last: int = 0, hf_shapes: dict | None = None,
                    saver: AsyncSaver | None = None, thread_count: int = 1, limit_bytes_per_s: float = 0.0) -> str:
    """Collective. Writes ``root/iter_<step>`` atomically and switches ``latest``; returns the directory. With
    ``saver`` the write continues in the background after the return (``AsyncSaver``); ``thread_count``:
    files (and writer threads) per rank."""
    import torch.distributed as dist

    if saver is not None:
        saver.wait()  # one write at a time
    if not _all_finite(chunks):
        raise CheckpointError(f"refusing to save step {step} to {root}: the weights contain NaN/Inf "
                              "(the previous checkpoint is kept)")
    hf_shapes = hf_shapes or GoldenSkeleton(cfg).shapes
    sd, pieces, opt_states, steps, distopt = _sharded_state(chunks, opt, tp_rank, hf_shapes)
    state_names = {hf: sorted(opt_states[t]) for hf, t, _, _ in pieces if t in opt_states}
    for _, tens in distopt:
        for hf, t, _, _ in pieces:
            if t in tens:
                state_names[hf] = sorted(tens[t])
    names_all = [None] * dist.get_world_size()
    dist.all_gather_object(names_all, state_names)
    state_names = {k: v for d in names_all for k, v in d.items()}
    steps = int(all_reduce_host(torch.tensor([steps], dtype=torch.int64), ReduceOp.MAX).item())
    return _write(root, step, sd, cfg, {"optimizer_states": state_names, "optimizer_steps": steps, **trainer_state},
                  writer=writer, keep_last=keep_last, rng=True, saver=saver, thread_count=thread_count,
                  limit_bytes_per_s=limit_bytes_per_s)


def _write(root, step, sd, cfg, meta_extra, *, writer="odirect", keep_last=0, rng=True, saver=None, thread_count=1,
           limit_bytes_per_s=0.0):
    import threading
    import time

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    final = os.path.join(root, iter_name(step))
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for p in Path(root).glob("iter_*.tmp"):  # leftovers of crashed saves
            shutil.rmtree(p, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    if rng:
        sd["rng"] = ShardedObject("rng", _rng_state(), (world,), (rank,), replica_id=0)
    digests: dict = {}
    group = None
    t0 = time.perf_counter()
    if saver is not None:
        group = saver.process_group()
        nbytes = saver.stage(sd, workers=thread_count)
        ready = threading.Event()  # megatron writes metadata.json after the strategy returns: wait for it
        saver.last = {"stage_s": time.perf_counter() - t0, "bytes": nbytes}
        strategy = _save_strategy(writer, digests, saver=saver, group=group, thread_count=thread_count,
                                  limit_bytes_per_s=limit_bytes_per_s, after_write=lambda: (ready.wait(), _finalize(root, step, tmp, final, cfg, meta_extra,
                                                                                 digests, keep_last, group)))
        saver.pending = (step, root)
        # megatron checks the sharding (every shard covered once) with a gather of all shards' metadata: once
        # per structure; a later save of the same keys and offsets on every rank skips it
        sig = hash(tuple(sorted((k, tuple(getattr(v, "global_offset", ()))) for k, v in sd.items())))
        from megatron_k3.parallel.collectives import agree_all

        same = agree_all(sig == saver.validated, group=group)
        dist_checkpointing.save(sd, tmp, sharded_strategy=strategy, validate_access_integrity=not same)
        saver.validated = sig
        ready.set()
        return final
    dist_checkpointing.save(sd, tmp, sharded_strategy=_save_strategy(writer, digests, thread_count=thread_count,
                                                                     limit_bytes_per_s=limit_bytes_per_s))
    _finalize(root, step, tmp, final, cfg, meta_extra, digests, keep_last, None)
    return final


def _finalize(root, step, tmp, final, cfg, meta_extra, digests, keep_last, group):
    """After every rank's files are written: sizes and CRC32s, the metadata file, the rename and ``latest``."""
    import torch.distributed as dist

    rank = dist.get_rank()
    allg = [None] * dist.get_world_size()
    dist.all_gather_object(allg, digests, group=group)
    if rank == 0:
        tok = (meta_extra.get("tokenizer") or {}).get("path")
        if tok and os.path.isfile(tok):  # the checkpoint carries its tokenizer (HF export, evaluation)
            shutil.copyfile(tok, os.path.join(tmp, TOKENIZER_PREFIX + os.path.basename(tok)))
        files = {}
        for d in allg:
            files.update(d)
        for f in sorted(os.listdir(tmp)):  # files written outside the checksumming writer (metadata.json)
            if f not in files:
                files[f] = _file_crc(os.path.join(tmp, f))
                _fsync_path(os.path.join(tmp, f))
        meta = {"format": FORMAT, "step": step, "config": cfg.to_dict(), "world_size": dist.get_world_size(),
                "files": files, **meta_extra}
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        if os.path.exists(final):  # a complete checkpoint of the same step that `latest` does not name
            stale = final + f".stale-{os.getpid()}"
            os.rename(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_path(root)
        _write_latest(root, step)
        if keep_last > 0:
            _retain(root, keep_last, step)
    dist.barrier(group=group)


def _write_latest(root, step):
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_path(root)


def complete_steps(root) -> list[int]:
    out = []
    for p in Path(root).glob("iter_*"):
        if p.is_dir() and not p.name.endswith(".tmp") and (p / META).is_file() and p.name[5:].isdigit():
            out.append(int(p.name[5:]))
    return sorted(out)


def _retain(root, keep_last, newest):
    steps = complete_steps(root)
    for s in steps[:-keep_last] if keep_last < len(steps) else []:
        if s != newest:
            shutil.rmtree(os.path.join(root, iter_name(s)), ignore_errors=True)


def latest_step(root) -> int | None:
    p = os.path.join(root, LATEST)
    if not os.path.isfile(p):
        return None
    txt = open(p).read().strip()
    if not txt.isdigit():
        raise CheckpointError(f"{p}: expected a step number, found {txt[:40]!r}")
    return int(txt)


# ------------------------------------------------------------------------------------------------------
# load
def resolve(path, step: int | None = None) -> str | None:
    """The checkpoint directory for ``path`` (a save dir with ``latest``, or an ``iter_*`` dir); None if
    ``path`` holds no checkpoint yet."""
    p = Path(path)
    if (p / META).is_file() or p.name.startswith("iter_"):
        return str(p)
    if step is None:
        step = latest_step(p)
        if step is None:
            # No pointer yet. A directory is renamed from ``iter_*.tmp`` to ``iter_*`` only once complete (its
            # metadata written and fsynced), and ``latest`` is written right after: a run killed between the two
            # (during its first save) left a complete checkpoint without a pointer, which is resumed. Leftovers
            # of a save that never finished (``*.tmp``) are no checkpoint: with nothing else the run starts
            # again from scratch (refusing would fail every restart of the supervisor).
            done = complete_steps(p)
            if not done:
                if [q for q in p.glob("iter_*") if not q.name.endswith(".tmp")]:  # not written by a save
                    raise CheckpointError(f"{p / LATEST} is missing and {p} holds checkpoint directories without "
                                          f"{META}; pass a complete one explicitly")
                return None
            step = done[-1]
    d = p / iter_name(step)
    if not d.is_dir():
        raise CheckpointError(f"{p / LATEST} names step {step} but {d} does not exist")
    return str(d)


def read_meta(ckpt_dir) -> dict:
    mp = os.path.join(ckpt_dir, META)
    if not os.path.isfile(mp):
        raise CheckpointError(f"incomplete checkpoint: {mp} is missing (the save did not finish)")
    try:
        with open(mp) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mp} is corrupt: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{mp}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    return meta


def verify_files(ckpt_dir, meta, rank: int = 0, world: int = 1) -> list[str]:
    """Errors (one line each, naming the file) for this rank's share of the recorded files."""
    errors = []
    files = sorted(meta["files"].items())
    for want in (".metadata", "metadata.json"):
        if want not in meta["files"]:
            errors.append(f"{os.path.join(ckpt_dir, want)}: not recorded in {META}")
    for i, (name, rec) in enumerate(files):
        if i % world != rank:
            continue
        fp = os.path.join(ckpt_dir, name)
        if not os.path.isfile(fp):
            errors.append(f"{fp}: missing")
            continue
        size = os.path.getsize(fp)
        if size != rec["bytes"]:
            errors.append(f"{fp}: {size} bytes, expected {rec['bytes']} (truncated or overwritten)")
            continue
        if _file_crc(fp)["crc32"] != rec["crc32"]:
            errors.append(f"{fp}: CRC32 mismatch (corrupted)")
    return errors


def check_config(ckpt_dir, meta, cfg):
    saved, mine = meta["config"], cfg.to_dict()
    diff = sorted(k for k in set(saved) | set(mine) if k not in ("name", "seq_length") and saved.get(k) != mine.get(k))
    if diff:
        k = diff[0]
        raise CheckpointError(f"{os.path.join(ckpt_dir, META)}: saved for another model: {len(diff)} config field(s) "
                              f"differ, e.g. {k}={saved.get(k)!r} there vs {mine.get(k)!r} here")


def load_checkpoint(path, chunks, opt, cfg, *, tp_rank: int, step: int | None = None, load_optim: bool = True,
                    load_rng: bool = True, hf_shapes: dict | None = None) -> dict | None:
    """Collective. Verifies and loads a checkpoint into ``chunks`` (and ``opt``); returns its metadata
    (trainer state), or None when ``path`` holds no checkpoint yet."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    d = resolve(path, step)
    if d is None:
        return None
    meta = read_meta(d)
    errs = verify_files(d, meta, rank, world)
    allerr = [None] * world
    dist.all_gather_object(allerr, errs)
    errs = [e for lst in allerr for e in lst]
    if errs:
        raise CheckpointError(errs[0] + (f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""))
    check_config(d, meta, cfg)
    hf_shapes = hf_shapes or GoldenSkeleton(cfg).shapes
    weights_only = bool(meta.get("weights_only"))
    use_opt = load_optim and not weights_only and opt is not None
    sd, pieces, opt_states, _, distopt = _sharded_state(chunks, opt, tp_rank, hf_shapes, with_optimizer=use_opt,
                                                     opt_state_names=meta.get("optimizer_states", {}))
    rng_ok = load_rng and not weights_only and meta.get("world_size") == world
    if rng_ok:
        sd["rng"] = ShardedObject("rng", None, (world,), (rank,), replica_id=0)
    loaded = dist_checkpointing.load(sd, d)
    with torch.no_grad():
        for k, v in loaded.items():
            if k == "rng":
                continue
            target = sd[k].data
            if v.data_ptr() != target.data_ptr():
                target.copy_(v)
        # the pieces were loaded into views of the parameters; buffers too (expert bias)
    if use_opt:
        steps = int(meta.get("optimizer_steps", meta["step"]))
        load_optimizer_param_states(opt, opt_states, steps)
        for o, tens in distopt:
            load_distopt_states(o, tens, steps)
    if rng_ok:
        _set_rng_state(loaded["rng"])
    meta["path"] = d
    return meta


# ------------------------------------------------------------------------------------------------------
# weights only: HF export / import (single process)
@contextmanager
def _world_of_one():
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as td:
        dist.init_process_group("gloo", init_method=f"file://{td}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def write_weights(out_dir, tensors, cfg, step: int = 0, tokenizer: dict | None = None, writer: str = "odirect") -> str:
    """Weights-only checkpoint (HF names -> full tensors) that the trainer's ``--load`` accepts (optimizer,
    data position and RNG start fresh). ``tensors``: dict or iterable of (name, tensor)."""
    items = dict(tensors.items() if isinstance(tensors, dict) else tensors)
    shapes = model_hf_shapes(cfg)
    missing = sorted(set(shapes) - set(items))
    extra = sorted(set(items) - set(shapes))
    if missing or extra:
        raise CheckpointError(f"weights do not match the model config: {len(missing)} missing (e.g. "
                              f"{missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})")
    for k, v in items.items():
        if tuple(v.shape) != tuple(shapes[k]):
            raise CheckpointError(f"{k}: shape {tuple(v.shape)}, the config expects {tuple(shapes[k])}")
        if not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"refusing to write {out_dir}: {k} contains NaN/Inf")
    with _world_of_one():
        entries = [(k, v.detach().contiguous(), v.shape, (0,) * v.dim(), (1,) * v.dim()) for k, v in items.items()]
        sd = _sharded(entries, [0] * len(entries))
        return _write(out_dir, step, sd, cfg, {"weights_only": True, "tokenizer": tokenizer, "consumed_tokens": 0},
                      writer=writer, rng=False)


def read_weights(path, step: int | None = None):
    """``(meta, {hf_name: (shape, dtype)}, get)`` for the model tensors of a checkpoint; ``get(names)`` loads
    just those (full tensors, any save layout). Verifies checksums first. Single process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    d = resolve(path, step)
    if d is None:
        raise CheckpointError(f"{path}: no checkpoint ({LATEST} missing)")
    meta = read_meta(d)
    errs = verify_files(d, meta)
    if errs:
        raise CheckpointError(errs[0])
    md = FileSystemReader(d).read_metadata().state_dict_metadata
    names = {k: (tuple(v.size), v.properties.dtype) for k, v in md.items()
             if hasattr(v, "size") and not k.startswith(OPT_PREFIX)}

    def get(which):
        out = {n: torch.empty(names[n][0], dtype=names[n][1]) for n in which}
        dcp.load(out, storage_reader=FileSystemReader(d), no_dist=True)
        return out

    meta["path"] = d
    copies = sorted(f for f in os.listdir(d) if f.startswith(TOKENIZER_PREFIX))
    if copies and meta.get("tokenizer") is not None:  # prefer the checkpoint's own copy (it cannot go missing)
        meta["tokenizer"] = {**meta["tokenizer"], "path": os.path.join(d, copies[0])}
    return meta, names, get
