"""Checkpoints (checkpoints_io/k3ckpt.py) through the real trainer: bit-exact resume, resharding across
layouts, corruption detection, atomic pointer, retention, NaN refusal, weights-only checkpoints."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_k3.train.launch_env import free_port

TRAIN = ["--config", "configs/k3-tiny-cpu.yaml", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--wandb-mode", "disabled", "--log-interval", "1"]


def _env(root):
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.pop("WORLD_SIZE", None)
    return env


def run(root, *args, nproc=1, check=True):
    if nproc == 1:
        cmd = [sys.executable, os.path.join(root, "launchers", "pretrain_k3.py")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), os.path.join(root, "launchers", "pretrain_k3.py")]
    r = subprocess.run(cmd + TRAIN + [str(a) for a in args], capture_output=True, text=True, timeout=600,
                       env=_env(root), cwd=root)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def losses(run_dir):
    """step -> loss (the last record of a step wins: a resumed run appends)."""
    out = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def copy_upto(src, dst, step):
    """A save dir holding only ``src``'s checkpoint of ``step`` (as if the run had stopped there)."""
    os.makedirs(dst)
    shutil.copytree(os.path.join(src, f"iter_{step:07d}"), os.path.join(dst, f"iter_{step:07d}"))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(f"{step}\n")


def tree_digest(path):
    h = hashlib.sha256()
    for dp, _, fs in sorted(os.walk(path)):
        for f in sorted(fs):
            h.update(f.encode())
            h.update(open(os.path.join(dp, f), "rb").read())
    return h.hexdigest()


def assert_same_weights(a, b):
    A, B = torch.load(a), torch.load(b)
    assert A.keys() == B.keys()
    diff = [k for k in A if not torch.equal(A[k], B[k])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[0]}"


@pytest.fixture(scope="module")
def tp2pp2(root, tmp_path_factory):
    """6 steps at TP2 x PP2 (4 ranks), checkpoints at 3 and 6."""
    d = tmp_path_factory.mktemp("tp2pp2")
    run(root, "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2, "--train-iters", 6,
        "--save", d / "ckpt", "--save-interval", 3, "--run-dir", d / "run", nproc=4)
    return d


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", 1], ["--expert-model-parallel-size", 2,
                                                                          "--use-distributed-optimizer"]],
                         ids=["tp1pp1", "ep2-distopt"])
def test_reshard_tp2pp2_checkpoint(root, tp2pp2, tmp_path, layout):
    """Saved at TP2 x PP2, resumed at another layout: the next step's loss (same weights, same batch) equals
    the uninterrupted run's; the following steps (optimizer state resharded too) stay within fp32 round-off."""
    copy_upto(tp2pp2 / "ckpt", tmp_path / "ckpt", 3)
    nproc = 2 if "--expert-model-parallel-size" in layout else 1
    r = run(root, *layout, "--train-iters", 6, "--load", tmp_path / "ckpt", "--run-dir", tmp_path / "run",
            nproc=nproc)
    assert "resumed from" in r.stdout and "at step 3" in r.stdout
    ref, got = losses(tp2pp2 / "run"), losses(tmp_path / "run")
    assert sorted(got) == [4, 5, 6]
    assert got[4] == pytest.approx(ref[4], rel=1e-5)
    for s in (5, 6):
        assert got[s] == pytest.approx(ref[s], rel=1e-4)


@pytest.mark.parametrize("opt", [["--use-distributed-optimizer"], ["--optimizer", "muon", "--lr", "2e-2"]],
                         ids=["dp2-distopt", "dp2-muon"])
def test_resume_bit_exact_dp2(root, tmp_path, opt):
    """DP2: a run resumed from its step-3 checkpoint reproduces the uninterrupted losses and final weights bit
    for bit (distributed optimizer shards / Muon state, loader position, balancing bias, RNG)."""
    a, b = tmp_path / "a", tmp_path / "b"
    run(root, *opt, "--train-iters", 6, "--save", a / "ckpt", "--save-interval", 3, "--run-dir", a,
        "--export-weights", "w.pt", nproc=2)
    copy_upto(a / "ckpt", b / "ckpt", 3)
    run(root, *opt, "--train-iters", 6, "--load", b / "ckpt", "--save", b / "ckpt", "--run-dir", b,
        "--export-weights", "w.pt", nproc=2)
    la, lb = losses(a), losses(b)
    assert sorted(lb) == [4, 5, 6] and all(la[s] == lb[s] for s in lb), (la, lb)
    assert_same_weights(a / "w.pt", b / "w.pt")
    assert (b / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


@pytest.fixture(scope="module")
def single(root, tmp_path_factory):
    """World of one, 6 steps, a checkpoint every 2 steps, keep the last 2."""
    d = tmp_path_factory.mktemp("single")
    run(root, "--train-iters", 6, "--save", d / "ckpt", "--save-interval", 2, "--ckpt-keep-last", 2,
        "--run-dir", d / "run")
    return d


def test_retention_and_latest(single):
    ck = single / "ckpt"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000004", "iter_0000006", "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    meta = json.loads((ck / "iter_0000006" / "k3_checkpoint.json").read_text())
    assert meta["step"] == 6 and meta["consumed_tokens"] == 6 * 4 * 128 and meta["loader"]["cursor"] == 24
    assert {".metadata", "metadata.json", "__0_0.distcp"} <= set(meta["files"])
    assert meta["optimizer_states"]["model.embed_tokens.weight"] == ["exp_avg", "exp_avg_sq"]


def test_stock_reader_reads_the_files(single):
    """The O_DIRECT writer's files are ordinary DCP files: the stock FileSystemReader loads a tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    d = str(single / "ckpt" / "iter_0000006")
    md = FileSystemReader(d).read_metadata().state_dict_metadata
    assert "model.embed_tokens.weight" in md and "optimizer.exp_avg.lm_head.weight" in md
    out = {"lm_head.weight": torch.empty(tuple(md["lm_head.weight"].size))}
    dcp.load(out, storage_reader=FileSystemReader(d), no_dist=True)
    assert torch.isfinite(out["lm_head.weight"]).all() and out["lm_head.weight"].abs().sum() > 0


def _corrupt(kind, d):
    it = d / "iter_0000006"
    if kind == "truncated shard":
        f = it / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return f
    if kind == "flipped bytes":
        f = it / "__0_0.distcp"
        b = bytearray(f.read_bytes())
        b[len(b) // 3] ^= 0xFF
        f.write_bytes(bytes(b))
        return f
    if kind == "missing metadata":
        (it / ".metadata").unlink()
        return it / ".metadata"
    if kind == "incomplete (no k3_checkpoint.json)":
        (it / "k3_checkpoint.json").unlink()
        return it / "k3_checkpoint.json"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated shard", "flipped bytes", "missing metadata",
                                  "incomplete (no k3_checkpoint.json)"])
def test_corruption_is_named_and_nothing_is_touched(single, tmp_path, kind):
    from checkpoints_io.k3ckpt import CheckpointError, read_weights

    d = tmp_path / "ckpt"
    shutil.copytree(single / "ckpt", d)
    bad = _corrupt(kind, d)
    before = tree_digest(d)
    with pytest.raises(CheckpointError) as e:
        read_weights(d)
    assert str(bad) in str(e.value)
    assert tree_digest(d) == before
    meta, names, get = read_weights(d / "iter_0000004")  # the older checkpoint still loads
    assert meta["step"] == 4 and get(["lm_head.weight"])["lm_head.weight"].shape == names["lm_head.weight"][0]


def test_trainer_refuses_corrupt_and_mismatched_checkpoints(root, single, tmp_path):
    """Through the trainer: a flipped byte and a different model config are clear one-line errors (exit 2)
    naming the file; the save directory is unchanged; the older checkpoint resumes."""
    d = tmp_path / "ckpt"
    shutil.copytree(single / "ckpt", d)
    bad = _corrupt("flipped bytes", d)
    before = tree_digest(d)
    r = run(root, "--train-iters", 8, "--load", d, "--save", d, "--run-dir", tmp_path / "r1", check=False)
    assert r.returncode == 2 and f"error: {bad}: CRC32 mismatch" in r.stderr, r.stderr[-2000:]
    assert tree_digest(d) == before
    r = run(root, "--train-iters", 8, "--load", d / "iter_0000004", "--mtp-num-layers", 2, "--run-dir",
            tmp_path / "r2", check=False)
    assert r.returncode == 2 and "k3_checkpoint.json: saved for another model" in r.stderr, r.stderr[-2000:]
    assert "num_nextn_predict_layers" in r.stderr
    r = run(root, "--train-iters", 6, "--load", d / "iter_0000004", "--run-dir", tmp_path / "r3")
    assert "at step 4" in r.stdout
    ref = losses(single / "run")
    assert losses(tmp_path / "r3") == {5: ref[5], 6: ref[6]}


def test_nan_weights_are_never_written(tmp_path):
    from checkpoints_io.k3ckpt import CheckpointError, write_weights
    from megatron_k3.config import get_preset
    from megatron_k3.model import K3ForCausalLM

    cfg = get_preset("k3-tiny")
    sd = K3ForCausalLM(cfg, seed=0).state_dict()
    sd["lm_head.weight"][0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="NaN"):
        write_weights(tmp_path / "w", sd, cfg)
    assert not (tmp_path / "w").exists()


def test_weights_only_checkpoint_round_trip_and_trainer_load(root, tmp_path):
    """write_weights -> read_weights is exact; the trainer's --load starts from those weights (fresh optimizer)."""
    from checkpoints_io.k3ckpt import read_weights, write_weights
    from megatron_k3.config import get_preset
    from megatron_k3.model import K3ForCausalLM

    cfg = get_preset("k3-tiny")
    sd = K3ForCausalLM(cfg, seed=1234).state_dict()
    write_weights(tmp_path / "w", sd, cfg, tokenizer={"file": "x"})
    meta, names, get = read_weights(tmp_path / "w")
    assert meta["weights_only"] and set(names) == set(sd)
    back = get(list(names))
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    # the trainer initialises with seed 1234 too: starting from these weights gives the from-scratch loss
    r = run(root, "--train-iters", 10, "--exit-interval", 1, "--load", tmp_path / "w", "--run-dir", tmp_path / "r")
    assert "weights only" in r.stdout
    r2 = run(root, "--train-iters", 10, "--exit-interval", 1, "--run-dir", tmp_path / "r2")
    assert losses(tmp_path / "r") == losses(tmp_path / "r2")


def test_sigkill_at_random_moments_under_the_supervisor(root, tmp_path):
    """A k3-tiny run is SIGKILLed 10 times (at random moments of training and, every third time, in the middle
    of a checkpoint write) and restarted by launchers/supervisor.py each time: the per-step losses and the
    final weights equal an uninterrupted run bit for bit, and `latest` always names a complete, verified
    checkpoint."""
    import random
    import time

    import psutil

    from checkpoints_io.k3ckpt import read_meta, resolve, verify_files

    steps, n_kills = 30, 10
    common = ["--train-iters", steps, "--export-weights", "w.pt"]
    run(root, *common, "--run-dir", tmp_path / "ref")
    save, metrics = tmp_path / "ckpt", tmp_path / "run" / "metrics.jsonl"
    # The give-up budget is larger than the number of kills: how many of them land before the next save
    # completes depends on this machine's speed, and the budget's own logic is tests/train/test_supervisor.py's.
    cmd = [sys.executable, os.path.join(root, "launchers", "supervisor.py"), "--max-failures", str(n_kills + 1),
           "--backoff", "0.1", "--save", str(save), "--", sys.executable, os.path.join(root, "launchers", "pretrain_k3.py"),
           *TRAIN, *map(str, common), "--run-dir", str(tmp_path / "run"), "--save", str(save), "--load", str(save),
           "--save-interval", "2"]
    # Output goes to a file, not a pipe: nobody reads a pipe while the kills run, and once its 64 KiB buffer is
    # full the trainer blocks in print() and stops making progress (the cause of a CI timeout, 2026-12-04).
    log = tmp_path / "supervisor.log"
    sup = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, env=_env(root), cwd=root)
    rng = random.Random(0)
    kills, mid_write = 0, 0

    def n_lines():
        return sum(1 for _ in open(metrics)) if metrics.exists() else 0

    def tmp_dirs():  # a .tmp dir can be renamed to iter_* between the glob and the stat: skip it then
        found = set()
        for p in save.glob("iter_*.tmp") if save.exists() else ():
            try:
                found.add((p.name, p.stat().st_ino))
            except FileNotFoundError:
                pass
        return found

    deadline = time.time() + 900  # a bound for a stuck run, not a timing claim (two test workers share the cores)
    while kills < n_kills and sup.poll() is None and time.time() < deadline:
        try:
            kids = psutil.Process(sup.pid).children()
        except psutil.NoSuchProcess:
            break
        if not kids:
            time.sleep(0.02)
            continue
        c, lines0, old_tmp = kids[0], n_lines(), tmp_dirs()
        while n_lines() == lines0 and c.is_running() and time.time() < deadline:  # until it trains
            time.sleep(0.01)
        if kills % 3 == 2:  # kill in the middle of the next checkpoint write
            while not (tmp_dirs() - old_tmp) and c.is_running() and time.time() < deadline:
                time.sleep(0.002)
            mid_write += bool(tmp_dirs() - old_tmp)
        else:
            time.sleep(rng.uniform(0.0, 3.0))
        try:
            c.kill()
            c.wait(10)
        except psutil.NoSuchProcess:
            continue
        kills += 1
        if (save / "latest_checkpointed_iteration.txt").exists():  # latest names a complete, intact checkpoint
            d = resolve(save)
            assert verify_files(d, read_meta(d)) == []
    sup.wait(timeout=600)
    out = log.read_text()
    assert sup.returncode == 0, out[-4000:]
    assert kills == n_kills and mid_write >= 3, (kills, mid_write, out[-3000:])
    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "run")
    assert sorted(got) == list(range(1, steps + 1))
    assert all(got[s] == ref[s] for s in ref), [(s, ref[s], got[s]) for s in ref if got[s] != ref[s]][:3]
    assert_same_weights(tmp_path / "ref" / "w.pt", tmp_path / "run" / "w.pt")


@pytest.mark.parametrize("opt", [["--optimizer-offload", "host-stream"], ["--bf16"]], ids=["host-stream", "bf16"])
def test_resume_bit_exact_world1(root, tmp_path, opt):
    """--optimizer-offload host-stream (host-side master weights and bf16 moments) and --bf16 (megatron's fp32
    master copies; the router bias kept fp32 before the checkpoint is loaded): the resumed run equals the
    uninterrupted one bit for bit."""
    a, b = tmp_path / "a", tmp_path / "b"
    opt = [*opt, "--train-iters", 6, "--export-weights", "w.pt"]
    run(root, *opt, "--save", a / "ckpt", "--save-interval", 3, "--run-dir", a)
    copy_upto(a / "ckpt", b / "ckpt", 3)
    run(root, *opt, "--load", b / "ckpt", "--run-dir", b)
    la, lb = losses(a), losses(b)
    assert sorted(lb) == [4, 5, 6] and all(la[s] == lb[s] for s in lb), (la, lb)
    assert_same_weights(a / "w.pt", b / "w.pt")


def test_resolve_ignores_leftovers_of_an_unfinished_first_save(tmp_path):
    """A run killed during its first save leaves only ``iter_*.tmp``: the save dir holds no checkpoint (the
    restarted run starts from scratch); an ``iter_*`` without its metadata file (not written by a save) and
    without the ``latest`` pointer is refused; a complete ``iter_*`` without the pointer (killed between the
    rename and the pointer) is resumed, the newest first. (Found by the SIGKILL test.)"""
    from checkpoints_io.k3ckpt import META, CheckpointError, resolve

    (tmp_path / "iter_0000002.tmp").mkdir()
    assert resolve(tmp_path) is None
    (tmp_path / "iter_0000002").mkdir()
    with pytest.raises(CheckpointError, match="holds checkpoint directories without"):
        resolve(tmp_path)
    (tmp_path / "iter_0000002" / META).write_text("{}")
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000004" / META).write_text("{}")
    assert resolve(tmp_path) == str(tmp_path / "iter_0000004")


@pytest.mark.parametrize("layout,nproc", [([], 2), (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4)],
                         ids=["dp2", "tp2xdp2"])
def test_distributed_optimizer_save_and_load_move_no_state(root, layout, nproc):
    """With the distributed optimizer each rank writes and reads only its own flat ranges of the optimizer
    state (boxes at their global offsets under the HF names): every tensor collective during the save and the
    load carries at most a few numbers (the rest are pickled plans and metadata), where the previous format
    all-reduced the whole optimizer state over the data-parallel group; the loaded weights are the saved ones."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), os.path.join(root, "tests", "helpers", "ckpt_collectives_check.py"), *layout,
           "--global-batch-size", str(2 * nproc)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(root), cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    dec = json.JSONDecoder()  # the first JSON object after each "RESULT " (other ranks' output may follow it)
    res = [dec.raw_decode(part)[0] for part in r.stdout.split("RESULT ")[1:]]
    assert sorted(x["rank"] for x in res) == list(range(nproc)), r.stdout[-2000:]
    for x in res:
        assert x["optimizer_state_elems"] > 100_000 and x["n_save"] > 0 and x["n_load"] > 0, x
        assert x["max_numbers_save"] <= 16 and x["max_numbers_load"] <= 16, x
        assert x["weights_unchanged"], x


def test_kill9_during_async_write_keeps_previous_checkpoint(root, tmp_path):
    """The background write of step 4 is slowed (--ckpt-write-limit-mbps) and the trainer is SIGKILLed while
    it runs: ``latest`` still names step 2, no iter_0000004 exists (only its .tmp), and a new run resumes
    from step 2."""
    ck = tmp_path / "ck"
    args = ["--train-iters", "8", "--save", ck, "--load", ck, "--save-interval", "2", "--ckpt-write-limit-mbps", "0.5",
            "--run-dir", tmp_path / "run"]
    cmd = [sys.executable, os.path.join(root, "launchers", "pretrain_k3.py")] + TRAIN + [str(a) for a in args]
    p = subprocess.Popen(cmd, stdout=open(tmp_path / "train.log", "w"), stderr=subprocess.STDOUT, env=_env(root),
                         cwd=root)  # a file: an unread pipe would fill and stall the trainer
    tracker, tmp4 = ck / "latest_checkpointed_iteration.txt", ck / "iter_0000004.tmp"
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if tracker.exists() and tracker.read_text().strip() == "2" and tmp4.is_dir() and any(tmp4.glob("*.distcp")):
            break
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before the write of step 4 could be interrupted"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert tracker.read_text().strip() == "2" and not (ck / "iter_0000004").exists()
    r = run(root, "--train-iters", 3, "--load", ck, "--run-dir", tmp_path / "run2")
    assert "resumed from" in r.stdout and "at step 2" in r.stdout
