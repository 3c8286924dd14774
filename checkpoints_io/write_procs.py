"""Writer processes for the asynchronous checkpoint save: the file writes leave the trainer's process.

Why: a background save written by threads of the trainer's own process shares the GIL with the training
loop. DCP writes every tensor through ``torch.save`` (a small zip archive per tensor: pickling, headers,
Python-level stream calls); k3-mini's checkpoint is ~13,500 tensors, so eight writer threads spend much of
their time queueing for the GIL with each other and with the loop, which launches kernels from Python.
Measured on one H200 (2026-12-05, ``benchmarks/results/bench_checkpoint_k3mini_h200_threads_2026-12-05.json``):
the files of a 17.6 GB save took 14.5 s (1.2 GB/s, 61% of the disk) and training steps ran 1.3-8x slower
while they were written. Megatron-LM's async save forks writer processes for the same reason.

How:
- ``SharedBuffer``: the host staging buffer is a ``memfd`` (anonymous shared memory, not limited by the size
  of ``/dev/shm``) mapped into the trainer and into each writer process; on CUDA it is page-locked with
  ``cudaHostRegister`` so the device-to-host staging copies run at full speed. It only grows (``ftruncate``),
  so the writers, which inherit the file descriptor at start, see every size.
- ``WriterPool``: N long-lived worker processes (``python -c``, started from the trainer's main thread, so
  that ``PR_SET_PDEATHSIG`` kills them with the trainer: a ``kill -9`` of the trainer stops its writers; the
  checkpoint they were writing stays an ``iter_*.tmp`` that ``latest`` does not name). They ignore SIGINT and
  SIGTERM: the trainer decides when a save ends (it waits for the write on SIGTERM).
- ``pooled(writer, pool, shared)``: a DCP ``FileSystemWriter`` whose ``_write_data`` (the step after the
  plan: one bucket of items per file) resolves every item in the trainer (all tensors must lie in the shared
  buffer; else the caller's threads are used), sends each worker one file's items as (offset, dtype, shape)
  into the buffer, and collects DCP's ``WriteResult`` s and each file's size and CRC32. The worker writes the
  file with DCP's own ``_write_item`` through the same O_DIRECT, checksumming stream as the threads: the files
  are byte for byte those the threads would write (``tests/checkpoint/test_write_procs.py``). The files start
  as soon as this rank's local plan exists, while DCP still gathers and scatters the plans (``pooled``: early
  start; on one H200, 2026-12-06, k3-mini's first save spent ~4 s planning before its first file).
"""
from __future__ import annotations

import io
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import torch
from torch.futures import Future  # what DCP's storage writer returns (it calls .wait())

_HDR = 8


def _send(sock: socket.socket, obj) -> None:
    b = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(len(b).to_bytes(_HDR, "little") + b)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError
        got += k
    return bytes(buf)


def _recv(sock: socket.socket):
    return pickle.loads(_recv_exact(sock, int.from_bytes(_recv_exact(sock, _HDR), "little")))


# ------------------------------------------------------------------------------------------------------
class SharedBuffer:
    """A growable host buffer in a memfd; ``tensor`` is a uint8 view of all of it (page-locked on CUDA)."""

    def __init__(self, nbytes: int = 0, pin: bool = False):
        self.fd = os.memfd_create("k3-checkpoint-staging", os.MFD_CLOEXEC)
        self.pin = pin and torch.cuda.is_available()
        self.size, self.mm, self.tensor, self._registered = 0, None, None, None
        self.ensure(nbytes)

    def ensure(self, nbytes: int) -> None:
        """At least ``nbytes`` (a new mapping when it grows: tensors of the old one stay valid until dropped)."""
        if nbytes <= self.size and self.tensor is not None:
            return
        nbytes = max(nbytes, mmap.PAGESIZE)
        self._unpin()
        os.ftruncate(self.fd, nbytes)
        self.size = nbytes
        self.mm = mmap.mmap(self.fd, nbytes)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        if self.pin:
            # touch every page first (cudaHostRegister of an unpopulated shared mapping page-locks it anyway,
            # but populating here keeps that cost in the background reserve, not in the first save)
            self.tensor.zero_()
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            if int(err) == 0:
                self._registered = self.tensor.data_ptr()

    def _unpin(self):
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None

    @property
    def pinned(self) -> bool:
        return self._registered is not None

    def offset_of(self, t: torch.Tensor):
        """Byte offset of contiguous CPU tensor ``t`` inside the buffer, or None if it is not in it."""
        if self.tensor is None or t.device.type != "cpu" or not t.is_contiguous():
            return None
        off = t.data_ptr() - self.tensor.data_ptr()
        n = t.numel() * t.element_size()
        return off if (n == 0 or 0 <= off <= self.size - n) else None

    def close(self):
        self._unpin()
        self.tensor = None
        try:
            os.close(self.fd)
        except OSError:
            pass


# ------------------------------------------------------------------------------------------------------
class WriterProcessError(OSError):
    """A writer process exited or failed without an OSError of its own."""


class WriterPool:
    """``n`` writer processes sharing ``shared``'s memfd. ``start()`` from the main thread; ``run()`` from any."""

    def __init__(self, n: int, shared: SharedBuffer):
        self.n, self.shared = max(1, n), shared
        self.procs: list[tuple[subprocess.Popen, socket.socket]] = []
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return len(self.procs) == self.n and all(p.poll() is None for p, _ in self.procs)

    def start(self) -> None:
        if self.alive():
            return
        self.close()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        for _ in range(self.n):
            parent, child = socket.socketpair()
            p = subprocess.Popen(
                [sys.executable, "-c", "from checkpoints_io.write_procs import _worker_main; _worker_main()",
                 str(child.fileno()), str(self.shared.fd), str(os.getpid())],
                pass_fds=(child.fileno(), self.shared.fd), env=env, stdin=subprocess.DEVNULL)
            child.close()
            self.procs.append((p, parent))

    def run(self, jobs: list[dict]) -> list:
        """Write ``jobs`` (one file each) on the workers; returns their results in order; raises the first error."""
        with self.lock:
            if not self.alive():
                raise WriterProcessError("checkpoint writer processes are not running (one exited)")
            out = [None] * len(jobs)
            for first in range(0, len(jobs), self.n):
                batch = list(enumerate(jobs[first:first + self.n], start=first))
                for k, (i, job) in enumerate(batch):
                    _send(self.procs[k][1], dict(job, shm_size=self.shared.size))
                errors = []
                for k, (i, _) in enumerate(batch):
                    p, sock = self.procs[k]
                    try:
                        status, val = _recv(sock)
                    except (EOFError, OSError):
                        rc = p.wait()
                        errors.append(WriterProcessError(f"checkpoint writer process {p.pid} exited (code {rc})"))
                        continue
                    if status == "ok":
                        out[i] = val
                    else:  # the worker's OSError as it was (errno, message, file), else its text
                        errno_, strerror, filename, text = val
                        errors.append(OSError(errno_, strerror, filename) if errno_ else WriterProcessError(text))
                if errors:
                    raise errors[0]
            return out

    def close(self) -> None:
        for p, sock in self.procs:
            try:
                sock.close()  # EOF: the worker exits
            except OSError:
                pass
        for p, _ in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


_ITEM_ARGS = ("transforms", "stream", "data", "write_item", "storage_key", "serialization_format")


def _item_args() -> list[str] | None:
    """The parameters of this torch's ``filesystem._write_item`` we can supply, or None if it has others."""
    import inspect

    from torch.distributed.checkpoint import filesystem as F

    fn = getattr(F, "_write_item", None)
    if fn is None:
        return None
    names = list(inspect.signature(fn).parameters)
    return names if set(names) <= set(_ITEM_ARGS) else None


def _strip_index(wi):
    """A WriteItem without its chunk position (``index.index``: the coordinator's global plan renumbers it)."""
    import dataclasses

    return dataclasses.replace(wi, index=dataclasses.replace(wi.index, index=None))


def pooled(writer, pool: WriterPool, kind: str, limit_bytes_per_s: float = 0.0, planner=None, rank: int = 0):
    """Make DCP ``writer`` (a checksumming FileSystemWriter) write its files on ``pool``'s processes when every
    tensor it is given lies in ``pool.shared``; otherwise (or on a torch whose DCP writer has another shape) it
    writes with its own threads as before.

    Early start (``planner`` given): the files' contents depend only on this rank's *local* plan (the items and
    their bytes) and their names on this rank's position in the save's process group (DCP's FileSystemWriter
    names them ``__<rank>_<i>.distcp``). So as soon as the local plan exists (``prepare_local_plan``, before
    DCP gathers every rank's plan, builds the global plan and scatters it back: seconds for k3-mini's ~13,500
    tensors, most of it pickling the plans), the writer processes start on those files. When DCP then calls
    ``write_data`` with the final plan, its files are compared with the ones started: the same paths and the same
    items (the coordinator only renumbers each item's chunk position, which is not in the file) -> their results
    are DCP's results, with the final plan's item indices; anything else -> the early files that the final plan
    does not name are removed and the final plan is written as usual (``writer.early_write`` says which)."""
    import queue
    import threading

    from torch.distributed.checkpoint import filesystem as F
    from torch.distributed.checkpoint.planner import WriteItemType

    base_write = getattr(writer, "_write_data", None)
    if base_write is None or _item_args() is None:
        return writer

    def _jobs(files, planner):
        """One job per file, or None when an item is not staged in the shared buffer."""
        jobs = []
        for path, storage_key, items in files:
            bytes_items, tensor_items = [], []
            for wi in items:  # the order of DCP's own loop: byte items first, then tensors
                data = planner.resolve_data(wi)
                if wi.type == WriteItemType.BYTE_IO:
                    bytes_items.append((wi, "bytes", bytes(data.getbuffer()), None, None))
                    continue
                t = data.detach()
                off = pool.shared.offset_of(t)
                if off is None:
                    return None
                tensor_items.append((wi, "shm", off, t.dtype, tuple(t.shape)))
            jobs.append({"path": str(path), "storage_key": storage_key, "items": bytes_items + tensor_items,
                         "kind": kind, "limit": limit_bytes_per_s, "fsync": bool(getattr(writer, "sync_files", True))})
        return jobs

    def _collect(results, final_index=None):
        import dataclasses

        res = []
        for wrs, digests, span in results:
            if final_index is not None:
                wrs = [dataclasses.replace(r, index=final_index[(r.index.fqn, r.index.offset)]) for r in wrs]
            res += wrs
            writer.fs.digests.update(digests)
            if span:
                s = writer.fs.span
                writer.fs.span = (min(s[0], span[0]), max(s[1], span[1])) if s else tuple(span)
        fut: Future = Future()
        fut.set_result(res)
        return fut

    early: dict = {}
    writer.early_write = False

    if planner is not None and getattr(writer, "single_file_per_rank", True) \
            and hasattr(F, "_split_by_size_and_type") and hasattr(F, "DEFAULT_SUFFIX"):
        base_prepare = writer.prepare_local_plan

        def prepare_local_plan(plan):
            plan = base_prepare(plan)
            try:
                buckets = F._split_by_size_and_type(writer.thread_count, plan.items)
                names = [f"__{rank}_{i}{F.DEFAULT_SUFFIX}" for i in range(len(buckets))]
                files = [(writer.fs.concat_path(writer.path, n), n, b) for n, b in zip(names, buckets)]
                jobs = _jobs(files, planner)
            except Exception:  # noqa: BLE001  (an optimisation only: write_data writes the final plan as usual)
                return plan
            if jobs:
                def run():
                    try:
                        early["result"] = pool.run(jobs)
                    except BaseException as e:  # noqa: BLE001  (raised by write_data)
                        early["error"] = e

                early["files"] = files
                early["thread"] = threading.Thread(target=run, name="k3-checkpoint-early-write", daemon=True)
                early["thread"].start()
            return plan

        writer.prepare_local_plan = prepare_local_plan

    def _write_data(planner, file_queue):
        files = []
        while True:
            try:
                files.append(file_queue.get_nowait())
            except queue.Empty:
                break
        if "thread" in early:
            early["thread"].join()
            same = [str(p) for p, _, _ in files] == [str(p) for p, _, _ in early["files"]] and all(
                [_strip_index(w) for w in a] == [_strip_index(w) for w in b]
                for (_, _, a), (_, _, b) in zip(files, early["files"]))
            if same:
                if "error" in early:
                    raise early["error"]
                writer.early_write = True
                return _collect(early["result"], {(w.index.fqn, w.index.offset): w.index
                                                  for _, _, items in files for w in items})
            final = {str(p) for p, _, _ in files}  # another plan: drop the early files it does not name
            for p, _, _ in early["files"]:
                if str(p) not in final:
                    writer.fs.digests.pop(os.path.basename(str(p)), None)
                    try:
                        os.remove(p)
                    except FileNotFoundError:
                        pass
            writer.fs.span = None
        jobs = _jobs(files, planner)
        if jobs is None:  # not staged in the shared buffer: the writer's own threads
            q: queue.Queue = queue.Queue()
            for f in files:
                q.put(f)
            return base_write(planner, q)
        return _collect(pool.run(jobs))

    writer._write_data = _write_data  # DCP's FileSystemWriter.write_data calls self._write_data(planner, queue)
    return writer


# ------------------------------------------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when the thread that started it exits (the trainer's main thread)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _write_file(job: dict, mm) -> tuple:
    from torch.distributed.checkpoint import filesystem as F

    from checkpoints_io.odirect import checksumming_writer

    writer = checksumming_writer(os.path.dirname(job["path"]), job["kind"], 1, job["limit"])
    ctx = {"transforms": getattr(writer, "transforms", None), "serialization_format":  # DCP's defaults, as the
           getattr(writer, "serialization_format", None), "storage_key": job["storage_key"]}  # trainer's writer
    names = _item_args()
    results = []
    with writer.fs.create_stream(job["path"], "wb") as stream:
        for wi, how, a, dtype, shape in job["items"]:
            if how == "bytes":
                data = io.BytesIO(a)
            else:
                numel = 1
                for s in shape:
                    numel *= s
                data = (torch.frombuffer(mm, dtype=dtype, count=numel, offset=a).view(shape) if numel
                        else torch.empty(shape, dtype=dtype))
            ctx.update(stream=stream, data=data, write_item=wi)
            results.append(F._write_item(*(ctx[n] for n in names)))
        if job["fsync"]:
            stream.flush()
            os.fsync(stream.fileno())
    return results, writer.fs.digests, writer.fs.span


def _worker_main() -> None:
    sock_fd, shm_fd, parent_pid = (int(x) for x in sys.argv[1:4])
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the trainer decides when a save ends
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    torch.set_num_threads(1)
    # import what a job needs now, while the trainer sets up, not inside its first save (DCP's modules: seconds)
    from torch.distributed.checkpoint import filesystem  # noqa: F401

    from checkpoints_io.odirect import checksumming_writer  # noqa: F401
    sock = socket.socket(fileno=sock_fd)
    mm, mm_size = None, 0
    while True:
        try:
            job = _recv(sock)
        except (EOFError, OSError):
            return
        try:
            if job["shm_size"] != mm_size:
                mm, mm_size = mmap.mmap(shm_fd, job["shm_size"]), job["shm_size"]
            _send(sock, ("ok", _write_file(job, mm)))
        except Exception as e:  # noqa: BLE001  (reported to the trainer, which raises it)
            osx = e if isinstance(e, OSError) else None
            _send(sock, ("error", (getattr(osx, "errno", None), getattr(osx, "strerror", None),
                                   getattr(osx, "filename", None), f"{type(e).__name__}: {e}")))
