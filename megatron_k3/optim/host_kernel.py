"""Build, load and check the one-pass host AdamW kernel (``host_adamw.c``; the stream's impl "onepass").

The C source is compiled once per (source, compiler, CPU flags) with the system C compiler (``cc``, OpenMP)
into ``build_dir`` (the trainer passes its kernel cache, ``--kernel-cache-dir``, so a cluster shares it;
``-march=native`` is why the CPU flags are in the file name) and loaded with ctypes (calls release the GIL).
Before it is used, ``load`` checks it bit for bit against ``torch._fused_adamw_`` (fp32 and bf16 moments,
weight decay, clipping, step > 1) and the bf16 output cast against torch's: a machine whose torch build
rounds differently gets a clear reason and the stream keeps torch's kernel.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_adamw.c")
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
OUT_KIND = {torch.float32: 0, torch.bfloat16: 1}
NO_OUTPUT = 2
_loaded: dict = {}


class KernelUnavailable(RuntimeError):
    """The one-pass kernel cannot be built here, or its bits differ from torch's fused AdamW."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def default_build_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "megatron_k3", "host_kernels")


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable("no C compiler (cc/gcc) on PATH to build the one-pass host AdamW")
    return cc


def build(build_dir: str | None = None) -> str:
    """Compile ``host_adamw.c`` unless an identical build exists; returns the shared object's path.
    Atomic: built into a temporary file and renamed, so ranks building at once do not collide."""
    build_dir = build_dir or default_build_dir()
    cc = _compiler()
    src = open(SOURCE, "rb").read()
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"C compiler {cc!r} does not run: {e}") from e
    key = hashlib.sha256(src + ver.encode() + " ".join(CFLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    path = os.path.join(build_dir, f"host_adamw-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(build_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=build_dir)
    os.close(fd)
    try:
        r = subprocess.run([cc, *CFLAGS, SOURCE, "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise KernelUnavailable(f"building {SOURCE} failed ({cc} exit {r.returncode}): {r.stderr[-1500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class OnePassAdamW:
    """The loaded kernel: ``chunk(...)`` runs one chunk's update over its pieces (an int64 [n, 5] tensor from
    ``pieces``)."""

    def __init__(self, path: str, num_threads: int | None = None):
        self.path = path
        self.lib = ctypes.CDLL(path)
        f = self.lib.k3_adamw_chunk
        P, I64, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
        f.argtypes = [P, I64, I64, I64, P, P, P, P, ctypes.c_int, P, D, D, D, D, D, ctypes.c_int]
        f.restype = ctypes.c_int
        self._f = f
        self.num_threads = int(num_threads or torch.get_num_threads())

    @staticmethod
    def pieces(rows, h0: int | None = None, h1: int | None = None) -> torch.Tensor:
        """rows: (a, z, group, out_kind, out_ptr) host ranges of one chunk [h0, h1), in order (checked here,
        once, when h0 and h1 are given: the kernel trusts them every step)."""
        if h0 is not None and not all(h0 <= r[0] <= r[1] <= h1 and r[3] in (0, 1, NO_OUTPUT) for r in rows):
            raise ValueError(f"pieces outside the chunk [{h0}, {h1}) or of an unknown output kind: {rows}")
        return torch.tensor([list(map(int, r)) for r in rows], dtype=torch.int64).reshape(-1, 5)

    def chunk(self, pieces: torch.Tensor, h0: int, h1: int, g: torch.Tensor, master: torch.Tensor,
              exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, hyper: torch.Tensor, step: int, beta1: float,
              beta2: float, eps: float, clip: float):
        """hyper: float64 [groups, 2] (lr, wd). g: the chunk's fp32 gradient (g[0] is element h0)."""
        assert g.dtype == torch.float32 and master.dtype == torch.float32 and exp_avg.dtype == exp_avg_sq.dtype
        # the C side trusts these bounds: check them here (raw pointers below)
        assert 0 <= h0 <= h1 <= master.numel() == exp_avg.numel() == exp_avg_sq.numel() and g.numel() >= h1 - h0
        assert all(t.is_contiguous() and t.device.type == "cpu" for t in (g, master, exp_avg, exp_avg_sq, pieces))
        assert pieces.dtype == torch.int64 and pieces.dim() == 2 and pieces.shape[1] == 5  # rows: see ``pieces``
        rc = self._f(pieces.data_ptr(), pieces.shape[0], h0, h1, g.data_ptr(), master.data_ptr(),
                     exp_avg.data_ptr(), exp_avg_sq.data_ptr(), int(exp_avg.dtype == torch.bfloat16),
                     hyper.data_ptr(), float(step), beta1, beta2, eps, float(clip), self.num_threads)
        if rc != 0:
            raise RuntimeError(f"k3_adamw_chunk returned {rc}")


def self_check(k: OnePassAdamW, n: int = 1 << 12) -> None:
    """Bits against torch._fused_adamw_ on its vector path (a tail-free length per thread) and the bf16 cast
    against torch's; raises KernelUnavailable on any difference."""
    gen = torch.Generator().manual_seed(1234)
    n = -(-n // (16 * torch.get_num_threads())) * 16 * torch.get_num_threads()
    lr, b1, b2, eps = 3e-3, 0.9, 0.95, 1e-8
    for moments, wd, clip, step in ((torch.float32, 0.1, 1.0, 1), (torch.bfloat16, 0.1, 0.37, 7),
                                    (torch.bfloat16, 0.0, 1.0, 3)):
        p = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen) * 1e-2
        m = (torch.randn(n, generator=gen) * 1e-2).to(moments)
        v = (torch.rand(n, generator=gen) * 1e-4).to(moments)
        kp, km, kv = p.clone(), m.clone(), v.clone()
        # torch's path (the stream's "fused" impl): clip in place, fp32 working moments, the fused kernel
        rp, rg, rm, rv = p.clone(), g.clone(), m.float().clone(), v.float().clone()
        if clip != 1.0:
            rg.mul_(clip)
        torch._fused_adamw_([rp], [rg], [rm], [rv], [], [torch.tensor(float(step))], lr=lr, beta1=b1, beta2=b2,
                            weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
        out = torch.empty(n, dtype=torch.bfloat16)
        pcs = k.pieces([(0, n // 3, 0, NO_OUTPUT, 0), (n // 3, n, 1, OUT_KIND[torch.bfloat16],
                                                          out.data_ptr() + 2 * (n // 3))])
        hyper = torch.tensor([[lr, wd], [lr, wd]], dtype=torch.float64)
        k.chunk(pcs, 0, n, g.clone(), kp, km, kv, hyper, step, b1, b2, eps, clip)
        bad = {name: int((a != b).sum()) for name, a, b in (("master", kp, rp), ("exp_avg", km, rm.to(moments)),
                                                            ("exp_avg_sq", kv, rv.to(moments)),
                                                            ("output", out[n // 3:], rp[n // 3:].to(torch.bfloat16)))}
        if any(bad.values()):
            raise KernelUnavailable(f"one-pass host AdamW differs from torch._fused_adamw_ on this machine "
                                    f"(moments {moments}, wd {wd}, clip {clip}, step {step}): elements differing {bad}")


def load(build_dir: str | None = None, num_threads: int | None = None) -> OnePassAdamW:
    """Build (once), load and check the kernel; raises KernelUnavailable with the reason."""
    key = (build_dir, num_threads)
    if key not in _loaded:
        k = OnePassAdamW(build(build_dir), num_threads)
        self_check(k)
        _loaded[key] = k
    return _loaded[key]
