"""The trainer: the README's main command end to end, bad input, and a 2-rank run."""
import glob
import json
import os
import subprocess
import sys

import pytest

from megatron_k3.train.metrics import read_wandb_history


def _env(root):
    return dict(os.environ, PYTHONPATH=root, WANDB_MODE="offline")


@pytest.fixture(scope="module")
def main_run(root, tmp_path_factory):
    """`bash tools/quickstart.sh` (the README main command), with the run directory in a temp dir."""
    run_dir = tmp_path_factory.mktemp("run") / "k3-tiny-cpu"
    r = subprocess.run(["bash", os.path.join(root, "tools", "quickstart.sh"), "--run-dir", str(run_dir)],
                       capture_output=True, text=True, timeout=1200, env=_env(root), cwd=root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run_dir, r.stdout


def test_main_command_loss_falls(main_run):
    run_dir, out = main_run
    recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, 301))
    first, last = recs[0]["loss"], sum(r["loss"] for r in recs[-10:]) / 10
    assert last <= 0.8 * first, (first, last)
    assert recs[0]["tokens"] == 8 * 128 and recs[-1]["tokens"] == 300 * 8 * 128
    # warmup is 10% of 300 steps: lr rises for 30 steps, then decays
    lrs = [r["lr"] for r in recs]
    assert lrs[29] == pytest.approx(3e-3) and lrs[0] < lrs[10] < lrs[29] and lrs[-1] < lrs[100]
    for key in ("grad_norm", "tokens_per_s", "routing_entropy_min", "dead_experts", "max_mean_load_worst",
                "moe/1/entropy", "moe/7/dead"):
        assert key in recs[-1]
    assert "loss" in out and "[pretrain] done" in out
    # start-up figures ride on the first record only: process start -> imports -> setup -> end of step 1
    st = {k.split("/", 1)[1]: v for k, v in recs[0].items() if k.startswith("startup/")}
    assert not any(k.startswith("startup/") for k in recs[1])
    assert 0 < st["setup_started_s"] < st["setup_done_s"] < st["startup_s"], st
    assert 0 < st["build_s"] < st["setup_done_s"] and 0 < st["first_step_s"] < st["startup_s"], st
    assert st["graph_capture_s"] is None and "first step done" in out
    if "TRITON_CACHE_DIR" not in os.environ:  # the default kernel cache lives in the run directory
        assert (run_dir / "kernel_cache" / "triton").is_dir() and st["kernel_cache_files_before"] == 0


def test_main_command_wandb_offline_run_reads_back(main_run):
    run_dir, _ = main_run
    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    rows = read_wandb_history(files[0])
    recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert len(rows) == len(recs)
    assert [row["loss"] for row in rows] == pytest.approx([r["loss"] for r in recs])


def test_main_command_plots(main_run):
    run_dir, _ = main_run
    for name in ("loss.png", "routing.png"):
        data = open(run_dir / name, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def _pretrain(root, *args, timeout=300, nproc=None):
    cmd = [sys.executable, os.path.join(root, "launchers", "pretrain_k3.py"), *args]
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               "29611", os.path.join(root, "launchers", "pretrain_k3.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(root), cwd=root)


@pytest.mark.parametrize("args,needle", [
    (["--data-path", "/nonexistent/store"], "data path not found"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], "not divisible by micro batch x DP"),
    (["--preset", "k3-tiny", "--config", "configs/k3-tiny-cpu.yaml", "--lr-warmup-fraction", "1.5"], "warmup"),
    (["--cuda-graph-impl", "local"], "it needs a CUDA device"),
])
def test_bad_input_one_line(root, args, needle, tmp_path):
    r = _pretrain(root, "--run-dir", str(tmp_path), *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing ran


def test_tokenizer_vocab_mismatch(root, tmp_path, main_run):
    cfg = tmp_path / "small.yaml"
    cfg.write_text("model:\n  preset: k3-tiny\n  vocab_size: 256\n")
    store = os.path.join(root, "data", "cache", "python-docs-bpe512.zarr")  # built by the main run
    r = _pretrain(root, "--config", str(cfg), "--data-path", store, "--run-dir", str(tmp_path))
    assert r.returncode == 2 and "outside the embedding" in r.stderr and "Traceback" not in r.stderr


def test_two_ranks_tp2_sp(root, tmp_path, main_run):
    r = _pretrain(root, "--config", "configs/k3-tiny-cpu.yaml", "--tensor-model-parallel-size", "2",
                  "--sequence-parallel", "--train-iters", "6", "--run-dir", str(tmp_path), nproc=2, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(recs) == 6 and all(r["loss"] == r["loss"] for r in recs)
    # same data, same init, same math as the 1-rank main run: the first step's loss agrees
    run_dir, _ = main_run
    first = json.loads(open(run_dir / "metrics.jsonl").readline())
    assert recs[0]["lm_loss"] == pytest.approx(first["lm_loss"], rel=1e-5)


def test_uneven_pipeline_split(root, tmp_path, main_run):
    """--decoder-last-pipeline-num-layers 2 at PP2 (stages of 6 and 2 layers, whole AttnRes blocks) trains the
    same two first steps as the 1-rank main run; a split inside a block is refused before launch."""
    r = _pretrain(root, "--config", "configs/k3-tiny-cpu.yaml", "--pipeline-model-parallel-size", "2",
                  "--decoder-last-pipeline-num-layers", "2", "--exit-interval", "2", "--run-dir", str(tmp_path),
                  nproc=2, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    run_dir, _ = main_run
    ref = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][:2]
    assert [r["step"] for r in recs] == [1, 2]
    for a, b in zip(recs, ref):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
    bad = _pretrain(root, "--config", "configs/k3-tiny-cpu.yaml", "--pipeline-model-parallel-size", "2",
                    "--decoder-last-pipeline-num-layers", "3", "--run-dir", str(tmp_path / "bad"), nproc=2)
    assert bad.returncode != 0 and "split an Attention-Residual block" in bad.stderr


def test_muon_trainer_runs_and_learns(root, tmp_path, main_run):
    r = _pretrain(root, "--config", "configs/k3-tiny-cpu.yaml", "--optimizer", "muon", "--lr", "2e-2",
                  "--train-iters", "30", "--run-dir", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert recs[-1]["loss"] < 0.85 * recs[0]["loss"]


def test_probe_moe_on_the_main_run(root, main_run):
    run_dir, _ = main_run
    assert (run_dir / "final_weights.pt").exists()
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "probe_moe.py"), "--weights",
                        str(run_dir / "final_weights.pt"), "--preset", "k3-tiny", "--tokenizer",
                        os.path.join(root, "data", "tokenizer", "k3-tiny-bpe512.json"), "--data",
                        os.path.join(root, "data", "corpus", "python-docs-3.11.jsonl.gz"), "--windows-per-domain", "32",
                        "--json"], capture_output=True, text=True, timeout=300, env=_env(root))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["domains"] == {"tutorial": 32, "howto": 32, "faq": 32, "reference": 32}
    assert sorted(rep["layers"], key=int) == [str(i) for i in range(1, 8)]
    for layer in rep["layers"].values():
        assert 0 <= layer["entropy"] <= 1 and layer["js_within_domain_floor"] > 0
        assert layer["specialisation_ratio"] == pytest.approx(layer["js_cross_domain"] / layer["js_within_domain_floor"])


def test_js_divergence():
    import math

    import torch

    from megatron_k3.eval.probe import js_divergence

    a = torch.tensor([1.0, 2.0, 3.0, 0.0])
    assert js_divergence(a, a * 7) == pytest.approx(0.0, abs=1e-12)
    assert js_divergence(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == pytest.approx(math.log(2))


def test_mpiexec_two_ranks(root, tmp_path, main_run):
    """mpiexec -n 2 (MPICH from the mpich wheel): rank/world/local rank/master discovered through mpi4py."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, os.path.join(root, "launchers", "pretrain_k3.py"),
                        "--config", "configs/k3-tiny-cpu.yaml", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--train-iters", "6", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=600, env=_env(root), cwd=root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "layout TP2 PP1 EP1 CP1 DP1 +SP" in r.stdout
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    run_dir, _ = main_run
    first = json.loads(open(run_dir / "metrics.jsonl").readline())
    assert len(recs) == 6 and recs[0]["lm_loss"] == pytest.approx(first["lm_loss"], rel=1e-5)


def test_free_port_is_below_the_ephemeral_range():
    """Rendezvous ports come from below the kernel's ephemeral range (outgoing gloo sockets of a concurrent job
    cannot hold them) and are bindable when returned; a port that is taken is never returned."""
    import socket

    from megatron_k3.train.launch_env import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    held = []
    try:
        for _ in range(20):
            port = free_port(span=40)
            assert low - 40 <= port < low
            s = socket.socket()
            s.bind(("127.0.0.1", port))  # free when returned
            held.append(s)
        assert len({s.getsockname()[1] for s in held}) == len(held)  # a held port is never handed out again
    finally:
        for s in held:
            s.close()
