"""An O_DIRECT storage writer for PyTorch distributed checkpointing (DCP): a drop-in ``FileSystemWriter``.

The stock writer does all file I/O through ``self.fs.create_stream(path, "wb")``, takes shard offsets from
``stream.tell()`` and fsyncs before closing. This writer keeps all of that (same files, same metadata, read
back by the stock ``FileSystemReader``) and swaps the stream: ``ODirectStream`` copies whatever DCP writes
into a page-aligned staging buffer (anonymous ``mmap``, so 4 KiB aligned) and, each time the buffer is
full, hands it to ``os.write`` on a file opened with ``O_DIRECT``: the bytes go to the device without
passing through the page cache. On close the tail is padded with zeros to the alignment, written, the file
is truncated back to its logical length, fsynced and closed.

File systems that refuse O_DIRECT (``EINVAL`` at open or first write: tmpfs on some kernels, overlay, many
network file systems) fall back to an ordinary buffered file with one warning; the checkpoint is the same.
Memory: one staging buffer per open stream (``buffer_bytes``, 64 MiB by default), independent of the
checkpoint size.
"""
from __future__ import annotations

import ctypes
import io
import mmap
import os
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

ALIGN = 4096
_warned: set = set()


def _memmove(dst: int, src: memoryview, n: int) -> None:
    """Copy ``n`` bytes of ``src`` to address ``dst`` without holding the GIL (ctypes releases it), so several
    writer threads copy in parallel and the training thread is not held up."""
    if src.readonly:
        ctypes.memmove(dst, bytes(src), n)
        return
    ctypes.memmove(dst, (ctypes.c_char * n).from_buffer(src), n)


def _warn_once(key, msg):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def odirect_supported(directory: str | os.PathLike) -> bool:
    """Whether O_DIRECT writes of aligned buffers work in ``directory``."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(directory) / f".odirect-probe-{os.getpid()}"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        buf.close()
        try:
            probe.unlink()
        except OSError:
            pass


class ODirectStream(io.RawIOBase):
    """Write-only stream: aligned staging buffer -> O_DIRECT file; ``tell()`` is the logical position."""

    def __init__(self, path, buffer_bytes: int = 64 << 20, limit_bytes_per_s: float = 0.0):
        super().__init__()
        self.path = str(path)
        self.limit = limit_bytes_per_s
        self.t0 = None
        self.cap = max(ALIGN, buffer_bytes // ALIGN * ALIGN)
        self.buf = mmap.mmap(-1, self.cap)
        self.view = memoryview(self.buf)
        self._dst = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.fill = 0
        self.pos = 0
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)

    def writable(self):
        return True

    def seekable(self):
        return False

    def tell(self):
        return self.pos

    def fileno(self):
        return self.fd

    def _drain(self, n: int):
        done = 0
        while done < n:
            done += os.write(self.fd, self.view[done:n])
        if self.limit > 0:  # hold the average rate at the cap
            import time

            now = time.monotonic()
            self.t0 = self.t0 if self.t0 is not None else now
            ahead = (self.pos + self.fill) / self.limit - (now - self.t0)
            if ahead > 0:
                time.sleep(ahead)

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        off = 0
        while off < n:
            k = min(self.cap - self.fill, n - off)
            if k >= 1 << 16:  # large copies through ctypes.memmove, which releases the GIL
                _memmove(self._dst + self.fill, mv[off:off + k], k)
            else:
                self.view[self.fill:self.fill + k] = mv[off:off + k]
            self.fill += k
            off += k
            if self.fill == self.cap:
                self._drain(self.cap)
                self.fill = 0
        self.pos += n
        return n

    def flush(self):  # data leaves only in aligned blocks; the tail is written by close()
        pass

    def close(self):
        if self.closed:
            return
        try:
            if self.fill:
                padded = (self.fill + ALIGN - 1) // ALIGN * ALIGN
                self.view[self.fill:padded] = bytes(padded - self.fill)
                self._drain(padded)
            os.ftruncate(self.fd, self.pos)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.view.release()
            self._dst = None
            try:
                self.buf.close()
            except BufferError:  # the ctypes view of the buffer still exists: the mapping goes with the stream
                pass
            super().close()


class ODirectFileSystem(FileSystem):
    def __init__(self, buffer_bytes: int = 64 << 20, limit_bytes_per_s: float = 0.0):
        super().__init__()
        self.buffer_bytes = buffer_bytes
        self.limit = limit_bytes_per_s

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb":
            with super().create_stream(path, mode) as s:
                yield s
            return
        try:
            stream = ODirectStream(path, self.buffer_bytes, self.limit)
        except OSError as e:  # EINVAL: this file system refuses O_DIRECT
            _warn_once(str(Path(path).parent), f"O_DIRECT not supported for {Path(path).parent} ({e.strerror}); "
                                               "falling back to buffered writes")
            with super().create_stream(path, mode) as s:
                yield s
            return
        try:
            yield stream
        finally:
            stream.close()


class ODirectFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose files are written with O_DIRECT (see the module docstring)."""

    def __init__(self, path, *args, buffer_bytes: int = 64 << 20, limit_bytes_per_s: float = 0.0, **kwargs):
        super().__init__(path, *args, **kwargs)
        self.fs = ODirectFileSystem(buffer_bytes, limit_bytes_per_s)
        self.path = self.fs.init_path(path)


def make_writer(path, kind: str = "odirect", limit_bytes_per_s: float = 0.0, **kwargs):
    """``--ckpt-writer odirect|buffered``: odirect where the file system supports it (else buffered + warning).
    ``limit_bytes_per_s`` caps each O_DIRECT stream's average write rate (0: none; the buffered writer has no
    cap)."""
    if kind == "buffered":
        return FileSystemWriter(path, **kwargs)
    if kind != "odirect":
        raise ValueError(f"unknown checkpoint writer {kind!r} (odirect | buffered)")
    Path(path).mkdir(parents=True, exist_ok=True)
    if not odirect_supported(path):
        _warn_once(str(path), f"O_DIRECT not supported under {path}; using the buffered writer")
        return FileSystemWriter(path, **kwargs)
    return ODirectFileSystemWriter(path, limit_bytes_per_s=limit_bytes_per_s, **kwargs)


# ------------------------------------------------------------------------------------------------------
# checksumming wrapper around the O_DIRECT / buffered DCP writers: size and CRC32 of every file written
class _CRCStream:
    def __init__(self, inner, sink, name):
        self.inner, self.sink, self.name = inner, sink, name
        self.crc, self.n = 0, 0

    def write(self, data):
        mv = memoryview(data).cast("B")
        self.crc = zlib.crc32(mv, self.crc)
        self.n += len(mv)
        return self.inner.write(data)

    def __getattr__(self, k):
        return getattr(self.inner, k)


def _crc_filesystem(base_cls):
    class CRCFileSystem(base_cls):
        """Records size and CRC32 of every file written (computed from the bytes as they pass)."""

        digests: dict

        @contextmanager
        def create_stream(self, path, mode):
            import time

            import torch

            t0 = time.perf_counter()
            with super().create_stream(path, mode) as s:
                if mode != "wb":
                    yield s
                    return
                w = _CRCStream(s, None, os.path.basename(str(path)))
                # torch.save's per-record CRC32 (a thread-local setting: this runs in each DCP writer thread)
                # is computed with the GIL held; the checkpoint has its own CRC32 of every file, computed here
                # as the bytes pass without the GIL, and torch.load does not need the records'
                prev = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(self.record_crc)
                try:
                    yield w
                finally:
                    torch.serialization.set_crc32_options(prev)
                self.digests[w.name] = {"bytes": w.n, "crc32": w.crc}
            # the data files' phase of a save (first open to last close): the write time without DCP's planning
            self.span = (min(self.span[0], t0), max(self.span[1], time.perf_counter())) if self.span else \
                (t0, time.perf_counter())

        def rename(self, path, new_path):  # DCP writes .metadata.tmp and renames it
            super().rename(path, new_path)
            old = os.path.basename(str(path))
            if old in self.digests:
                self.digests[os.path.basename(str(new_path))] = self.digests.pop(old)

    return CRCFileSystem


def checksumming_writer(path, kind: str, thread_count: int = 1, limit_bytes_per_s: float = 0.0,
                        record_crc: bool = False):
    """``make_writer`` whose file system records ``fs.digests[name] = {"bytes", "crc32"}`` of every file written
    and ``fs.span`` (first data file opened, last closed; perf_counter seconds). ``record_crc``: torch.save's
    per-record CRC32 inside the files (off: the file CRC32 covers them)."""
    writer = make_writer(path, kind, thread_count=thread_count, limit_bytes_per_s=limit_bytes_per_s)
    fs_cls = _crc_filesystem(type(writer.fs))
    fs = fs_cls.__new__(fs_cls)
    fs.__dict__.update(writer.fs.__dict__)
    fs.digests = {}
    fs.span = None
    fs.record_crc = record_crc
    writer.fs = fs
    return writer
