"""Where the device is idle inside one profiled training step, from a ``benchmark.py --kernel-trace`` file.

``benchmark.py``'s ``breakdown.idle_gaps`` says how much of the step the device is idle, in which phase, and
between which kernel pairs. This script reads the whole device timeline the benchmark wrote and asks the next
questions, each answerable from the trace alone (it is how the breakdown's dropped kernels were found,
2026-12-07, ``benchmarks/README.md``):

- ``by_stream``: does the gap sit at a switch between streams (a cross-stream dependency inside the graph) or
  between two kernels of one stream?
- ``by_size``: are the gaps many short ones (a launch latency per kernel) or few long ones?
- ``positions``: kernels replayed from one graph come in the same order every replay, so each gap has a
  position in its graph. For each position with idle time: the gap's minimum, median and maximum over the
  replays. A gap present in every replay at the same length is structural (what the two kernels are, how the
  graph orders them); one that is long in some replays and absent in others comes from outside the graph
  (another stream's work, the host, the memory system).
- ``next_kernel``: the launch shape (grid, block, shared memory, registers) of kernels that follow a long gap,
  against all kernels.
- ``by_kind``: device time per kind of kernel over the whole timeline (the benchmark's ``breakdown.by_kind_s``
  recomputed from the trace).

Usage: ``python benchmarks/trace_gaps.py TRACE.json.gz [--out summary.json] [--min-us 20]`` (CPU only).
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict

from benchmark import idle_stretches, kernel_kind  # the sibling script (run as a script, its folder is on sys.path)

BUCKETS_US = (5, 20, 50, 100, 200, 500, float("inf"))


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def device_events(doc: dict) -> list[dict]:
    """Kernels, copies and memsets sorted by start: dicts with ts, end, name, kind, stream, corr, grid, block,
    smem, regs."""
    names = doc["names"]
    out = []
    for kind in ("k", "c", "s"):
        for ts, dur, n, stream, corr, grid, block, smem, regs in doc.get(kind, []):
            out.append({"ts": ts, "end": ts + dur, "name": names[n], "kind": kind, "stream": stream, "corr": corr,
                        "grid": tuple(grid) if grid else None, "block": tuple(block) if block else None,
                        "smem": smem, "regs": regs})
    out.sort(key=lambda e: (e["ts"], e["end"]))
    return out


def gaps(events: list[dict]) -> list[dict]:
    """Every stretch with no device event running, with the event that ended last before it and the one that
    starts it (over all streams together, as ``benchmark.idle_gaps``)."""
    return [{"us": us, "before": b, "after": a}
            for us, b, a in idle_stretches(events, lambda e: e["ts"], lambda e: e["end"])]


def replay_positions(events: list[dict]) -> dict:
    """Each event's (graph signature, position) when its launch id launched several events (a graph replay):
    the signature is the sequence of names that launch ran, so two replays of one graph share it."""
    by_corr = defaultdict(list)
    for e in events:
        if e["corr"] is not None:
            by_corr[e["corr"]].append(e)
    pos, sigs = {}, {}
    for corr, evs in by_corr.items():
        if len(evs) < 2:
            continue
        sig = hash(tuple(e["name"] for e in evs))
        sigs.setdefault(sig, len(sigs))
        for i, e in enumerate(evs):
            pos[id(e)] = (sigs[sig], i)
    return pos


def by_kind(events: list[dict], top_n: int = 8) -> dict:
    """Device time per kind (``benchmark.kernel_kind``: the breakdown's classes) over every kernel, copy and
    memset of the trace, with each kind's ``top_n`` kernels: the breakdown recomputed from the timeline."""
    per = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for e in events:
        r = per[kernel_kind(e["name"])][e["name"]]
        r[0] += 1
        r[1] += e["end"] - e["ts"]
    return {k: {"s": round(sum(t for _, t in v.values()) / 1e6, 5),
                "top": [{"s": round(t / 1e6, 5), "calls": c, "kernel": n[:120]}
                        for n, (c, t) in sorted(v.items(), key=lambda kv: -kv[1][1])[:top_n]]}
            for k, v in sorted(per.items(), key=lambda kv: -sum(t for _, t in kv[1].values()))}


def summarize(doc: dict, min_us: float = 20.0, top: int = 15) -> dict:
    events = device_events(doc)
    gs = gaps(events)
    if not gs:
        return {"events": len(events), "idle_us": 0.0}
    span = events[-1]["end"] - events[0]["ts"]
    idle = sum(g["us"] for g in gs)

    def short(name):
        return name[:80]

    by_stream = defaultdict(lambda: [0, 0.0])
    for g in gs:
        k = "same_stream" if g["before"]["stream"] == g["after"]["stream"] else "stream_switch"
        by_stream[k][0] += 1
        by_stream[k][1] += g["us"]
    by_size, lo = [], 0
    for hi in BUCKETS_US:
        sel = [g["us"] for g in gs if lo <= g["us"] < hi]
        by_size.append({"from_us": lo, "to_us": hi if hi != float("inf") else None, "count": len(sel),
                        "total_us": round(sum(sel), 1)})
        lo = hi
    pos = replay_positions(events)
    per_pos = defaultdict(list)
    replays = defaultdict(set)
    for e in events:
        p = pos.get(id(e))
        if p:
            replays[p[0]].add(e["corr"])
    for g in gs:  # gaps inside one replay (both kernels from the same launch)
        p = pos.get(id(g["after"]))
        if p and g["before"]["corr"] == g["after"]["corr"]:
            per_pos[p].append(g)
    positions = []
    for p, lst in per_pos.items():
        n_rep = len(replays[p[0]])
        vals = [g["us"] for g in lst] + [0.0] * (n_rep - len(lst))  # replays with no gap at this position
        g0 = lst[0]
        positions.append({"graph": p[0], "position": p[1], "replays": n_rep, "with_gap": len(lst),
                          "total_us": round(sum(vals), 1), "min_us": round(min(vals), 1),
                          "median_us": round(statistics.median(vals), 1), "max_us": round(max(vals), 1),
                          "stream_switch": g0["before"]["stream"] != g0["after"]["stream"],
                          "before": short(g0["before"]["name"]), "after": short(g0["after"]["name"]),
                          "after_launch": {"grid": g0["after"]["grid"], "block": g0["after"]["block"],
                                           "smem": g0["after"]["smem"], "regs": g0["after"]["regs"]}})
    positions.sort(key=lambda r: -r["total_us"])
    structural = sum(r["total_us"] for r in positions if r["min_us"] >= min_us)
    sporadic = sum(r["total_us"] for r in positions if r["min_us"] < min_us)
    long_after = [g["after"] for g in gs if g["us"] >= min_us]

    def shape_counts(evs):
        c = defaultdict(int)
        for e in evs:
            c[f"smem={e['smem']} block={e['block']}"] += 1
        return dict(sorted(c.items(), key=lambda kv: -kv[1])[:8])

    pairs = defaultdict(lambda: [0, 0.0])
    for g in gs:
        key = (short(g["before"]["name"]), short(g["after"]["name"]),
               g["before"]["stream"] != g["after"]["stream"])
        pairs[key][0] += 1
        pairs[key][1] += g["us"]
    return {
        "events": len(events), "span_us": round(span, 1), "idle_us": round(idle, 1), "gaps": len(gs),
        "busy_us": round(sum(e["end"] - e["ts"] for e in events), 1),
        "by_kind": by_kind(events),
        "streams": sorted({e["stream"] for e in events if e["stream"] is not None}),
        "by_stream": {k: {"count": n, "total_us": round(t, 1)} for k, (n, t) in by_stream.items()},
        "by_size": by_size,
        "in_graph_positions": {"graphs": len(replays), "structural_us": round(structural, 1),
                               "sporadic_us": round(sporadic, 1), "min_us_for_structural": min_us,
                               "top": positions[:top]},
        "by_pair": [{"before": b, "after": a, "stream_switch": sw, "count": n, "total_us": round(t, 1)}
                    for (b, a, sw), (n, t) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]],
        "next_kernel": {"after_long_gaps": shape_counts(long_after), "all": shape_counts(events)},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a benchmark.py --kernel-trace file")
    ap.add_argument("--out", default=None, help="write the summary JSON here (default: stdout)")
    ap.add_argument("--min-us", type=float, default=20.0,
                    help="a graph position whose gap is at least this long in every replay counts as structural")
    ap.add_argument("--top", type=int, default=15)
    ns = ap.parse_args(argv)
    s = summarize(load(ns.trace), ns.min_us, ns.top)
    text = json.dumps(s, indent=1)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
