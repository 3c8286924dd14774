#!/usr/bin/env python3
"""Host half of ``--optimizer-offload host-stream`` alone: how fast this machine's CPUs run the AdamW update.

    python benchmarks/bench_offload_host.py --params 2.5e8 --out R.json

The host-streamed optimizer (``megatron_k3/optim/offload.py``) copies each gradient chunk to the host,
updates the fp32 master and the moments there (``HostAdamWUpdate.update``, the code the trainer runs), and
copies the new weights back. On the H200 machine the whole step of k3-mini costs +0.8 s over on-GPU AdamW
(2026-12-04, mb 8, gb 32) and the transfers are pipelined, so the update's throughput on the host bounds the
overhead. This script times that update on flat state of ``--params`` elements in 32 MiB gradient chunks
(the stream's default), for each ``--impls`` x ``--blocks`` (elements per cache block) x moments dtype, next
to the host's own memory bandwidth (torch ``copy_`` and a triad ``a + s * b`` over the same number of fp32
elements, the same threads). It reports parameters per second, the seconds k3-mini's 1.257 B parameters
would take, and the effective memory traffic at the 22 bytes per parameter one update must move (read
master, gradient, two bf16 moments; write master, moments, bf16 weight). Every block size must give the same
bits as the first (the update is element-wise): checked, ``identical_to_first_block`` in the JSON. The
torch impls are compared with the one-pass kernel element by element (``elements_differing_from_onepass``:
torch's fused kernel rounds ``exp_avg_sq`` differently in its scalar tails, offload.py's docstring).
"""
import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

from megatron_k3.optim.offload import DEFAULT_CHUNK_BYTES, HostAdamWUpdate

K3_MINI_PARAMS = 1_257_000_000
BYTES_PER_PARAM = {torch.bfloat16: 22, torch.float32: 30}  # r: 4 master + 4 grad + 2x(2|4); w: 4 + 2x(2|4) + 2


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def bandwidth(n: int, reps: int) -> dict:
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    c.copy_(a)  # first touch outside the timing
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        c.copy_(a)
        t.append(time.perf_counter() - t0)
    tr = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(a, b, alpha=0.5, out=c)
        tr.append(time.perf_counter() - t0)
    return {"copy_GB_per_s": 8 * n / _median(t) / 1e9, "triad_GB_per_s": 12 * n / _median(tr) / 1e9}


def time_update(n: int, impl: str, block: int, moments, steps: int, seed: int = 0):
    upd = HostAdamWUpdate(n, [(0, n, 0)], moments_dtype=moments, impl=impl, cpu_block_elems=block)
    gen = torch.Generator().manual_seed(seed)
    upd.master.copy_(torch.randn(n, generator=gen))
    chunk = DEFAULT_CHUNK_BYTES // 4
    grads = torch.randn(min(chunk, n), generator=gen)  # one chunk's gradient, the same for every chunk
    g = torch.empty_like(grads)  # the stream's pinned buffer: refilled per chunk (the update clips it in place)
    out = torch.empty(min(chunk, n), dtype=torch.bfloat16)
    times = []
    for step in range(1, steps + 1):
        t = 0.0
        for h0 in range(0, n, chunk):
            h1 = min(n, h0 + chunk)
            g[:h1 - h0].copy_(grads[:h1 - h0])  # on the GPU machine a DMA does this, so it is not timed
            t0 = time.perf_counter()
            upd.update(g[:h1 - h0], h0, h1, step, 0.5, [(3e-4, 0.1)], [(0, out[:h1 - h0])])
            t += time.perf_counter() - t0
        times.append(t)
    return upd, times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=2.5e8, help="elements of host state (default 2.5e8: 2 GB)")
    ap.add_argument("--impls", default="onepass,fused,torch", help="comma list of onepass, fused, torch (onepass: "
                    "the one-pass C kernel, which has no cache blocks: timed once, at the first --blocks entry)")
    ap.add_argument("--blocks", default="4194304,1048576,262144,65536", help="elements per cache block, comma list")
    ap.add_argument("--moments", default="bf16", help="comma list of bf16, fp32 (fp32: 12 B/param host state)")
    ap.add_argument("--steps", type=int, default=3, help="timed updates per setting (median reported)")
    ap.add_argument("--out", default=None, help="JSON path")
    a = ap.parse_args()
    n = int(a.params)
    if n < 1024:
        ap.error(f"--params must be at least 1024, not {a.params}")
    try:
        blocks = [int(b) for b in a.blocks.split(",")]
        moments = [{"bf16": torch.bfloat16, "fp32": torch.float32}[m] for m in a.moments.split(",")]
    except (ValueError, KeyError):
        ap.error(f"--blocks takes integers and --moments bf16/fp32: {a.blocks!r}, {a.moments!r}")
    impls = a.impls.split(",")
    if any(i not in ("onepass", "fused", "torch") for i in impls):
        ap.error(f"--impls takes onepass, fused and/or torch, not {a.impls!r}")
    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu only",
           "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]), "params": n,
           "bandwidth": bandwidth(n, 3), "runs": []}
    print(json.dumps(rep["bandwidth"]), flush=True)
    for md in moments:
        finals = {}
        for impl in impls:
            first = None
            for block in (blocks[:1] if impl == "onepass" else blocks):
                upd, times = time_update(n, impl, block, md, a.steps)
                s = _median(times)
                r = {"impl": impl, "moments": str(md).replace("torch.", ""), "cpu_block": block,
                     "seconds": times, "G_params_per_s": n / s / 1e9,
                     "k3_mini_update_s": K3_MINI_PARAMS / (n / s),
                     "effective_GB_per_s": BYTES_PER_PARAM[md] * n / s / 1e9}
                if first is None:
                    first = (upd.master.clone(), upd.exp_avg.clone(), upd.exp_avg_sq.clone())
                    finals[impl] = first
                    if impl != "onepass" and "onepass" in finals:  # elements whose bits differ from the one-pass
                        r["elements_differing_from_onepass"] = {  # kernel's (fused: its scalar tails only)
                            k: int((x != y).sum()) for k, x, y in zip(("master", "exp_avg", "exp_avg_sq"),
                                                                       first, finals["onepass"])}
                else:
                    r["identical_to_first_block"] = all(torch.equal(x, y) for x, y in zip(
                        first, (upd.master, upd.exp_avg, upd.exp_avg_sq)))
                rep["runs"].append(r)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                                  if k != "seconds"}), flush=True)
                del upd
    bad = [r for r in rep["runs"] if r.get("identical_to_first_block") is False]
    best = max(rep["runs"], key=lambda r: r["G_params_per_s"])
    rep["best"] = {k: best[k] for k in ("impl", "moments", "cpu_block", "G_params_per_s", "k3_mini_update_s")}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=1)
    if bad:
        print(f"error: {len(bad)} block sizes changed the bits of the update", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
