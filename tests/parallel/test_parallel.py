"""Parallel equivalence (tools/verify_parallel.py) against the golden model, on CPU with gloo.

Each test spawns one process group and checks several layouts in it (a spawn costs ~10-20 s here).
Tolerance 1e-4 relative (see megatron_k3/parallel/verify.py); observed errors are ~1e-6.
"""
import os
import subprocess
import sys

import pytest


def _verify(root, *args, env=None, timeout=900):
    e = dict(os.environ, PYTHONPATH=root, **(env or {}))
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "verify_parallel.py"), "--preset", "k3-tiny", *args],
                       capture_output=True, text=True, timeout=timeout, env=e)
    return r, r.stdout.strip().splitlines()


def _assert_pass(r, lines, n_layouts):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert lines[-1].startswith("max_rel_err=") and lines[-1].endswith(" PASS")
    assert sum(1 for line in lines if line.startswith("[verify]")) == n_layouts
    assert float(lines[-1].split("=")[1].split()[0]) < 1e-4


def test_world2_layouts(root):
    """TP2, TP2+SP, PP2, PP2 x VPP2, EP2 (over DP2), CP2, DP2 with the distributed optimizer."""
    r, lines = _verify(root, "--tp", "2", "--also", "tp=2,sp=1", "--also", "pp=2", "--also", "pp=2,vpp=2",
                       "--also", "ep=2,dp=2", "--also", "cp=2", "--also", "dp=2,distopt=1")
    _assert_pass(r, lines, 7)


def test_world4_layouts(root):
    """TP2 x PP2, TP2 x EP2 (x DP2), PP2 x CP2."""
    r, lines = _verify(root, "--tp", "2", "--pp", "2", "--sequence-parallel", "--also", "tp=2,ep=2,dp=2,sp=1",
                       "--also", "pp=2,cp=2")
    _assert_pass(r, lines, 3)


def test_mtp_head_layouts(root):
    r, lines = _verify(root, "--mtp", "1", "--tp", "2", "--sequence-parallel", "--also", "cp=2",
                       "--also", "ep=2,dp=2")
    _assert_pass(r, lines, 3)


def test_per_head_muon_layouts(root):
    """Per-head Muon + AdamW: TP2 == TP1 (no SP and SP), DP2 == DP1, EP2 (x DP2) against the golden model."""
    r, lines = _verify(root, "--optimizer", "muon", "--tp", "2", "--also", "tp=2,sp=1", "--also", "dp=2",
                       "--also", "ep=2,dp=2")
    _assert_pass(r, lines, 4)


def test_check_catches_a_missing_reduction(root):
    """Drop the TP sum of the TP-partial gradients (KDA f_a_proj/o_norm, MLA down projections): must FAIL."""
    r, lines = _verify(root, "--tp", "2", env={"K3_VERIFY_FAULT": "skip_tp_partial_sum"})
    assert r.returncode == 1 and lines[-1].endswith(" FAIL"), r.stdout[-2000:] + r.stderr[-2000:]
    assert float(lines[-1].split("=")[1].split()[0]) > 1e-2


@pytest.mark.parametrize("args,needle", [
    (["--pp", "8"], "split an Attention-Residual block"),
    (["--tp", "8"], "must divide the KDA heads"),
    (["--ep", "3", "--dp", "3"], "must divide the routed experts"),
    (["--cp", "2", "--seq-length", "30"], "divisible by 2*CP"),
    (["--dp", "3"], "not divisible by micro batch x DP"),
    (["--also", "tp=2,bogus=1"], "unknown key 'bogus'"),
    (["--optimizer", "muon", "--dp", "2", "--distributed-optimizer"], "Muon runs without the distributed optimizer"),
])
def test_impossible_layouts_refused_before_launch(root, args, needle):
    r, _ = _verify(root, *args, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err
    assert "[verify]" not in r.stdout  # nothing ran
