"""``python -m megatron_k3 simulate``: k3-full's planned layout built on the meta device under a fake world.

Rank 0 (first pipeline stage) and the first rank of the last stage of 64 x 8 B300 run the trainer's own
construction code (model chunks, DDP, optimizer) on meta; their parameters and bytes must match
tools/plan_layout.py's figures within 5%."""
import json
import os
import subprocess
import sys


def test_k3_full_two_ranks_match_the_planner(root, tmp_path):
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, "-m", "megatron_k3", "simulate", "--preset", "k3-full", "--nodes", "64",
                        "--gpu", "b300", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=root), cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["world_size"] == 512 and rep["pass"]
    stages = [x["pipeline_stage"] for x in rep["ranks"]]
    assert stages == [0, int(rep["layout"].split("PP")[1].split()[0]) - 1]
    for x in rep["ranks"]:
        assert x["params"] > 5e9  # billions of parameters per rank, none allocated
        for k, v in x["vs_plan"].items():
            assert v["simulated"] > 0 and abs(v["rel_diff"]) <= 0.05, (x["rank"], k, v)
    assert "PASS" in r.stdout


def test_bad_rank_is_one_line(root):
    r = subprocess.run([sys.executable, "-m", "megatron_k3", "simulate", "--preset", "k3-full", "--nodes", "64",
                        "--gpu", "b300", "--ranks", "512"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root), cwd=root)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr
