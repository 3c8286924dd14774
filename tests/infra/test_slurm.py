"""slurm/pretrain_k3.sh on a real local Slurm cluster (tools/slurm_local.sh): CPU profile, k3-tiny, 2 nodes x 1
task (gloo, world 2). The job is requeued once it has a checkpoint (Slurm SIGTERMs it: the trainer saves on
the signal and the requeued job resumes from that step), then one srun step is SIGKILLed after a later
periodic checkpoint (the supervisor restarts the step in the same allocation from that checkpoint and the
steps since it run again). Checked: both resumes are logged, every step 1..40 is in metrics.jsonl, and the
re-run steps reproduce the first run's losses bit for bit (resume is exact on CPU).

Skipped only when the Slurm daemons are not installed (CI installs them: see .ci/run).
"""
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("sinfo") is None or shutil.which("slurmctld") is None
                                and not os.path.exists("/usr/sbin/slurmctld"),
                                reason="Slurm not installed (apt-get install slurmctld slurmd slurm-client munge)")

ITERS = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, K3_SLURM_DIR=str(state), K3_SLURM_PORT=os.environ.get("K3_TEST_SLURM_PORT", "16917"))
    r = subprocess.run(["bash", str(ROOT / "tools/slurm_local.sh"), "start"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    env["SLURM_CONF"] = str(state / "slurm.conf")
    yield env
    r = subprocess.run(["bash", str(ROOT / "tools/slurm_local.sh"), "stop"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _run(cmd, env, **kw):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, **kw)


def _wait(cond, what, timeout, job_log=None):
    t0 = time.time()
    while True:
        v = cond()
        if v:
            return v
        if time.time() - t0 > timeout:
            tail = "\n".join(Path(job_log).read_text().splitlines()[-40:]) if job_log and Path(job_log).exists() else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tail}")
        time.sleep(0.5)


def _latest(ckpt):
    try:
        return int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    except (OSError, ValueError):
        return 0


def _metrics(run):
    p = run / "metrics.jsonl"
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return rows


def _job(jid, env):
    out = _run(["scontrol", "show", "job", jid], env).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return fields


def test_sbatch_requeue_and_crash_resume(cluster, tmp_path):
    env = dict(cluster, K3_PROFILE="cpu", K3_RUN_DIR=str(tmp_path / "run"), K3_BACKOFF="1", K3_HOME=str(ROOT))
    run, ckpt, log = tmp_path / "run", tmp_path / "run" / "ckpt", tmp_path / "job.out"
    r = _run(["sbatch", "--parsable", "--job-name=k3-test", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0",
              "--time=00:20:00", f"--output={log}", str(ROOT / "slurm/pretrain_k3.sh"),
              "--train-iters", str(ITERS), "--save-interval", "10", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--log-interval", "1", "--wandb-mode", "disabled"], env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    jid = r.stdout.strip().split(";")[0]
    try:
        # 1. requeue once a checkpoint exists: SIGTERM -> the trainer saves and exits 3; Slurm requeues
        _wait(lambda: _latest(ckpt) >= 10, "the first checkpoint", 300, log)
        assert _run(["scontrol", "requeue", jid], env).returncode == 0
        _wait(lambda: _job(jid, env).get("Restarts") == "1" and _job(jid, env).get("JobState") == "RUNNING",
              "the requeued job to run", 120, log)
        resumed = _wait(lambda: [l for l in log.read_text().splitlines() if "[pretrain] resumed from" in l],
                        "the resume after requeue", 180, log)
        step_a = int(resumed[0].split(" at step ")[1].split()[0])
        assert step_a >= 10

        # 2. crash: SIGKILL the running srun step after a later periodic checkpoint and a few more steps
        target = (step_a // 10 + 1) * 10
        _wait(lambda: _latest(ckpt) >= target and max((m["step"] for m in _metrics(run)), default=0) >= target + 2,
              f"checkpoint {target} and two more steps", 240, log)
        steps = _run(["squeue", "-h", "-s", "-j", jid, "-o", "%i"], env).stdout.split()
        step_ids = [s for s in steps if s.startswith(f"{jid}.") and s.split(".")[1].isdigit()]
        assert step_ids, steps
        before_kill = max(m["step"] for m in _metrics(run))
        assert _run(["scancel", "--signal=KILL", step_ids[-1]], env).returncode == 0
        _wait(lambda: _job(jid, env).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
              "the job to end", 300, log)
    finally:
        _run(["scancel", jid], env)
    text = log.read_text()
    assert _job(jid, env).get("JobState") == "COMPLETED", text[-3000:]

    # the supervisor restarted the step from the periodic checkpoint, in the same allocation
    assert "attempt 2: starting (resuming from checkpoint step" in text, text[-3000:]
    resumes = [l for l in text.splitlines() if "[pretrain] resumed from" in l]
    assert len(resumes) == 2, resumes
    step_b = int(resumes[1].split(" at step ")[1].split()[0])
    assert step_b >= target

    # every step present; re-run steps bit-identical to their first run
    rows = _metrics(run)
    first = {}
    for m in rows:
        if m["step"] in first:
            assert m["loss"] == first[m["step"]], f"step {m['step']}: {m['loss']!r} after resume vs {first[m['step']]!r}"
        else:
            first[m["step"]] = m["loss"]
    assert sorted(first) == list(range(1, ITERS + 1))
    counts = [m["step"] for m in rows]
    assert step_b < before_kill, (step_b, before_kill)
    assert all(counts.count(s) == 2 for s in range(step_b + 1, before_kill + 1)), \
        "the steps after the crash checkpoint should have run twice"
    assert _latest(ckpt) == ITERS
