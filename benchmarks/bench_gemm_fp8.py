#!/usr/bin/env python3
"""FP8 GEMMs on this GPU, one table per run: what the chip does against what the FP8 training paths get.

    source .gpu/bin/on_device.sh && python3 benchmarks/bench_gemm_fp8.py --out $OUT/gemm_fp8.json      # GPU

Issue #33 item 1: Transformer Engine's FP8 Linear ran at 427-568 TFLOP/s fwd+bwd on the H200 (2026-11-30)
where a plain ``torch._scaled_mm`` reached 1257. This script measures, for each ``--shapes`` entry M,N,K
(tokens x out features x in features; default: the 8192x4096x4096 of that measurement and two K3 shapes),
in one process and with CUDA events (median of ``--iters`` after ``--warmup``):

GEMM only (operands already in their dtype):
- ``bf16``: ``x @ w.T`` in bf16;
- ``scaled_mm_tensorwise``: ``torch._scaled_mm`` e4m3 x e4m3 -> bf16, one fp32 scale per operand;
- ``scaled_mm_rowwise``: the same with one scale per row of x and per row of w (the layout torchao's
  rowwise float8 training uses).

Linear forward + backward (the three GEMMs of training, dgrad and wgrad included, and every quantisation,
transpose and amax the recipe needs):
- ``torch_bf16``: ``torch.nn.functional.linear`` in bf16 with autograd;
- ``scaled_mm_rowwise_fwd_bwd``: the three GEMMs through ``torch._scaled_mm`` with rowwise e4m3 inputs,
  the quantisation (amax, scale, cast, the transposed copies the backward GEMMs need) timed with them: what a
  rowwise FP8 Linear costs when its kernels are torch's own;
- ``torchao-<recipe>_compiled`` / ``_eager``: the trainer's torchao path (``parallel/precision.py:
  float8_gemm``, torchao's ``matmul_with_hp_or_float8_args``) for each torchao recipe, its quantisation
  compiled with the GEMM call as the trainer runs it, and eagerly;
- ``te_bf16`` and ``te_<recipe>`` for each ``--te-recipes`` entry (delayed, current, blockwise, mxfp8):
  ``transformer_engine.pytorch.Linear`` under ``fp8_autocast`` with that recipe; a recipe the GPU or the TE
  build refuses is recorded with its error (MXFP8 needs compute capability 10.0).

TFLOP/s count 2*M*N*K per GEMM (x3 for fwd+bwd). The JSON also records the GPU, torch, CUDA, TE and the
cuBLAS / cuBLASLt libraries this process mapped (``/proc/self/maps``) with the version each reports
(``cublasLtGetVersion``) and the one TE says it was built against and runs (``tex.get_cublasLt_version``),
because which cuBLASLt TE loads is one of the causes the issue asks about.

``--profile`` adds, per Linear case and shape, where its fwd+bwd time goes on the device (``torch.profiler``,
``--profile-iters`` calls): the kernels' time per call split into the GEMMs (cuBLAS/CUTLASS names) and the
rest (quantisation, transposes, amax and scale updates, casts), and the case's top kernels by time. That
split answers "is it the FP8 GEMM or the work around it" per recipe. Without a CUDA device with FP8 (compute capability >= 8.9) the script
writes its refusal into the JSON and exits 2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys

import torch
from benchmark import GEMM_KERNELS, kernel_device_us

E4M3 = getattr(torch, "float8_e4m3fn", None)
DEFAULT_SHAPES = "8192,4096,4096;16384,4096,11264;16384,11264,4096"


def mapped_libraries(*needles: str) -> list:
    """Shared objects of this process whose path contains one of ``needles`` (Linux /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if any(n in os.path.basename(p) for n in needles))


GEMM_KERNEL = re.compile(GEMM_KERNELS, re.I)  # the same names benchmark.py's breakdown counts as GEMM


def cublaslt_versions(paths) -> dict:
    """``cublasLtGetVersion()`` of each mapped libcublasLt (e.g. 120905 = 12.9.5), or the error."""
    import ctypes

    out = {}
    for p in paths:
        if "libcublasLt" not in os.path.basename(p):
            continue
        try:
            fn = ctypes.CDLL(p).cublasLtGetVersion
            fn.restype = ctypes.c_size_t
            out[p] = int(fn())
        except Exception as e:  # noqa: BLE001
            out[p] = f"{type(e).__name__}: {e}"
    return out


def split_kernels(kernels, calls: int, top_n: int = 12) -> dict:
    """``kernels``: (name, total device microseconds) over ``calls`` calls of one case. Returns milliseconds
    per call: all kernels, the GEMMs (``GEMM_KERNEL`` names), the rest, and the ``top_n`` kernels."""
    per = [(n, us / 1e3 / calls) for n, us in kernels if us > 0]
    gemm = sum(ms for n, ms in per if GEMM_KERNEL.search(n))
    total = sum(ms for _, ms in per)
    return {"total_ms": round(total, 4), "gemm_ms": round(gemm, 4), "other_ms": round(total - gemm, 4),
            "top": [{"ms": round(ms, 4), "kernel": n[:100]} for n, ms in sorted(per, key=lambda t: -t[1])[:top_n]]}


def profile_case(fn, iters: int) -> dict:
    """Device kernels of ``iters`` calls of ``fn`` (after one warm call), split by ``split_kernels``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return split_kernels([(e.key, kernel_device_us(e)) for e in prof.key_averages()], iters)


def device_tflops(row: dict) -> dict:
    """Per profiled Linear case of one shape: TFLOP/s of its fwd+bwd from the device time of its kernels alone
    (``linear_fwd_bwd_kernels[case].total_ms``). Unlike ``linear_fwd_bwd_tflops`` (CUDA events around each
    call), the host's time to issue a call does not count: where the two differ, the case is host-bound at that
    shape when run eagerly, which a CUDA graph (the trainer's layer graphs) removes."""
    flops = 3 * 2 * row["M"] * row["N"] * row["K"]
    return {case: round(flops / (k["total_ms"] / 1e3) / 1e12, 1)
            for case, k in (row.get("linear_fwd_bwd_kernels") or {}).items()
            if isinstance(k, dict) and k.get("total_ms")}


def summarize(rep: dict) -> str:
    """A Markdown table of a JSON this script wrote: per shape and Linear case, timed TFLOP/s, device-time
    TFLOP/s and the device time per call split into GEMM and the rest (milliseconds); the GEMM-only figures
    first."""
    out = []
    for row in rep.get("rows", []):
        out.append(f"M x N x K = {row['M']} x {row['N']} x {row['K']}: GEMM only, TFLOP/s: "
                   + ", ".join(f"{k} {v}" for k, v in row["gemm_tflops"].items()))
        out.append("")
        out.append("| Linear fwd+bwd | timed TFLOP/s | device TFLOP/s | device ms / call | GEMM ms | other ms |")
        out.append("|---|---|---|---|---|---|")
        dev = device_tflops(row)
        kern = row.get("linear_fwd_bwd_kernels") or {}
        for case, t in row["linear_fwd_bwd_tflops"].items():
            k = kern.get(case) if isinstance(kern.get(case), dict) else {}
            out.append(f"| {case} | {t} | {dev.get(case, '')} | {k.get('total_ms', '')} | {k.get('gemm_ms', '')} "
                       f"| {k.get('other_ms', '')} |")
        for case, err in (row.get("errors") or {}).items():
            out.append(f"| {case} | refused: {err} | | | | |")
        out.append("")
    return "\n".join(out)


def timed(fn, warmup: int, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def quantize(t: torch.Tensor, rowwise: bool):
    """e4m3 copy of a 2-D tensor scaled by 448 / amax (one fp32 scale per row, or one for the tensor), and the
    inverse scales ``_scaled_mm`` multiplies back."""
    amax = (t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().amax()).float().clamp(min=1e-12)
    scale = 448.0 / amax
    return (t.float() * scale).to(E4M3), scale.reciprocal()


def quantize_rowwise(t: torch.Tensor):
    return quantize(t, True)


def gemm_cases(M: int, N: int, K: int, dev) -> dict:
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    xq_t, sx_t = quantize(x, rowwise=False)
    wq_t, sw_t = quantize(w, rowwise=False)
    xq_r, sx_r = quantize_rowwise(x)
    wq_r, sw_r = quantize_rowwise(w)
    return {
        "bf16": lambda: x @ w.t(),
        # _scaled_mm wants the second operand column-major: w (N x K, row-major) transposed is exactly that
        "scaled_mm_tensorwise": lambda: torch._scaled_mm(xq_t, wq_t.t(), scale_a=sx_t, scale_b=sw_t,
                                                         out_dtype=torch.bfloat16),
        "scaled_mm_rowwise": lambda: torch._scaled_mm(xq_r, wq_r.t(), scale_a=sx_r, scale_b=sw_r.t(),
                                                      out_dtype=torch.bfloat16),
    }


def rowwise_fwd_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """The three GEMMs of a Linear's training step with rowwise e4m3 operands, quantisation included:
    y = x w^T (rows of x, rows of w), dx = dy w (rows of dy, columns of w), dw = dy^T x (columns of dy and x)."""
    xq, sx = quantize_rowwise(x)
    wq, sw = quantize_rowwise(w)
    y = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)
    dyq, sdy = quantize_rowwise(dy)
    wtq, swt = quantize_rowwise(w.t().contiguous())          # w's columns as rows
    dx = torch._scaled_mm(dyq, wtq.t(), scale_a=sdy, scale_b=swt.t(), out_dtype=torch.bfloat16)
    dytq, sdyt = quantize_rowwise(dy.t().contiguous())       # dy's columns as rows
    xtq, sxt = quantize_rowwise(x.t().contiguous())
    dw = torch._scaled_mm(dytq, xtq.t(), scale_a=sdyt, scale_b=sxt.t(), out_dtype=torch.bfloat16)
    return y, dx, dw


def linear_cases(M: int, N: int, K: int, dev, te_recipes) -> tuple[dict, dict]:
    """fwd+bwd closures, and the errors of the cases that could not be set up."""
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    cases, errors = {}, {}

    def torch_bf16():
        torch.nn.functional.linear(x, w).backward(dy)

    cases["torch_bf16"] = torch_bf16
    cases["scaled_mm_rowwise_fwd_bwd"] = lambda: rowwise_fwd_bwd(x.detach(), w.detach(), dy)
    try:  # the trainer's torchao path (parallel/precision.py: float8_gemm), eager and compiled as it runs
        from megatron_k3 import perf
        from megatron_k3.parallel.precision import TORCHAO_RECIPES, float8_gemm

        def ao(recipe, mode):
            def f():
                with perf.using(compile=mode):
                    y = float8_gemm(x, w, recipe)
                y.backward(dy)
            return f

        for recipe in TORCHAO_RECIPES:
            for mode, tag in (("auto", "compiled"), ("off", "eager")):
                f = ao(recipe, mode)
                f()  # compiles here, before the timing
                cases[f"{recipe}_{tag}"] = f
    except Exception as e:  # noqa: BLE001  (torchao absent or refused: recorded, the rest still runs)
        errors["torchao"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except Exception as e:  # noqa: BLE001  (TE absent or broken: recorded, the rest still runs)
        errors["te"] = f"{type(e).__name__}: {e}"
        return cases, errors
    lin = te.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=dev)
    xt = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def te_run(rec):
        def f():
            if rec is None:
                lin(xt).backward(dy)
            else:
                with te.fp8_autocast(enabled=True, fp8_recipe=rec):
                    y = lin(xt)
                y.backward(dy)
        return f

    cases["te_bf16"] = te_run(None)
    makers = {"delayed": lambda: te_recipe.DelayedScaling(),
              "current": lambda: te_recipe.Float8CurrentScaling(),
              "blockwise": lambda: te_recipe.Float8BlockScaling(),
              "mxfp8": lambda: te_recipe.MXFP8BlockScaling()}
    for name in te_recipes:
        try:
            rec = makers[name]()
            f = te_run(rec)
            f()  # a recipe the GPU or this TE build refuses raises here
            cases[f"te_{name}"] = f
        except Exception as e:  # noqa: BLE001
            errors[f"te_{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
    return cases, errors


def record_environment(rep: dict) -> None:
    """TE, torchao and the cuBLAS/cuBLASLt/TE/cuDNN libraries this process has mapped, with their versions: once
    before the rows (a call that runs out of time keeps them) and again at the end (what the cases loaded)."""
    try:
        import transformer_engine

        rep["transformer_engine"] = getattr(transformer_engine, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        rep["transformer_engine"] = f"not importable: {type(e).__name__}"
    try:  # the cuBLASLt / cuDNN versions TE's extension reports
        import transformer_engine_torch as tex

        rep["transformer_engine_libs"] = {f: getattr(tex, f)() for f in ("get_cublasLt_version",
                                                                          "get_cudnn_version") if hasattr(tex, f)}
    except Exception as e:  # noqa: BLE001
        rep["transformer_engine_libs"] = f"not importable: {type(e).__name__}"
    try:
        import torchao

        rep["torchao"] = getattr(torchao, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        rep["torchao"] = f"not importable: {type(e).__name__}"
    rep["libraries"] = mapped_libraries("libcublas", "libcublasLt", "libtransformer_engine", "libcudnn")
    rep["cublaslt_versions"] = cublaslt_versions(rep["libraries"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="';'-separated M,N,K (tokens, out, in features)")
    ap.add_argument("--te-recipes", default="delayed,current,blockwise,mxfp8",
                    help="comma list of delayed, current, blockwise, mxfp8 (empty: no TE recipes)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--profile", action="store_true",
                    help="also split each Linear case's device time into GEMM and the rest (torch.profiler)")
    ap.add_argument("--profile-iters", type=int, default=5)
    ap.add_argument("--summarize", metavar="JSON",
                    help="print the Markdown table of a JSON this script wrote (no GPU needed) and exit")
    a = ap.parse_args()
    if a.summarize:
        with open(a.summarize) as f:
            print(summarize(json.load(f)))
        return 0
    try:
        shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes.split(";") if s.strip()]
        assert shapes and all(len(s) == 3 and min(s) > 0 for s in shapes)
    except (ValueError, AssertionError):
        ap.error(f"--shapes takes ';'-separated M,N,K triples of positive integers, not {a.shapes!r}")
    recipes = [r for r in a.te_recipes.split(",") if r]
    bad = [r for r in recipes if r not in ("delayed", "current", "blockwise", "mxfp8")]
    if bad:
        ap.error(f"--te-recipes: unknown {bad} (delayed, current, blockwise, mxfp8)")
    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]), "torch": torch.__version__,
           "cuda": torch.version.cuda, "shapes": [list(s) for s in shapes]}

    def dump():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rep, f, indent=1)

    cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if cc is None or cc < (8, 9) or E4M3 is None:
        rep["error"] = (f"needs a CUDA device with FP8 (compute capability >= 8.9) and torch.float8_e4m3fn; "
                        f"this process has {'no CUDA device' if cc is None else f'compute capability {cc}'}")
        dump()
        print(f"error: {rep['error']}", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rep["device"] = torch.cuda.get_device_name()
    rep["rows"] = []
    record_environment(rep)
    dump()
    for M, N, K in shapes:
        flops = 2 * M * N * K
        row = {"M": M, "N": N, "K": K, "gemm_tflops": {}, "linear_fwd_bwd_tflops": {}}
        for name, fn in gemm_cases(M, N, K, dev).items():
            row["gemm_tflops"][name] = round(flops / timed(fn, a.warmup, a.iters) / 1e12, 1)
        cases, errors = linear_cases(M, N, K, dev, recipes)
        for name, fn in cases.items():
            row["linear_fwd_bwd_tflops"][name] = round(3 * flops / timed(fn, a.warmup, a.iters) / 1e12, 1)
            if a.profile:
                try:
                    row.setdefault("linear_fwd_bwd_kernels", {})[name] = profile_case(fn, a.profile_iters)
                except Exception as e:  # noqa: BLE001  (a profiler failure must not lose the timings)
                    row.setdefault("linear_fwd_bwd_kernels", {})[name] = f"{type(e).__name__}: {e}"
        if a.profile:
            row["linear_fwd_bwd_device_tflops"] = device_tflops(row)
        row["errors"] = errors
        rep["rows"].append(row)
        print(json.dumps(row), flush=True)
        dump()
    record_environment(rep)
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
