"""The README's main job (short): trains k3-tiny on CPU and the loss falls; bad input is one clear line."""
import json
import os
import subprocess
import sys


def _smoke(root, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=root)
    return subprocess.run([sys.executable, "-m", "megatron_k3.smoke", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=root, env=env)


def test_smoke_pretraining_loss_falls(root, tmp_path):
    r = _smoke(root, "--steps", "50", "--micro-batch-size", "8", "--seq-length", "128", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(recs) == 50 and [r["step"] for r in recs] == list(range(1, 51))
    assert recs[-1]["loss"] < 0.8 * recs[0]["loss"]
    # warmup is a fraction of the run: 5% of 50 steps = 2 (rounded) steps
    assert recs[0]["lr"] < recs[1]["lr"] and abs(recs[1]["lr"] - 3e-3) < 1e-12


def test_smoke_bad_input(root, tmp_path):
    r = _smoke(root, "--preset", "k3-nope", "--out", str(tmp_path))
    assert r.returncode == 2 and "unknown preset" in r.stderr and "Traceback" not in r.stderr
    r = _smoke(root, "--lr-warmup-fraction", "1.5", "--out", str(tmp_path))
    assert r.returncode == 2 and "warmup" in r.stderr
