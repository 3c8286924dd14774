#!/usr/bin/env python3
"""Checkpoint save benchmark: O_DIRECT vs buffered DCP writer, throughput and page-cache growth.

    python tools/bench_checkpoint.py --size-gib 1 --dir /path/on/target/fs [--json out.json]

For each writer: builds a state dict of fp32 tensors totalling ``--size-gib``, saves it with
``torch.distributed.checkpoint.save`` (single process), and reports wall time, GB/s, the growth of
``Cached`` in /proc/meminfo across the save, and the bytes of the checkpoint's own files in the page cache
right after it (mincore(2); not disturbed by other processes' cache traffic). The O_DIRECT files are
then loaded with the stock ``FileSystemReader`` and compared bit for bit.
"""
import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def cached_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return -1


def resident_bytes(directory) -> int:
    """Bytes of the files under ``directory`` that are in the page cache now (mincore(2) on a mapping of each
    file): exact per file, unaffected by other processes' cache traffic (unlike /proc/meminfo Cached)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    page = mmap.PAGESIZE
    total = 0
    for dp, _, fs in os.walk(directory):
        for f in fs:
            path = os.path.join(dp, f)
            size = os.path.getsize(path)
            if size == 0:
                continue
            with open(path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
                try:
                    buf = ctypes.c_char.from_buffer(mm)
                    n = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * n)()
                    if libc.mincore(ctypes.addressof(buf), size, vec) != 0:
                        raise OSError(ctypes.get_errno(), "mincore failed")
                    total += sum(v & 1 for v in vec) * page
                    del buf
                finally:
                    mm.close()
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir next to this repo)")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from checkpoints_io.odirect import make_writer, odirect_supported

    base = args.dir or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".bench_ckpt")
    os.makedirs(base, exist_ok=True)
    n = int(args.size_gib * (1 << 30)) // 4 // args.tensors
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(n, generator=g) for i in range(args.tensors)}
    total = n * 4 * args.tensors
    report = {"size_bytes": total, "dir": base, "odirect_supported": odirect_supported(base), "writers": {}}
    for kind in ("odirect", "buffered"):
        path = os.path.join(base, kind)
        shutil.rmtree(path, ignore_errors=True)
        c0 = cached_bytes()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=make_writer(path, kind))
        dt = time.perf_counter() - t0
        c1 = cached_bytes()
        report["writers"][kind] = {"seconds": dt, "GB_per_s": total / dt / 1e9, "page_cache_growth_bytes": c1 - c0,
                                   "checkpoint_pages_in_cache_bytes": resident_bytes(path)}
        if kind == "odirect":
            back = {k: torch.empty_like(v) for k, v in sd.items()}
            dcp.load(back, storage_reader=FileSystemReader(path))
            report["odirect_files_read_by_stock_reader_bit_exact"] = all(torch.equal(back[k], sd[k]) for k in sd)
        shutil.rmtree(path, ignore_errors=True)
    txt = json.dumps(report, indent=1)
    print(txt)
    if args.json:
        with open(args.json, "w") as f:
            f.write(txt + "\n")


if __name__ == "__main__":
    main()
