#!/usr/bin/env python3
"""How much FP8 can speed up a model's step: Amdahl's law on measured device time (no GPU needed).

    python benchmarks/fp8_ceiling.py --runs results/bench_fp8_..._bf16.json results/bench_fp8_..._tensorwise.json \
        --gemm results/bench_gemm_fp8_..._profile.json [--target 1.3] [--out R.json]

Inputs, both written by this repository's benchmarks on one GPU:

- ``--runs``: ``benchmarks/bench_fp8.py`` JSON files (their recipes are merged). The ``bf16`` recipe must have
  a ``--breakdown``: its profiled step gives the GEMM device time ``G`` per step. The file's
  ``fp8_eligible_fraction`` (the FLOPs of the projections FP8 recipes take, over all GEMM FLOPs of the step)
  gives the eligible part, ``E = G * fraction`` (assuming GEMM time splits like GEMM FLOPs).
- ``--gemm``: ``benchmarks/bench_gemm_fp8.py --profile`` JSON: per shape, the device time of one Linear
  forward + backward (three GEMMs and every quantisation/cast around them) per case. A recipe's Linear speed-up
  ``r`` is the bf16 case's device time over the recipe's, summed over the shapes (so weighted by bf16 time);
  the trainer compiles torchao's recipes, so ``torchao-*`` is read from its ``*_compiled`` case.

With ``T`` the bf16 trainer's median step, an FP8 recipe that makes the eligible GEMMs ``r`` times faster
and changes nothing else gives ``T' = T - E (1 - 1/r)``. The script prints, per recipe, that prediction
beside the measured ratio, and the ceilings: ``r = 2`` (Hopper's dense FP8 peak is twice its bf16 peak, the
datasheets' 1,979 vs 989 TFLOP/s) on the eligible GEMMs and on every GEMM, and the ``r`` a ``--target`` ratio
needs (``null`` when even infinitely fast eligible GEMMs would not reach it); per recipe, the share of the bf16 step
its eligible GEMMs would need for the target at its measured ``r`` (``eligible_share_needed``, against this
model's ``eligible_share_of_step``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

HOPPER_FP8_OVER_BF16_PEAK = 2.0  # dense tensor-core peak, H100/H200 SXM datasheets: 1,979 / 989 TFLOP/s


def step_after(t: float, e: float, r: float) -> float:
    """Step time when ``e`` seconds of it run ``r`` times faster (``r = inf``: they vanish)."""
    return t - e * (1.0 - 1.0 / r)


def needed_speedup(t: float, e: float, target: float):
    """The speed-up ``r`` of ``e`` seconds of a ``t``-second step that makes the step ``target`` times
    faster; None when removing ``e`` altogether is not enough."""
    cut = t - t / target
    if cut >= e:
        return None
    return 1.0 / (1.0 - cut / e)


def linear_speedups(gemm: dict) -> dict:
    """Per case of ``bench_gemm_fp8 --profile``: bf16 Linear fwd+bwd device time over the case's, summed over
    the shapes that have both."""
    num, den = {}, {}
    for row in gemm["rows"]:
        ks = row.get("linear_fwd_bwd_kernels") or {}
        base = ks.get("torch_bf16")
        if not base:
            continue
        for case, k in ks.items():
            if not isinstance(k, dict):  # a case whose profile failed is recorded as its error text
                continue
            num[case] = num.get(case, 0.0) + base["total_ms"]
            den[case] = den.get(case, 0.0) + k["total_ms"]
    return {c: num[c] / den[c] for c in num if den[c] > 0}


def case_of(recipe: str) -> str:
    return recipe + "_compiled" if recipe.startswith("torchao-") else recipe


def analyse(runs: list, gemm: dict, target: float) -> dict:
    recipes, fraction, device = {}, None, None
    for r in runs:
        recipes.update(r["recipes"])
        fraction = r.get("fp8_eligible_fraction", fraction)
        device = device or r.get("device")
    if "bf16" not in recipes or "breakdown" not in recipes["bf16"]:
        raise SystemExit("fp8_ceiling: --runs needs a bf16 recipe run with --breakdown (its profiled GEMM time)")
    if fraction is None:
        raise SystemExit("fp8_ceiling: --runs carry no fp8_eligible_fraction")
    b = recipes["bf16"]
    t = b["median_step_s"]
    g = b["breakdown"]["by_kind_s"]["gemm"]
    e = g * fraction
    speed = linear_speedups(gemm)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python " + " ".join(sys.argv), "device": device, "gemm_device": gemm.get("device"),
           "bf16_step_s": t, "bf16_profiled_step_s": b["breakdown"]["median_step_s"],
           "bf16_device_busy_s": b["breakdown"]["device_busy_s"], "bf16_idle_s": b["breakdown"].get("idle_s"),
           "gemm_s": g, "gemm_share_of_step": g / t, "fp8_eligible_fraction": fraction, "eligible_gemm_s": e,
           "eligible_share_of_step": e / t,
           "linear_fwd_bwd_device_speedup": {k: round(v, 4) for k, v in speed.items()},
           "target": target,
           "ceilings": {
               "eligible_at_peak_ratio": t / step_after(t, e, HOPPER_FP8_OVER_BF16_PEAK),
               "all_gemm_at_peak_ratio": t / step_after(t, g, HOPPER_FP8_OVER_BF16_PEAK),
               "eligible_free": t / step_after(t, e, float("inf")),
               "speedup_needed_on_eligible": needed_speedup(t, e, target),
               "speedup_needed_on_all_gemm": needed_speedup(t, g, target)},
           "recipes": {}}
    for name, rec in recipes.items():
        if name == "bf16":
            continue
        row = {"measured_step_s": rec["median_step_s"], "measured_ratio": t / rec["median_step_s"],
               "loss_last20": rec.get("final_loss_mean_last20"),
               "loss_vs_bf16": (rec["final_loss_mean_last20"] / b["final_loss_mean_last20"] - 1
                                if rec.get("final_loss_mean_last20") and b.get("final_loss_mean_last20") else None)}
        r = speed.get(case_of(name))
        if r:
            row.update(linear_speedup=r, predicted_step_s=step_after(t, e, r),
                       predicted_ratio=t / step_after(t, e, r),
                       # the share of the bf16 step the eligible GEMMs would need for --target at this r (any
                       # model): (1 - 1/target) / (1 - 1/r); None when r <= 1
                       eligible_share_needed=((1 - 1 / target) / (1 - 1 / r)) if r > 1 else None)
        if "breakdown" in rec:
            row["breakdown_by_kind_s"] = rec["breakdown"]["by_kind_s"]
        out["recipes"][name] = row
    # trainer recipes of the GEMM table that no run here measured (Transformer Engine's ``te_<recipe>``, torchao's
    # ``*_compiled``): the same prediction, kept apart from the measured rows
    measured = {case_of(n) for n in recipes}
    trainer_case = lambda c: (c.startswith("te_") and c != "te_bf16") or c.endswith("_compiled")  # noqa: E731
    out["predicted_only"] = {c: {"linear_speedup": round(r, 4), "predicted_ratio": t / step_after(t, e, r)}
                             for c, r in sorted(speed.items()) if c not in measured and trainer_case(c)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="+", required=True, help="benchmarks/bench_fp8.py JSON files")
    ap.add_argument("--gemm", required=True, help="benchmarks/bench_gemm_fp8.py --profile JSON")
    ap.add_argument("--target", type=float, default=1.3, help="the step-time ratio over bf16 asked for")
    ap.add_argument("--out", help="write the analysis here as well")
    a = ap.parse_args(argv)
    runs = [json.load(open(p)) for p in a.runs]
    res = analyse(runs, json.load(open(a.gemm)), a.target)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
