r"""Chunked host-streamed AdamW: optimizer state in host memory, gradients streamed through a fixed buffer.

``--optimizer-offload host-stream``. Host memory holds, for the parameters this rank updates, the fp32
master weights and the two Adam moments (bf16 by default, fp32 with ``moments_dtype=torch.float32``):
8 bytes per parameter (12 with fp32 moments), plus a fixed chunk buffer. No parameter-sized gradient
buffer ever exists on the host (megatron-core's ``HybridDeviceOptimizer`` keeps a full fp32 host copy of
the gradients and fp32 moments: 16 bytes per parameter). Each step (after megatron's DDP has reduced the
gradients into its fp32 grad buffers, ``param.main_grad``):

1. the global gradient norm is computed on the device (megatron's filters: no shared parameters, no
   tensor-parallel duplicates; reduced over the model-parallel groups, or over the distributed-optimizer
   instance with ``use_distributed_optimizer``); clip coefficient ``c = clip / (norm + 1e-6)`` if < 1;
2. the host state is walked in chunks of ``chunk_bytes`` of gradient: chunk i+1 is copied device->host
   (side stream, pinned buffer) while the CPU updates chunk i and chunk i-1's updated weights are copied
   host->device (another side stream); ``num_buffers`` pinned buffers are reused round robin. Each chunk is
   planned once (``_Chunk``: its gradient slices, its output views back to back, its copies) and the plans are
   rebound when a parameter or buffer moves; a chunk's weights cross in one copy (without the distributed
   optimizer into a device staging slot, then one ``torch._foreach_copy_`` per dtype into the parameters);
3. each chunk's update is torch's AdamW (decoupled decay, bias correction). ``impl="onepass"`` (the
   default where it builds, ``impl="auto"``): ``host_adamw.c``, one pass over the chunk that reads the
   gradient, master and moments once and writes master, moments and the parameter-dtype weights once, with
   the roundings of torch's fused CPU kernel (checked bit for bit against it before use,
   ``host_kernel.self_check``); ``impl="fused"``: the vectorised, multithreaded ``torch._fused_adamw_`` CPU
   kernel; ``impl="torch"``: the same operations as ``torch.optim.AdamW``'s single-tensor path,
   bit-identical to it. The torch kernels work on fp32 working copies of the moments in blocks of
   ``cpu_block_elems`` (cache sized) and then cast the fp32 master to the parameter dtype. torch's fused
   kernel computes the last (< 16) elements of each thread's share in a scalar loop whose rounding of
   ``exp_avg_sq`` differs from its vector loop, so "fused" results depend on the thread count and block
   layout in those elements; the one-pass kernel uses the vector loop's roundings everywhere. The new weights
   are streamed back;
4. with the distributed optimizer each DP rank owns, as megatron's ``DistributedOptimizer`` does, the
   r-th of DP equal slices of every DDP bucket (``param_and_grad_buffer``), reads its reduced-scattered
   gradient slice, updates it, writes its slice of the bucket's parameter buffer and all-gathers the
   buckets (``DistributedDataParallel.start_param_sync``).

The update of element j only needs (g_j, master_j, m_j, v_j) and the step's scalars, which is why
streaming is exact. Muon (whole-matrix orthogonalisation) does not fit this element-wise stream; its
momentum-only state would (host bytes 4 + 2 per parameter), but it is not implemented here.

Parameter groups: ``param_groups`` holds a dense and an expert group (megatron's order) whose ``lr`` and
``weight_decay`` the trainer may set before each step (as with megatron's optimizer). Every parameter gets
the weight decay, as ``runtime.build_optimizer`` (``config_overrides={}``) does.

Checkpoint hooks: ``param_states()`` returns ``{"step": int, "params": {name: {"master", "exp_avg",
"exp_avg_sq"}}}`` with param-shaped fp32 CPU tensors for every model parameter of this rank (names from
``ddp_chunk.module.named_parameters()``, prefixed ``"{chunk}."`` when there are several model chunks); with
the distributed optimizer it all-gathers the shards over each bucket's DP group (a collective: call it on
every rank). ``load_param_states(states)`` takes the same structure (every rank passes the full tensors),
keeps its own slices and writes the masters into the model parameters (all-gathered again).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from ..parallel.collectives import all_gather_into_tensor, all_reduce

DEFAULT_CHUNK_BYTES = 32 << 20  # fp32 gradient bytes per streamed chunk (8M elements)
DEFAULT_CPU_BLOCK = 1 << 20     # elements per CPU update block (fp32 working copies of the moments)
IMPLS = ("auto", "onepass", "fused", "torch")


def proc_status_bytes(key: str = "VmRSS") -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class _Region:
    """A contiguous slice [lo, hi) of one DDP buffer that this rank updates, at host offset ``host``."""
    buffer: object
    lo: int
    hi: int
    host: int
    bucket_offset: int
    bucket_id: int
    pieces: list = field(default_factory=list)  # (param, param_lo, param_hi, buf_lo, group_index), by buf_lo
    starts: list = field(default_factory=list)  # buf_lo of each piece (bisection in _pieces_in)
    param_dtype: torch.dtype = torch.float32


@dataclass
class _Chunk:
    """One streamed chunk, planned once (``HostStreamAdamW._plan``) and replayed every step: host range
    [h0, h1); the gradient slices that fill its pinned buffer; per output slot the views the host update casts
    the new weights into (laid out back to back, each aligned to its dtype: one contiguous transfer of
    ``nbytes``), the host->device copies and the device-side scatter into the parameters (one
    ``torch._foreach_copy_`` per dtype instead of one copy per parameter)."""
    h0: int
    h1: int
    grads: list = field(default_factory=list)    # (off, grad_data view): g[off:off + n] <- view
    nbytes: int = 0
    layout: list = field(default_factory=list)   # (region, buf_lo, buf_hi, off, byte_lo)
    outs: list = field(default_factory=list)     # per slot: [(off, view of the pinned output slot)]
    h2d: list = field(default_factory=list)      # per slot: [(dst, src)] copies (non_blocking on CUDA)
    scatter: list = field(default_factory=list)  # per slot: [(dst views, src views)] for torch._foreach_copy_
    pieces: list = field(default_factory=list)   # per slot: the one-pass kernel's rows (HostAdamWUpdate.pieces)


def _fused_adamw_available() -> bool:
    if not hasattr(torch, "_fused_adamw_"):
        return False
    try:
        p, g, m, v = (torch.ones(4) for _ in range(4))
        torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(1.0)], lr=1e-3, beta1=0.9, beta2=0.95,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        return True
    except (RuntimeError, NotImplementedError):
        return False


class HostAdamWUpdate:
    """The host half of the stream: AdamW on ranges of flat host state (fp32 master, moments in
    ``moments_dtype``), one gradient chunk at a time, with the updated weights cast into output views.
    ``impl``: "onepass" (``host_adamw.c``: one sweep per chunk; its bits do not depend on chunk, block or
    thread layout), "fused" / "torch" (torch's kernels on fp32 working copies of the moments, each ``cpu_block``
    of elements while in cache; element-wise, but torch's fused kernel rounds ``exp_avg_sq`` differently in the
    scalar tail of each thread's share, module docstring), "auto" (onepass where it builds and passes its
    self-check, else fused; ``impl_note`` says why). ``segments``: (lo, hi, group) ranges covering the state,
    ``group`` indexing the per-step (lr, wd) list. ``out_dtypes``: the parameter dtypes the outputs will have.
    ``HostStreamAdamW`` owns one; ``benchmarks/bench_offload_host.py`` times it alone on a host."""

    def __init__(self, numel: int, segments, *, moments_dtype=torch.bfloat16, impl: str = "auto",
                 beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8, cpu_block_elems: int = DEFAULT_CPU_BLOCK,
                 max_chunk: int | None = None, out_dtypes=(), build_dir: str | None = None):
        if moments_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"moments_dtype must be torch.bfloat16 or torch.float32, not {moments_dtype}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
        self.impl_note = ""
        self.kernel = None
        if impl in ("auto", "onepass"):
            from . import host_kernel

            try:
                bad = [d for d in out_dtypes if d not in host_kernel.OUT_KIND]
                if bad:
                    raise host_kernel.KernelUnavailable(f"parameter dtypes {bad} (the one-pass kernel writes "
                                                        f"fp32 and bf16 weights)")
                self.kernel = host_kernel.load(build_dir)
                impl = "onepass"
            except host_kernel.KernelUnavailable as e:
                if impl == "onepass":
                    raise
                self.impl_note = f"one-pass kernel not used: {e}"
                impl = "fused" if _fused_adamw_available() else "torch"
        self.numel, self.segments = int(numel), list(segments)
        self.moments_dtype, self.impl = moments_dtype, impl
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.master = torch.empty(self.numel, dtype=torch.float32)
        self.exp_avg = torch.zeros(self.numel, dtype=moments_dtype)
        self.exp_avg_sq = torch.zeros(self.numel, dtype=moments_dtype)
        self.cpu_block = max(1024, int(cpu_block_elems))
        nb = min(self.cpu_block, max_chunk or self.cpu_block)
        # m, v, denom fp32 working copies (the torch kernels' path; the one-pass kernel needs none)
        self._ws = [] if self.kernel else [torch.empty(nb, dtype=torch.float32) for _ in range(3)]
        self._step_t = torch.zeros((), dtype=torch.float32)
        self._hyper, self._hyper_t = None, None  # the one-pass kernel's (lr, wd) table, rebuilt when it changes

    def pieces(self, h0: int, h1: int, outs) -> torch.Tensor:
        """The one-pass kernel's description of chunk [h0, h1) with outputs ``outs`` (as in ``update``):
        (a, z, group, out_kind, out_ptr) rows covering it, split at group and output boundaries. Built once
        per chunk plan and output slot (``HostStreamAdamW._bind``); the pointers stay valid while the
        output views live."""
        from .host_kernel import NO_OUTPUT, OUT_KIND, OnePassAdamW

        spans = sorted((h0 + off, h0 + off + view.numel(), view) for *_, off, view in outs)
        rows = []
        for lo, hi, gi in self.segments:
            a, z = max(lo, h0), min(hi, h1)
            if z <= a:
                continue
            pos = a
            for oa, oz, view in spans:
                x, y = max(pos, oa), min(z, oz)
                if y <= x:
                    continue
                if x > pos:
                    rows.append((pos, x, gi, NO_OUTPUT, 0))
                rows.append((x, y, gi, OUT_KIND[view.dtype], view.data_ptr() + (x - oa) * view.element_size()))
                pos = y
            if pos < z:
                rows.append((pos, z, gi, NO_OUTPUT, 0))
        return OnePassAdamW.pieces(rows, h0, h1)

    @property
    def work_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._ws)

    def update(self, g: torch.Tensor, h0: int, h1: int, step: int, clip: float, hyper, outs, pieces=None):
        """AdamW step ``step`` on host range [h0, h1) with gradient chunk g (clipped by ``clip``; in place
        except with the one-pass kernel); ``hyper``: (lr, weight_decay) per group; the new weights, in each
        output's dtype, into ``outs`` (``(..., chunk_off, view)`` tuples whose views cover
        [chunk_off, chunk_off + len) of the chunk). ``pieces``: ``self.pieces(h0, h1, outs)`` if already built."""
        if g.dtype != torch.float32:
            g = g.float()
        if self.kernel is not None:
            if pieces is None:
                pieces = self.pieces(h0, h1, outs)
            if hyper != self._hyper:  # once per step, not per chunk
                self._hyper, self._hyper_t = list(hyper), torch.tensor(hyper, dtype=torch.float64).reshape(-1, 2)
            self.kernel.chunk(pieces, h0, h1, g, self.master, self.exp_avg, self.exp_avg_sq, self._hyper_t, step,
                              self.beta1, self.beta2, self.eps, clip)
            return
        if clip != 1.0:
            g.mul_(clip)
        self._step_t.fill_(step)
        step = float(step)
        b1, b2, eps = self.beta1, self.beta2, self.eps
        for lo, hi, gi in self.segments:
            lo, hi = max(lo, h0), min(hi, h1)
            if hi <= lo:
                continue
            lr, wd = hyper[gi]
            for a in range(lo, hi, self.cpu_block):
                z = min(hi, a + self.cpu_block)
                n = z - a
                p = self.master[a:z]
                gg = g[a - h0:z - h0]
                if self.moments_dtype == torch.float32:
                    m, v = self.exp_avg[a:z], self.exp_avg_sq[a:z]
                else:
                    m = self._ws[0][:n].copy_(self.exp_avg[a:z])
                    v = self._ws[1][:n].copy_(self.exp_avg_sq[a:z])
                if self.impl == "fused":
                    torch._fused_adamw_([p], [gg], [m], [v], [], [self._step_t], lr=lr, beta1=b1, beta2=b2,
                                        weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
                else:  # torch.optim.AdamW's single-tensor path, operation for operation
                    if wd != 0:
                        p.mul_(1 - lr * wd)
                    m.lerp_(gg, 1 - b1)
                    v.mul_(b2).addcmul_(gg, gg, value=1 - b2)
                    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
                    denom = torch.sqrt(v, out=self._ws[2][:n]).div_(bc2 ** 0.5).add_(eps)
                    p.addcdiv_(m, denom, value=-(lr / bc1))
                if self.moments_dtype != torch.float32:
                    self.exp_avg[a:z].copy_(m)
                    self.exp_avg_sq[a:z].copy_(v)
                for *_, off, view in outs:   # cast while the block is in cache
                    x, y = max(a - h0, off), min(z - h0, off + view.numel())
                    if y > x:
                        view[x - off:y - off].copy_(p[x - (a - h0):y - (a - h0)])


class HostStreamAdamW:
    """See the module docstring. Built by ``build_host_stream_optimizer``."""

    def __init__(self, ddp_chunks, *, lr: float, weight_decay: float = 0.1, clip_grad: float = 1.0,
                 use_distributed_optimizer: bool = False, adam_eps: float = 1e-8, beta1: float = 0.9,
                 beta2: float = 0.95, moments_dtype=torch.bfloat16, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 cpu_block_elems: int = DEFAULT_CPU_BLOCK, num_buffers: int = 2, impl: str = "auto",
                 build_dir: str | None = None):
        from megatron.core import parallel_state as ps

        self.chunks = list(ddp_chunks)  # moments_dtype and impl are checked by HostAdamWUpdate
        self.distributed = bool(use_distributed_optimizer)
        self.clip_grad, self.beta1, self.beta2, self.eps = float(clip_grad), float(beta1), float(beta2), float(adam_eps)
        self.moments_dtype = moments_dtype
        self.step_count = 0
        self.timings = {}
        self._params = [p for d in self.chunks for p in d.module.parameters() if p.requires_grad]
        dense = [p for p in self._params if getattr(p, "allreduce", True)]
        expert = [p for p in self._params if not getattr(p, "allreduce", True)]
        common = {"lr": float(lr), "weight_decay": float(weight_decay), "betas": (self.beta1, self.beta2),
                  "eps": self.eps, "wd_mult": 1.0, "lr_mult": 1.0, "max_lr": float(lr), "min_lr": float(lr)}
        self.param_groups = [dict(common, params=dense, is_expert_parallel=False)]
        if expert:
            self.param_groups.append(dict(common, params=expert, is_expert_parallel=True))
        group_of = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}

        # the slices of every DDP buffer this rank owns, laid out back to back in host memory
        self.regions: list[_Region] = []
        host = 0
        grad_dtypes = set()
        for d in self.chunks:
            for buf in list(d.buffers) + list(d.expert_parallel_buffers):
                grad_dtypes.add(buf.grad_data.dtype)
                if self.distributed:
                    dp, rank = buf.data_parallel_group.size(), buf.data_parallel_group.rank()
                    if buf.param_data is None:
                        raise RuntimeError("the distributed optimizer needs DDP's param buffer "
                                           "(wrap_ddp(..., use_distributed_optimizer=True))")
                by_bucket = {}
                for p, (s, e, b) in buf.param_index_map.items():
                    by_bucket.setdefault(b, []).append((s, e, p))
                for bi, bucket in enumerate(buf.buckets):
                    n = bucket.grad_data.numel()
                    lo, hi = bucket.offset, bucket.offset + n
                    if self.distributed:
                        assert n % dp == 0, "megatron pads buckets to a multiple of DP"
                        lo, hi = bucket.offset + rank * (n // dp), bucket.offset + (rank + 1) * (n // dp)
                    reg = _Region(buf, lo, hi, host, bucket.offset, bi)
                    for s, e, p in sorted(by_bucket.get(bi, []), key=lambda t: t[0]):
                        a, z = max(s, lo), min(e, hi)
                        if z > a:
                            reg.pieces.append((p, a - s, z - s, a, group_of[p]))
                    reg.starts = [pb for _, _, _, pb, _ in reg.pieces]
                    if hi > lo:
                        self.regions.append(reg)
                        host += hi - lo
        if len(grad_dtypes) > 1:
            raise RuntimeError(f"grad buffers of several dtypes {grad_dtypes}")
        self.numel = host
        self.grad_dtype = grad_dtypes.pop() if grad_dtypes else torch.float32
        for reg in self.regions:
            reg.param_dtype = reg.buffer.param_dtype  # DDP keeps one buffer per (param, grad) dtype

        # host state: fp32 master + two moments, for the owned elements only (plus DDP's small padding)
        self.chunk_elems = max(1024, int(chunk_bytes) // self.grad_dtype.itemsize)
        self.host = HostAdamWUpdate(self.numel, self._group_segments(), moments_dtype=moments_dtype, impl=impl,
                                    beta1=self.beta1, beta2=self.beta2, eps=self.eps, cpu_block_elems=cpu_block_elems,
                                    max_chunk=min(self.chunk_elems, max(self.numel, 1)),
                                    out_dtypes=sorted({r.param_dtype for r in self.regions}, key=str),
                                    build_dir=build_dir)
        self.impl, self.impl_note = self.host.impl, self.host.impl_note
        self.master, self.exp_avg, self.exp_avg_sq = self.host.master, self.host.exp_avg, self.host.exp_avg_sq
        self.cuda = any(r.buffer.grad_data.is_cuda for r in self.regions)
        pin = self.cuda
        n = min(self.chunk_elems, max(self.numel, 1))
        self._gbufs = [torch.empty(n, dtype=self.grad_dtype, pin_memory=pin) for _ in range(num_buffers)]
        # updated weights leave through byte buffers viewed per region as that region's parameter dtype (a
        # chunk may span a bf16 and an fp32 buffer), back to back: one transfer per chunk; without the
        # distributed optimizer the parameters are separate tensors, so the bytes land in a device staging
        # slot and one _foreach_copy_ per dtype scatters them (instead of a host->device copy per parameter)
        self.chunks_plan = self._plan()
        nbytes = max([c.nbytes for c in self.chunks_plan] + [1])
        self._pbufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(num_buffers)]
        self._stage = []
        if self.cuda:
            dev = self.regions[0].buffer.grad_data.device
            self._d2h, self._h2d = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
            if not self.distributed:
                self._stage = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(num_buffers)]
        self._bound = None
        self._build_norm_lists(ps)
        self._load_master_from_params()

    # ---------------------------------------------------------------------------------------------------
    @property
    def fixed_buffer_bytes(self) -> int:
        """Bytes of the reused chunk buffers and CPU working copies (independent of the model size)."""
        return sum(t.numel() * t.element_size() for t in self._gbufs + self._pbufs) + self.host.work_bytes

    @property
    def device_buffer_bytes(self) -> int:
        """Bytes of the device staging slots (without the distributed optimizer; fixed, not per parameter)."""
        return sum(t.numel() for t in self._stage)

    @property
    def state_bytes(self) -> int:
        """Bytes of the host state (master + moments) of this rank."""
        return sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq))

    def _build_norm_lists(self, ps):
        from ..patches.lean_grad_clip import counts_in_grad_norm

        tp_group = ps.get_tensor_model_parallel_group()
        etp_group = ps.get_expert_tensor_parallel_group(check_initialized=False)
        # the order of megatron's optimizer parameters (the norm sums per-tensor norms in this order, so the
        # same order gives the same bits): named_parameters order (FP32/Float16 optimizers), or the DDP buffer
        # order with fp32 parameters before bf16/fp16 ones (DistributedOptimizer)
        named = {p: i for i, p in enumerate(self._params)}
        pieces = []
        for reg in self.regions:
            for p, plo, phi, blo, _ in reg.pieces:
                if not counts_in_grad_norm(p, tp_group, etp_group):
                    continue
                key = (p.dtype != torch.float32, len(pieces)) if self.distributed else (named[p],)
                pieces.append((key, reg.buffer.grad_data[blo:blo + (phi - plo)], getattr(p, "allreduce", True)))
        pieces.sort(key=lambda t: t[0])
        self._norm_dense = [v for _, v, dense in pieces if dense]
        self._norm_expert = [v for _, v, dense in pieces if not dense]
        if self.distributed:  # megatron: both sub-optimizers reduce over the distributed-optimizer instance
            g = ps.get_intra_distributed_optimizer_instance_group()
            self._norm_groups = [(self._norm_dense + self._norm_expert, g)]
        else:
            self._norm_groups = [(self._norm_dense, ps.get_model_parallel_group())]
            if len(self.param_groups) > 1:
                self._norm_groups.append((self._norm_expert,
                                          ps.get_expert_tensor_model_pipeline_parallel_group(with_egtp_remat=True)))

    def _group_segments(self):
        """[lo, hi, group] host ranges covering [0, numel): each parameter piece with its group, padding
        joined to the following (or, at a region's end, the preceding) piece; equal neighbours merged."""
        segs = []
        for reg in self.regions:
            pos, end = reg.host, reg.host + reg.hi - reg.lo
            for p, plo, phi, blo, gi in reg.pieces:
                hi = reg.host + (blo - reg.lo) + (phi - plo)
                if segs and segs[-1][2] == gi and segs[-1][1] == pos:
                    segs[-1][1] = hi
                else:
                    segs.append([pos, hi, gi])
                pos = hi
            if pos < end:
                if segs and segs[-1][1] == pos:
                    segs[-1][1] = end
                else:
                    segs.append([pos, end, 0])
        return [tuple(x) for x in segs]

    # ---------------------------------------------------------------------------------------------------
    def _transfers(self, h0: int, h1: int):
        """(region, buf_lo, buf_hi, chunk_off) of the host range [h0, h1)."""
        out = []
        for reg in self.regions:
            a, z = max(h0, reg.host), min(h1, reg.host + reg.hi - reg.lo)
            if z > a:
                out.append((reg, reg.lo + a - reg.host, reg.lo + z - reg.host, a - h0))
        return out

    def _plan(self):
        """Build the chunk plans (layout only: which grad slices, where each region's weights sit in the output
        slot); the views are bound by ``_bind``."""
        chunks = []
        for h0 in range(0, self.numel, self.chunk_elems):
            c = _Chunk(h0, min(self.numel, h0 + self.chunk_elems))
            b = 0
            for reg, blo, bhi, off in self._transfers(c.h0, c.h1):
                isz = torch.empty((), dtype=reg.param_dtype).element_size()
                b = -(-b // isz) * isz
                c.layout.append((reg, blo, bhi, off, b))
                b += isz * (bhi - blo)
            c.nbytes = b
            chunks.append(c)
        return chunks

    def _bind(self):
        """Bind every chunk plan to the current tensors (grad buffers, parameters, pinned and staging slots);
        redone when any of them moved (``_bound_key``)."""
        stage = self.cuda and not self.distributed
        for c in self.chunks_plan:
            c.grads, c.outs, c.h2d, c.scatter, c.pieces = [], [], [], [], []
            for reg, blo, bhi, off, _ in c.layout:
                c.grads.append((off, reg.buffer.grad_data[blo:bhi]))
            for s in range(len(self._pbufs)):
                raw = self._pbufs[s]
                outs, h2d, groups = [], [], {}
                src_raw = self._stage[s] if stage else raw
                if stage and c.nbytes:
                    h2d.append((self._stage[s][:c.nbytes], raw[:c.nbytes]))
                for reg, blo, bhi, off, b in c.layout:
                    isz = torch.empty((), dtype=reg.param_dtype).element_size()
                    view = raw[b:b + isz * (bhi - blo)].view(reg.param_dtype)
                    outs.append((off, view))
                    if self.distributed:
                        h2d.append((reg.buffer.param_data[blo:bhi], view))
                        continue
                    src = src_raw[b:b + isz * (bhi - blo)].view(reg.param_dtype)
                    dsts, srcs = groups.setdefault(reg.param_dtype, ([], []))
                    for p, a, z, plo, pb in self._pieces_in(reg, blo, bhi):
                        dsts.append(p.data.view(-1)[plo + a - pb:plo + z - pb])
                        srcs.append(src[a - blo:z - blo])
                c.outs.append(outs)
                c.pieces.append(self.host.pieces(c.h0, c.h1, outs) if self.host.kernel is not None else None)
                c.h2d.append(h2d)
                c.scatter.append([(d, s) for d, s in groups.values() if d])
        self._bound = self._bound_key()

    def _bound_key(self):
        """Addresses of every tensor the plans hold views of: a moved parameter or buffer rebinds them."""
        return (tuple(p.data_ptr() for p in self._params),
                tuple(r.buffer.grad_data.data_ptr() for r in self.regions),
                tuple(r.buffer.param_data.data_ptr() if r.buffer.param_data is not None else 0 for r in self.regions))

    def _write_chunk(self, c: _Chunk, slot: int):
        """Carry chunk ``c``'s updated weights (output slot ``slot``) into the parameters, on the current
        stream: the host->device copies, then the scatter on the device."""
        nb = self.cuda
        for dst, src in c.h2d[slot]:
            dst.copy_(src, non_blocking=nb)
        for dsts, srcs in c.scatter[slot]:
            torch._foreach_copy_(dsts, srcs)

    @staticmethod
    def _pieces_in(reg, blo: int, bhi: int):
        """The pieces of ``reg`` overlapping buffer range [blo, bhi), as (param, a, z, plo, pb) with [a, z) the
        overlap. The pieces are sorted by buffer offset and do not overlap, so a bisection finds the first one."""
        import bisect

        i = max(0, bisect.bisect_right(reg.starts, blo) - 1)
        for p, plo, phi, pb, _ in reg.pieces[i:]:
            if pb >= bhi:
                break
            a, z = max(blo, pb), min(bhi, pb + phi - plo)
            if z > a:
                yield p, a, z, plo, pb

    def _read_params(self, dst: torch.Tensor, h0: int, h1: int):
        for reg, blo, bhi, off in self._transfers(h0, h1):
            dst[off:off + bhi - blo].zero_()
            for p, a, z, plo, pb in self._pieces_in(reg, blo, bhi):
                dst[off + a - blo:off + z - blo].copy_(p.data.view(-1)[plo + a - pb:plo + z - pb])

    @torch.no_grad()
    def _load_master_from_params(self):
        buf = self._gbufs[0] if self.grad_dtype == torch.float32 else torch.empty(self._gbufs[0].numel())
        for h0 in range(0, self.numel, self.chunk_elems):
            h1 = min(self.numel, h0 + self.chunk_elems)
            self._read_params(buf, h0, h1)
            self.master[h0:h1].copy_(buf[:h1 - h0])

    def _sync_params(self):
        if self.distributed:
            for d in self.chunks:
                d.start_param_sync()

    # ---------------------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True):
        for p in self._params:
            p.grad = None

    def get_grad_norm(self):
        """Global L2 norm as megatron computes it: per-tensor norms, their norm, squared, summed over the
        group, its square root in fp32 on the device (a one-element tensor); several groups (non-distributed
        dense + expert) combine as sqrt(sum(norm_i^2)) (a float)."""
        norms = []
        for grads, group in self._norm_groups:
            if grads:
                sq = torch.stack([n.float() for n in torch._foreach_norm(grads)]).norm().pow(2.0).reshape(1)
            else:
                dev = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
                sq = torch.zeros(1, dtype=torch.float32, device=dev)
            all_reduce(sq, group=group)
            norms.append(sq.pow(0.5))  # fp32 on the device, as megatron's get_grad_norm_fp32 (patches/lean_grad_clip.py)
        if len(norms) == 1:
            return norms[0]
        return math.sqrt(sum(x ** 2 for x in norms))

    @torch.no_grad()
    def step(self):
        """One AdamW step over all parameters; returns (True, grad_norm, None) like megatron's optimizer."""
        t0 = time.perf_counter()
        grad_norm = self.get_grad_norm()
        clip = 1.0
        if self.clip_grad > 0:
            c = self.clip_grad / (grad_norm + 1.0e-6)
            if torch.is_tensor(c):  # megatron's coefficient for a device-tensor norm: fp32, clamped to 1
                clip = float(c.clamp_max(1.0))
            elif c < 1.0:
                clip = c
        grad_norm = float(grad_norm)
        if not math.isfinite(grad_norm):
            return False, grad_norm, None
        self.step_count += 1
        hyper = [(float(g["lr"]), float(g["weight_decay"])) for g in self.param_groups]
        t1 = time.perf_counter()
        parts = self._stream(clip, hyper)
        t2 = time.perf_counter()
        self._sync_params()
        self.timings = {"norm_s": t1 - t0, "stream_s": t2 - t1, "param_sync_s": time.perf_counter() - t2,
                        "stream_parts_s": parts, "chunks": len(self.chunks_plan)}
        return True, grad_norm, None

    def _stream(self, clip: float, hyper) -> dict:
        """Walk the chunk plans; returns the host time spent per kind (waiting for a gradient chunk or a free
        output slot, the update itself, issuing copies)."""
        if self._bound != self._bound_key():
            self._bind()
        plan, nbuf, clock = self.chunks_plan, len(self._gbufs), time.perf_counter
        t = dict.fromkeys(("wait_d2h_s", "wait_h2d_s", "update_s", "issue_s"), 0.0)
        if not self.cuda:
            g = self._gbufs[0]
            for c in plan:
                t0 = clock()
                for off, src in c.grads:
                    g[off:off + src.numel()].copy_(src)
                t1 = clock()
                self.host.update(g[:c.h1 - c.h0], c.h0, c.h1, self.step_count, clip, hyper, c.outs[0], c.pieces[0])
                t2 = clock()
                self._write_chunk(c, 0)
                t["issue_s"] += (t1 - t0) + clock() - t2
                t["update_s"] += t2 - t1
            return t
        cur = torch.cuda.current_stream()
        self._d2h.wait_stream(cur)   # gradients are final on the compute stream
        self._h2d.wait_stream(cur)   # the parameters are not in use any more
        d2h_ev, h2d_ev = [None] * nbuf, [None] * nbuf

        def fetch(i):
            g = self._gbufs[i % nbuf]
            with torch.cuda.stream(self._d2h):
                for off, src in plan[i].grads:
                    g[off:off + src.numel()].copy_(src, non_blocking=True)
                d2h_ev[i % nbuf] = self._d2h.record_event()

        t0 = clock()
        for i in range(min(nbuf - 1, len(plan))):
            fetch(i)
        t["issue_s"] += clock() - t0
        for i, c in enumerate(plan):
            t0 = clock()
            if i + nbuf - 1 < len(plan):
                fetch(i + nbuf - 1)   # its slot's previous chunk (i - 1) is already updated on the CPU
            s = i % nbuf
            t1 = clock()
            d2h_ev[s].synchronize()
            t2 = clock()
            if h2d_ev[s] is not None:
                h2d_ev[s].synchronize()   # the pinned output slot is free again
            t3 = clock()
            self.host.update(self._gbufs[s][:c.h1 - c.h0], c.h0, c.h1, self.step_count, clip, hyper, c.outs[s],
                             c.pieces[s])
            t4 = clock()
            with torch.cuda.stream(self._h2d):
                self._write_chunk(c, s)
                h2d_ev[s] = self._h2d.record_event()
            t5 = clock()
            t["issue_s"] += (t1 - t0) + (t5 - t4)
            t["wait_d2h_s"] += t2 - t1
            t["wait_h2d_s"] += t3 - t2
            t["update_s"] += t4 - t3
        cur.wait_stream(self._h2d)
        return t

    # ---------------------------------------------------------------------------------------------------
    def _names(self):
        out = {}
        for ci, d in enumerate(self.chunks):
            for name, p in d.module.named_parameters():
                out[p] = name if len(self.chunks) == 1 else f"{ci}.{name}"
        return out

    def _gather_host(self, t: torch.Tensor) -> dict:
        """Param-shaped fp32 copies of host state ``t`` for every parameter (all-gathered when sharded)."""
        names = self._names()
        out = {}
        dev = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        for reg in self.regions:
            src = t[reg.host:reg.host + reg.hi - reg.lo].float()
            if self.distributed:
                grp = reg.buffer.data_parallel_group
                full = torch.empty(src.numel() * grp.size(), dtype=torch.float32, device=dev)
                all_gather_into_tensor(full, src.to(dev), group=grp)
                full = full.cpu()
                base = reg.bucket_offset
                for p, (s, e, b) in reg.buffer.param_index_map.items():
                    if b == reg.bucket_id:
                        out[names[p]] = full[s - base:e - base].clone().view(p.shape)
            else:
                for p, plo, phi, blo, _ in reg.pieces:
                    out[names[p]] = src[blo - reg.lo:blo - reg.lo + phi - plo].clone().view(p.shape)
        return out

    def param_states(self) -> dict:
        """{"step": int, "params": {name: {"master", "exp_avg", "exp_avg_sq"}}} (param-shaped fp32, CPU)."""
        parts = {k: self._gather_host(t) for k, t in (("master", self.master), ("exp_avg", self.exp_avg),
                                                       ("exp_avg_sq", self.exp_avg_sq))}
        return {"step": self.step_count,
                "params": {n: {k: parts[k][n] for k in parts} for n in parts["master"]}}

    @torch.no_grad()
    def load_param_states(self, states: dict):
        """Inverse of ``param_states`` (full param-shaped tensors on every rank); rewrites the weights."""
        names = self._names()
        params = states["params"]
        for reg in self.regions:
            for p, plo, phi, blo, _ in reg.pieces:
                st = params[names[p]]
                h = reg.host + blo - reg.lo
                for key, dst in (("master", self.master), ("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                    dst[h:h + phi - plo].copy_(st[key].reshape(-1)[plo:phi])
        self.step_count = int(states["step"])
        if self._bound != self._bound_key():
            self._bind()
        for c in self.chunks_plan:
            for off, view in c.outs[0]:
                view.copy_(self.master[c.h0 + off:c.h0 + off + view.numel()])
            self._write_chunk(c, 0)
            if self.cuda:
                torch.cuda.synchronize()
        self._sync_params()

    # megatron-optimizer surface used elsewhere
    def get_loss_scale(self):
        return torch.ones(1)

    def reload_model_params(self, state_dict=None):
        self._load_master_from_params()


def build_host_stream_optimizer(ddp_chunks, *, lr: float, weight_decay: float = 0.1, clip_grad: float = 1.0,
                                use_distributed_optimizer: bool = False, bf16: bool = False,
                                adam_eps: float = 1e-8, beta1: float = 0.9, beta2: float = 0.95,
                                moments_dtype=torch.bfloat16, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                                **kwargs) -> HostStreamAdamW:
    """The host-streamed AdamW for megatron-DDP-wrapped model chunks (``runtime.wrap_ddp``), with the
    arguments of ``runtime.build_optimizer``. ``bf16`` is accepted for symmetry: the master is fp32 and the
    parameters keep their own dtype either way. Extra keywords: ``cpu_block_elems``, ``num_buffers``,
    ``impl`` ("auto" | "onepass" | "fused" | "torch"), ``build_dir`` (where the one-pass kernel is built)."""
    del bf16
    return HostStreamAdamW(ddp_chunks, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                           use_distributed_optimizer=use_distributed_optimizer, adam_eps=adam_eps, beta1=beta1,
                           beta2=beta2, moments_dtype=moments_dtype, chunk_bytes=chunk_bytes, **kwargs)
