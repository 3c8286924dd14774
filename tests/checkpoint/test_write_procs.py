"""Writer processes of the asynchronous save (checkpoints_io/write_procs.py, ``--ckpt-write-workers processes``):
the same files as the writer threads, byte for byte; a ``kill -9`` of the trainer takes its writers with it and
keeps the previous checkpoint; a worker's write error is the trainer's one-line save error."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.checkpoint.test_checkpoint import TRAIN, _env, copy_upto, losses, run


def _files(d):
    """The data files of a checkpoint directory (k3_checkpoint.json names the run; .metadata is compared
    unpickled: the same values, though objects the threads share arrive from the processes as copies, which
    pickle encodes differently)."""
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))
            if f not in ("k3_checkpoint.json", ".metadata")}


def _dcp_metadata(d):
    from torch.distributed.checkpoint import FileSystemReader

    m = FileSystemReader(str(d)).read_metadata()
    return m.state_dict_metadata, m.storage_data


@pytest.mark.parametrize("nproc,layout", [(1, []), (2, ["--use-distributed-optimizer"])], ids=["world1", "dp2-distopt"])
def test_processes_write_the_files_the_threads_write(root, tmp_path, nproc, layout):
    """Two identical runs, one writing with threads, one with processes (each rank its own writers, started from
    the local plan: ``test_files_start_from_the_local_plan``): every
    .distcp and metadata.json of the step-3 checkpoint is byte-identical and DCP's metadata holds the same
    values; resuming from the processes' checkpoint gives the uninterrupted run's losses exactly."""
    args = ["--train-iters", 5, "--save-interval", 3, "--ckpt-write-threads", 3, *layout]
    run(root, *args, "--save", tmp_path / "t", "--ckpt-write-workers", "threads", "--run-dir", tmp_path / "rt",
        nproc=nproc)
    rp = run(root, *args, "--save", tmp_path / "p", "--ckpt-write-workers", "processes", "--run-dir", tmp_path / "rp",
             nproc=nproc)
    assert "saved step 3" in rp.stdout and "files started from the local plan" in rp.stdout, rp.stdout[-2000:]
    a, b = _files(tmp_path / "t" / "iter_0000003"), _files(tmp_path / "p" / "iter_0000003")
    assert sorted(a) == sorted(b) and sum(f.endswith(".distcp") for f in a) == 3 * nproc, (sorted(a), sorted(b))
    assert [f for f in a if a[f] != b[f]] == []
    ma, mb = _dcp_metadata(tmp_path / "t" / "iter_0000003"), _dcp_metadata(tmp_path / "p" / "iter_0000003")
    assert ma[0] == mb[0] and ma[1] == mb[1] and len(mb[1]) > 100
    copy_upto(tmp_path / "p", tmp_path / "b", 3)
    r = run(root, "--train-iters", 5, *layout, "--load", tmp_path / "b", "--run-dir", tmp_path / "rb", nproc=nproc)
    assert "at step 3" in r.stdout
    lp, lb = losses(tmp_path / "rp"), losses(tmp_path / "rb")
    assert sorted(lb) == [4, 5] and all(lp[s] == lb[s] for s in lb), (lp, lb)


def test_kill9_takes_the_writer_processes_along(root, tmp_path):
    """SIGKILL of the trainer while its (slowed) writer processes write step 4: the writers exit too (no
    orphan keeps writing), ``latest`` still names step 2 and a new run resumes from it."""
    ck = tmp_path / "ck"
    args = ["--train-iters", "8", "--save", ck, "--load", ck, "--save-interval", "2", "--ckpt-write-limit-mbps", "0.5",
            "--ckpt-write-workers", "processes", "--ckpt-write-threads", "2", "--run-dir", tmp_path / "run"]
    cmd = [sys.executable, os.path.join(root, "launchers", "pretrain_k3.py")] + TRAIN + [str(a) for a in args]
    p = subprocess.Popen(cmd, stdout=open(tmp_path / "train.log", "w"), stderr=subprocess.STDOUT, env=_env(root),
                         cwd=root)
    tracker, tmp4 = ck / "latest_checkpointed_iteration.txt", ck / "iter_0000004.tmp"
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if tracker.exists() and tracker.read_text().strip() == "2" and tmp4.is_dir() and any(tmp4.glob("*.distcp")):
            break
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before the write of step 4 could be interrupted"
    writers = [c for c in psutil.Process(p.pid).children() if "_worker_main" in " ".join(c.cmdline())]
    assert len(writers) == 2, [c.cmdline() for c in psutil.Process(p.pid).children()]
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    gone, alive = psutil.wait_procs(writers, timeout=10)
    assert not alive, f"writer processes outlived the trainer: {[w.pid for w in alive]}"
    assert tracker.read_text().strip() == "2" and not (ck / "iter_0000004").exists()
    r = run(root, "--train-iters", 3, "--load", ck, "--run-dir", tmp_path / "run2")
    assert "resumed from" in r.stdout and "at step 2" in r.stdout


def test_a_dead_writer_is_the_save_error(root, tmp_path):
    """A writer process that dies during a (slowed) write of step 4 makes that save fail with one line naming
    the step and the checkpoint ``latest`` still names, which stays byte-identical."""
    ck = tmp_path / "ck"
    run(root, "--train-iters", 2, "--save", ck, "--save-interval", 2, "--run-dir", tmp_path / "r0")
    before = {q: q.read_bytes() for q in ck.rglob("*") if q.is_file()}
    cmd = [sys.executable, os.path.join(root, "launchers", "pretrain_k3.py")] + TRAIN + [
        "--train-iters", "4", "--save", str(ck), "--load", str(ck), "--save-interval", "4",
        "--ckpt-write-limit-mbps", "0.5", "--ckpt-write-workers", "processes", "--ckpt-write-threads", "2",
        "--run-dir", str(tmp_path / "r1")]
    p = subprocess.Popen(cmd, stdout=open(tmp_path / "out.log", "w"), stderr=open(tmp_path / "err.log", "w"),
                         env=_env(root), cwd=root)
    tmp4 = ck / "iter_0000004.tmp"
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and not (tmp4.is_dir() and any(tmp4.glob("*.distcp"))):
        time.sleep(0.05)
    writers = [c for c in psutil.Process(p.pid).children() if "_worker_main" in " ".join(c.cmdline())]
    assert len(writers) == 2
    writers[0].kill()
    assert p.wait(timeout=300) == 1
    err = (tmp_path / "err.log").read_text()
    errs = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errs) == 1 and "Traceback" not in err, err[-3000:]
    assert "saving step 4" in errs[0] and "latest still names step 2" in errs[0] and "exited" in errs[0], errs
    assert {q: q.read_bytes() for q in before} == before
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux memfd")
def test_shared_buffer_grows_and_locates_tensors():
    """The staging buffer grows in place (same memfd) and tells which tensors lie inside it."""
    import torch

    from checkpoints_io.write_procs import SharedBuffer

    b = SharedBuffer(4096)
    t = torch.frombuffer(memoryview(b.mm)[128:128 + 64], dtype=torch.float32)
    assert b.offset_of(t) == 128 and b.offset_of(torch.zeros(4)) is None
    b.ensure(1 << 20)
    assert b.size == 1 << 20 and os.fstat(b.fd).st_size == 1 << 20
    b.close()


def _staged_save(path, pool, shared, tensors, mismatch=False):
    """A DCP save (single process, no process group) of ``tensors`` copied into ``shared``, written by ``pool``
    with the early start; ``mismatch``: the global plan names the files otherwise than the local plan predicted."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from checkpoints_io.odirect import checksumming_writer
    from checkpoints_io.write_procs import pooled

    shared.ensure(sum(t.numel() * 4 for t in tensors.values()) + 4096)
    sd, off = {}, 0
    for k, t in tensors.items():
        n = t.numel() * 4
        sd[k] = torch.frombuffer(memoryview(shared.mm)[off:off + n], dtype=torch.float32).view(t.shape)
        sd[k].copy_(t)
        off += n
    planner = DefaultSavePlanner()
    writer = pooled(checksumming_writer(str(path), "odirect", thread_count=3), pool, "odirect", planner=planner)
    if mismatch:
        import dataclasses

        from torch.distributed.checkpoint.filesystem import _StoragePrefix

        writer.prepare_global_plan = lambda plans: [dataclasses.replace(p, storage_data=_StoragePrefix(f"__9{i}_"))
                                                    for i, p in enumerate(plans)]
    dcp.save(sd, storage_writer=writer, planner=planner)
    return writer


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux memfd")
@pytest.mark.parametrize("mismatch", [False, True], ids=["early", "another-plan"])
def test_files_start_from_the_local_plan(tmp_path, mismatch):
    """The writer processes start the files from the local plan, before DCP's global plan: when the global plan
    names the same files they are DCP's result (``early_write``) and the checkpoint is byte for byte the one the
    writer threads write; when it does not, the early files are removed and the final plan is written."""
    import torch
    import torch.distributed.checkpoint as dcp

    from checkpoints_io.odirect import checksumming_writer
    from checkpoints_io.write_procs import SharedBuffer, WriterPool

    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(17 + i, 33, generator=g) for i in range(40)}
    shared = SharedBuffer(0)
    pool = WriterPool(2, shared)
    pool.start()
    try:
        w = _staged_save(tmp_path / "p", pool, shared, tensors, mismatch)
    finally:
        pool.close()
        shared.close()
    threads = checksumming_writer(str(tmp_path / "t"), "odirect", thread_count=3)
    dcp.save({k: v.clone() for k, v in tensors.items()}, storage_writer=threads)
    assert w.early_write is (not mismatch)
    names = sorted(f for f in os.listdir(tmp_path / "p") if f.endswith(".distcp"))
    assert names == ([f"__0_{i}.distcp" for i in range(3)] if not mismatch else [f"__90_{i}.distcp" for i in range(3)])
    assert sorted(k for k in w.fs.digests if k.endswith(".distcp")) == names  # no digest of a removed file
    if not mismatch:
        a, b = _files(tmp_path / "p"), _files(tmp_path / "t")
        assert sorted(a) == sorted(b) and [f for f in a if a[f] != b[f]] == []
        assert _dcp_metadata(tmp_path / "p") == _dcp_metadata(tmp_path / "t")
    back = {k: torch.zeros_like(v) for k, v in tensors.items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "p"))
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
