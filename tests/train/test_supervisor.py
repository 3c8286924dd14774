"""launchers/supervisor.py against a fake trainer: restart budget, progress, signal forwarding, exit code 3.

The fake trainer (written per test) plays the real one's checkpoint interface: ``--save DIR`` holds
``latest_checkpointed_iteration.txt``; each attempt reads its behaviour from a plan file by attempt number.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUP = os.path.join(ROOT, "launchers", "supervisor.py")

FAKE = textwrap.dedent(r'''
    import json, os, signal, sys, time
    save = sys.argv[sys.argv.index("--save") + 1]
    plan = json.load(open(sys.argv[sys.argv.index("--plan") + 1]))
    os.makedirs(save, exist_ok=True)
    n_file = os.path.join(save, "attempts")
    n = int(open(n_file).read()) + 1 if os.path.exists(n_file) else 1
    open(n_file, "w").write(str(n))
    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    step = int(open(tracker).read()) if os.path.exists(tracker) else 0
    act = plan[min(n, len(plan)) - 1]

    def save_ckpt(s):
        open(tracker + ".tmp", "w").write(str(s))
        os.replace(tracker + ".tmp", tracker)

    if act.get("wait"):
        def on_signal(signum, frame):
            open(os.path.join(save, "got_signal"), "w").write(signal.Signals(signum).name)
            save_ckpt(step + 1)
            # os._exit, not sys.exit: the test signals as soon as "ready" exists, which can be while the
            # unreferenced file object below is being closed; a SystemExit raised inside that implicit
            # close is reported as unraisable and dropped by CPython, and the fake then slept on (flaky)
            os._exit(3)
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, on_signal)
        open(os.path.join(save, "ready"), "w").write("1")
        time.sleep(60)
        sys.exit(9)
    if act.get("advance"):
        save_ckpt(step + act["advance"])
    if act.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(act.get("rc", 0))
''')


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE)
    save = tmp_path / "ckpt"

    def cmd(plan, *sup_args, env=None):
        planf = tmp_path / "plan.json"
        planf.write_text(json.dumps(plan))
        return [sys.executable, SUP, "--backoff", "0", *sup_args, "--",
                sys.executable, str(script), "--save", str(save), "--plan", str(planf)]

    return cmd, save


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(extra)
    return env


def attempts(save):
    return int((save / "attempts").read_text())


def test_success_first_time(fake):
    cmd, save = fake
    r = subprocess.run(cmd([{"advance": 5, "rc": 0}]), capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    assert attempts(save) == 1
    assert "no checkpoint: from scratch" in r.stderr


def test_gives_up_after_n_failures_without_progress(fake):
    cmd, save = fake
    r = subprocess.run(cmd([{"rc": 1}], "--max-failures", "2"), capture_output=True, text=True, env=_env(),
                       timeout=60)
    assert r.returncode == 1
    assert attempts(save) == 2
    last = r.stderr.strip().splitlines()[-1]
    assert "giving up: 2 consecutive failure(s) without checkpoint progress" in last, r.stderr


def test_progress_keeps_the_budget(fake):
    cmd, save = fake
    plan = [{"advance": 10, "rc": 1}] * 5 + [{"advance": 10, "rc": 0}]
    r = subprocess.run(cmd(plan, "--max-failures", "2"), capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    assert attempts(save) == 6
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "60"
    assert "attempt 6: starting (resuming from checkpoint step 50)" in r.stderr


def test_progress_then_stall_gives_up(fake):
    """Budget is per run of consecutive no-progress failures: progress, then 2 stalls with N=2."""
    cmd, save = fake
    plan = [{"advance": 10, "rc": 1}, {"rc": 1}, {"kill": True}]
    r = subprocess.run(cmd(plan, "--max-failures", "2"), capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 128 + signal.SIGKILL
    assert attempts(save) == 3
    assert "killed by SIGKILL" in r.stderr


def _start_waiting(cmd, save, env):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    t0 = time.time()
    while not (save / "ready").exists():
        assert time.time() - t0 < 30 and p.poll() is None, "fake trainer did not start"
        time.sleep(0.05)
    return p


def test_sigterm_reaches_the_child_locally(fake):
    cmd, save = fake
    p = _start_waiting(cmd([{"wait": True}]), save, _env())
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert (save / "got_signal").read_text() == "SIGTERM"
    assert p.returncode == 3, err  # saved on signal, local: exit 3, no restart
    assert attempts(save) == 1


@pytest.fixture
def fake_scontrol(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "scontrol_calls"
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bindir / "scontrol").chmod(0o755)
    return bindir, calls


def test_exit_3_requeues_under_slurm(fake, fake_scontrol):
    cmd, save = fake
    bindir, calls = fake_scontrol
    env = _env(SLURM_JOB_ID="4242", PATH=f"{bindir}:{os.environ['PATH']}")
    r = subprocess.run(cmd([{"advance": 7, "rc": 3}]), capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert calls.read_text().split() == ["requeue", "4242"]
    assert attempts(save) == 1
    # without Slurm: exit 3, nothing requeued
    calls.unlink()
    r = subprocess.run(cmd([{"advance": 7, "rc": 3}]), capture_output=True, text=True,
                       env=_env(PATH=env["PATH"]), timeout=60)
    assert r.returncode == 3 and not calls.exists()
    # --no-requeue-on-signal under Slurm: exit 3
    r = subprocess.run(cmd([{"rc": 3}], "--no-requeue-on-signal"), capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 3 and not calls.exists()


def test_usr1_under_slurm_saves_and_requeues(fake, fake_scontrol):
    cmd, save = fake
    bindir, calls = fake_scontrol
    env = _env(SLURM_JOB_ID="77", PATH=f"{bindir}:{os.environ['PATH']}")
    p = _start_waiting(cmd([{"wait": True}]), save, env)
    p.send_signal(signal.SIGUSR1)
    out, err = p.communicate(timeout=30)
    assert (save / "got_signal").read_text() == "SIGUSR1"
    assert p.returncode == 0, err
    assert calls.read_text().split() == ["requeue", "77"]


def test_sigterm_under_slurm_does_not_requeue(fake, fake_scontrol):
    """scancel sends SIGTERM: the child saves and exits 3, but a cancelled job must not come back."""
    cmd, save = fake
    bindir, calls = fake_scontrol
    env = _env(SLURM_JOB_ID="78", PATH=f"{bindir}:{os.environ['PATH']}")
    p = _start_waiting(cmd([{"wait": True}]), save, env)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 3, err
    assert not calls.exists()


def test_bad_usage():
    r = subprocess.run([sys.executable, SUP, "--max-failures", "2"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("error: no command given")
    r = subprocess.run([sys.executable, SUP, "--max-failures", "0", "--", "true"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("error: --max-failures")


def _load_supervisor():
    from megatron_k3.commands import supervise

    return supervise


def test_signal_during_child_start_is_forwarded():
    """A signal that arrives while Popen starts the child (self.child not yet set) must still reach it.

    The handler is called as the signal would call it, with no child yet; the next attempt's child (a
    60 s sleep) must then be stopped by the forwarded SIGTERM instead of running to its end."""
    sup_mod = _load_supervisor()
    sup = sup_mod.Supervisor([sys.executable, "-c", "import time; time.sleep(60)"], None, 1, 0.0, False)
    sup._on_signal(signal.SIGTERM, None)
    assert sup.missed == [signal.SIGTERM] and sup.stop_requested
    t0 = time.time()
    rc = sup.run_once(1)
    assert rc == -signal.SIGTERM and time.time() - t0 < 30
    assert sup.missed == []


def test_stale_signal_between_attempts_is_not_forwarded(tmp_path):
    """SIGUSR2 received before an attempt starts is dropped at the top of the loop, not sent to the new child."""
    sup_mod = _load_supervisor()
    marker = tmp_path / "usr2"
    child = ("import signal, sys, time\n"
             f"signal.signal(signal.SIGUSR2, lambda *a: open({str(marker)!r}, 'w').write('1'))\n"
             "time.sleep(0.5)\n")
    sup = sup_mod.Supervisor([sys.executable, "-c", child], None, 1, 0.0, False)
    sup._on_signal(signal.SIGUSR2, None)
    assert sup.run() == 0
    assert not marker.exists()


def test_watchdog_restarts_a_stalled_real_trainer(tmp_path):
    """The real trainer (k3-tiny), made to stall by SIGSTOP after it has saved at step 4: its metrics.jsonl stops
    growing, the supervisor's watchdog stops it as hung (SIGTERM, then SIGKILL: a stopped process ignores
    SIGTERM), counts a failure and restarts it; the new attempt resumes from the checkpoint and finishes."""
    save, run = tmp_path / "ckpt", tmp_path / "run"
    cmd = [sys.executable, SUP, "--stall-timeout", "40", "--kill-grace", "2", "--backoff", "0", "--max-failures", "2",
           "--", sys.executable, os.path.join(ROOT, "launchers", "pretrain_k3.py"), "--train-iters", "12",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--save", str(save), "--load", str(save),
           "--save-interval", "4", "--run-dir", str(run), "--wandb-mode", "disabled"]
    out_log, err_log = tmp_path / "stdout.log", tmp_path / "stderr.log"  # files: an unread pipe would fill and
    p = subprocess.Popen(cmd, stdout=open(out_log, "w"), stderr=open(err_log, "w"), text=True,  # stall the trainer
                         env=dict(os.environ, PYTHONPATH=ROOT))
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    tracker = save / "latest_checkpointed_iteration.txt"
    while time.time() < deadline and not (tracker.exists() and tracker.read_text().strip() == "4"):
        time.sleep(0.2)
    assert tracker.exists(), "no checkpoint at step 4"
    # the trainer is the supervisor's only child: stop its whole process group
    import psutil

    kids = psutil.Process(p.pid).children()
    assert len(kids) == 1
    os.killpg(kids[0].pid, signal.SIGSTOP)
    stopped_at = sum(1 for _ in open(metrics))
    p.wait(timeout=300)
    err = err_log.read_text()
    assert p.returncode == 0, err[-3000:]
    assert "no progress for" in err and "stopping the child" in err and "SIGKILL" in err, err[-3000:]
    assert "attempt 1: failed (hung, stopped (killed by SIGKILL))" in err, err[-3000:]
    assert "attempt 2: starting (resuming from checkpoint step" in err
    steps = [json.loads(line)["step"] for line in open(metrics)]
    assert steps[-1] == 12 and stopped_at >= 4
