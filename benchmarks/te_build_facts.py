#!/usr/bin/env python3
"""How the Transformer Engine we run was built, read from its wheel without a GPU (issue #33 item 1).

    cat .gpu/te[0-9]*/part* > /tmp/te_core.whl          # the carried TE core wheel (../shared/gpu/README.md)
    python benchmarks/te_build_facts.py /tmp/te_core.whl --out benchmarks/results/te_build_facts.json

Two of the causes the issue names for TE's slow FP8 GEMMs can be read off the core library
(``transformer_engine/wheel_lib/libtransformer_engine.so``, where TE's GEMM calls and its quantize/transpose
kernels live) before any GPU time is spent:
- **which cuBLASLt it loads**: its ``NEEDED`` entries (the sonames the dynamic loader resolves, e.g.
  ``libcublasLt.so.13``) and its ``RPATH``/``RUNPATH`` (none: the loader takes the one already in the process,
  i.e. the one torch loaded, or the first on the search path). The exact version mapped at run time is recorded on
  the GPU by ``benchmarks/bench_gemm_fp8.py`` (``cublaslt_versions``, ``transformer_engine_libs``);
- **which GPU architectures its kernels were compiled for**: the ``.nv_fatbin`` section's entries, counted by
  kind (``ELF``: machine code for that SM, run as is; ``PTX``: compiled by the driver at first use) and SM
  number. Hopper is SM 90: without SM-90 machine code TE's kernels would be JIT-compiled PTX.
``readelf`` and ``objcopy`` (binutils) do the ELF reading; the fatbin walk is ``fatbin_entries``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import struct
import subprocess
import sys
import tempfile
import zipfile

LIB = "transformer_engine/wheel_lib/libtransformer_engine.so"
FATBIN_MAGIC = 0xBA55ED50
KINDS = {1: "PTX", 2: "ELF"}


def fatbin_entries(blob: bytes) -> dict:
    """Count the entries of a ``.nv_fatbin`` section by (kind, SM). The section is a run of fat binaries, each a
    16-byte header (magic 0xBA55ED50, u16 version, u16 header size, u64 size of what follows) and then entries,
    each with its own header: u16 kind (1 PTX, 2 ELF), u16 version, u32 header size, u64 payload size, ...,
    u32 SM number at offset 28; the payload follows the entry header."""
    counts: collections.Counter = collections.Counter()
    i = 0
    while (i := blob.find(struct.pack("<I", FATBIN_MAGIC), i)) >= 0:
        _, hsize, size = struct.unpack_from("<HHQ", blob, i + 4)
        j, end = i + hsize, i + hsize + size
        while j + 32 <= end:
            kind, _, ehsize, payload = struct.unpack_from("<HHIQ", blob, j)
            sm = struct.unpack_from("<I", blob, j + 28)[0]
            counts[f"{KINDS.get(kind, kind)} sm_{sm}"] += 1
            if ehsize <= 0:
                break
            j += ehsize + payload
        i = max(end, i + 4)
    return dict(sorted(counts.items()))


def dynamic_section(lib: str) -> dict:
    """``NEEDED`` sonames and ``RPATH``/``RUNPATH`` of a shared object (``readelf -d``)."""
    out = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, check=True).stdout
    needed, paths = [], []
    for line in out.splitlines():
        if "(NEEDED)" in line:
            needed.append(line.split("[", 1)[1].rstrip("]"))
        elif "(RPATH)" in line or "(RUNPATH)" in line:
            paths.append(line.split("[", 1)[1].rstrip("]"))
    return {"needed": needed, "rpath_runpath": paths}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", help="the TE core wheel (transformer_engine_cu13-*.whl or _cu12)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(a.wheel) as z:
        names = z.namelist()
        if LIB not in names:
            print(f"error: {a.wheel} has no {LIB}", file=sys.stderr)
            return 2
        lib = z.extract(LIB, tmp)
        meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
        version = next((ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines()
                        if ln.startswith("Version:")), "?") if meta else "?"
        fat = os.path.join(tmp, "fatbin.bin")
        subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", lib, fat], check=True)
        with open(fat, "rb") as f:
            entries = fatbin_entries(f.read())
        dyn = dynamic_section(lib)
    rep = {"wheel": os.path.basename(a.wheel), "version": version, "library": LIB, **dyn,
           "cublas_sonames": [n for n in dyn["needed"] if n.startswith("libcublas")],
           "fatbin_entries": entries,
           "sm90_machine_code": any(k.startswith("ELF sm_90") for k in entries)}
    print(json.dumps(rep, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
