"""Restart a training command until it finishes, as long as it makes progress.

    python launchers/supervisor.py [--max-failures N] [--save DIR] [--backoff S] -- COMMAND [ARGS...]

Runs COMMAND (the trainer, ``torchrun ...`` or a whole ``srun ...`` step) in its own process group and
decides what to do when it ends:

- exit 0: done, exit 0.
- exit 3 (``EXIT_SAVED_ON_SIGNAL``: the trainer saved a checkpoint on SIGTERM/SIGUSR1 and left), or any end
  after the supervisor itself forwarded SIGUSR1 (the time-limit warning of ``sbatch --signal=B:USR1@300``;
  under torchrun the agent turns it into exit 1): no restart. Under Slurm (``SLURM_JOB_ID`` set, rank 0,
  ``--requeue-on-signal``, the default) it runs ``scontrol requeue $SLURM_JOB_ID`` so the job comes back
  and resumes from the latest checkpoint, and exits 0; locally it exits 3. A SIGTERM/SIGINT received by the
  supervisor means "stop" (``scancel``, Ctrl-C): forwarded, never restarted, never requeued.
- any other non-zero exit or death by a signal: a failure. It counts as *progress* iff the step in
  ``DIR/latest_checkpointed_iteration.txt`` is higher than when this attempt started; a failure with
  progress resets the budget, and after ``--max-failures`` consecutive failures without progress the
  supervisor gives up with the child's exit status (128 + signal for a signal death). Otherwise it waits
  ``--backoff`` seconds and starts the same command again (which resumes with ``--load DIR``).

- no progress: with ``--stall-timeout S`` (default 3600; 0 turns it off) the supervisor watches the run's
  progress file (``--progress-file``, default ``RUN_DIR/metrics.jsonl`` from COMMAND's ``--run-dir``), to which
  the trainer appends a line every step. If it has not grown for S seconds (from the child's start too: the
  first step's compilation counts), the child is a hung run: SIGTERM to its process group, SIGKILL 30 s later,
  and the attempt is a failure without progress unless a checkpoint advanced, restarted from the latest
  checkpoint as above.

SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 are forwarded to the child's process group (``srun`` forwards them
on to its tasks); one that arrives while the child is being started (before its pid is known) is forwarded
as soon as it has started. ``--save`` defaults to the value of ``--save`` (else ``--load``) in COMMAND. Every start
is logged with the step it resumes from; the child sees ``K3_SUPERVISOR_ATTEMPT`` (1, 2, ...).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_k3.cli import ArgumentParser

EXIT_SAVED_ON_SIGNAL = 3
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
STOP = (signal.SIGTERM, signal.SIGINT)
TRACKER = "latest_checkpointed_iteration.txt"


def log(msg: str):
    print(f"[supervisor {time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def latest_step(save: str | None) -> int | None:
    """The step of the newest complete checkpoint in ``save`` (None: no checkpoint, or unreadable)."""
    if not save:
        return None
    try:
        return int(Path(save, TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


def flag_value(cmd: list[str], name: str) -> str | None:
    """The value of ``--name X`` / ``--name=X`` in a command line (the last one wins, like argparse)."""
    val = None
    for i, a in enumerate(cmd):
        if a == name and i + 1 < len(cmd):
            val = cmd[i + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    return val


def describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def shell_status(rc: int) -> int:
    """A Popen return code as a shell exit status (128 + N for death by signal N)."""
    return 128 - rc if rc < 0 else rc


def file_size(path: str | None) -> int | None:
    try:
        return os.path.getsize(path) if path else None
    except OSError:
        return None


class Supervisor:
    def __init__(self, cmd: list[str], save: str | None, max_failures: int, backoff: float, requeue: bool,
                 stall_timeout: float = 0.0, progress_file: str | None = None, kill_grace: float = 30.0):
        self.cmd, self.save, self.max_failures, self.backoff, self.requeue = cmd, save, max_failures, backoff, requeue
        self.stall_timeout, self.progress_file, self.kill_grace = stall_timeout, progress_file, kill_grace
        self.stalled = False
        self.child: subprocess.Popen | None = None
        self.received: list[int] = []  # signals received by the supervisor, in order
        # signals that found no live child: forwarded to the next child right after Popen returns, since one
        # arriving while Popen starts it (self.child not yet set) would otherwise never reach it
        self.missed: list[int] = []

    # -- signals ---------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        self.received.append(signum)
        child = self.child
        if child is not None and child.poll() is None:
            log(f"got {signal.Signals(signum).name}: forwarding it to the child (pid {child.pid})")
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass
        else:
            self.missed.append(signum)
            log(f"got {signal.Signals(signum).name} while no child is running")

    def install(self):
        for s in FORWARDED:
            signal.signal(s, self._on_signal)

    @property
    def stop_requested(self) -> bool:
        return any(s in STOP for s in self.received)

    @property
    def usr1_requested(self) -> bool:
        return signal.SIGUSR1 in self.received

    # -- one attempt -----------------------------------------------------------------------------------
    def run_once(self, attempt: int) -> int:
        env = dict(os.environ, K3_SUPERVISOR_ATTEMPT=str(attempt))
        # own process group: forwarded signals reach the whole tree (torchrun's workers, srun), and a
        # terminal's Ctrl-C reaches only the supervisor, which forwards it once
        self.child = subprocess.Popen(self.cmd, env=env, start_new_session=True)
        log(f"attempt {attempt}: child pid {self.child.pid}")
        while self.missed:  # arrived while Popen ran; the handler forwards any later one itself
            signum = self.missed.pop(0)
            log(f"forwarding {signal.Signals(signum).name} to the child (pid {self.child.pid}) now that it started")
            try:
                os.killpg(self.child.pid, signum)
            except ProcessLookupError:
                pass
        self.stalled = False
        watch = self.stall_timeout > 0 and self.progress_file
        size, since = file_size(self.progress_file), time.monotonic()
        while True:
            try:
                return self.child.wait(timeout=min(5.0, self.stall_timeout / 4) if watch else None)
            except subprocess.TimeoutExpired:
                now_size = file_size(self.progress_file)
                if now_size != size:
                    size, since = now_size, time.monotonic()
                elif time.monotonic() - since > self.stall_timeout:
                    return self.kill_stalled(time.monotonic() - since)
            except InterruptedError:  # pragma: no cover (PEP 475 retries; kept for clarity)
                continue

    def kill_stalled(self, idle: float) -> int:
        """The child made no progress for ``idle`` seconds: SIGTERM, then SIGKILL after the grace period."""
        self.stalled = True
        log(f"no progress for {idle:.0f} s ({self.progress_file} unchanged; --stall-timeout {self.stall_timeout:g}): "
            f"stopping the child (pid {self.child.pid}) as hung")
        for sig, wait in ((signal.SIGTERM, self.kill_grace), (signal.SIGKILL, None)):
            try:
                os.killpg(self.child.pid, sig)
            except ProcessLookupError:
                break
            try:
                return self.child.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                log(f"child still alive {self.kill_grace:g} s after SIGTERM: SIGKILL")
        return self.child.wait()

    def requeue_job(self) -> bool:
        job = os.environ.get("SLURM_JOB_ID")
        try:
            r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            log(f"scontrol requeue {job} failed: {e}")
            return False
        if r.returncode != 0:
            log(f"scontrol requeue {job} failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
            return False
        log(f"requeued Slurm job {job}: it resumes from step {latest_step(self.save)} when it starts again")
        return True

    def on_saved_exit(self, rc: int) -> int:
        """The child stopped on a save-and-exit signal."""
        step = latest_step(self.save)
        under_slurm = "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_PROCID", "0") == "0"
        if self.requeue and under_slurm and not self.stop_requested:
            log(f"child stopped on a signal ({describe(rc)}); latest checkpoint: step {step}")
            self.requeue_job()
            return 0
        log(f"child stopped on a signal ({describe(rc)}); latest checkpoint: step {step}; not restarting")
        return EXIT_SAVED_ON_SIGNAL if rc == EXIT_SAVED_ON_SIGNAL else (shell_status(rc) or EXIT_SAVED_ON_SIGNAL)

    def run(self) -> int:
        failures, attempt = 0, 0
        restarts = os.environ.get("SLURM_RESTART_COUNT")
        if restarts:
            log(f"Slurm job {os.environ.get('SLURM_JOB_ID')} restart count {restarts} (requeued)")
        while True:
            # a signal received between attempts was handled by the checks below (stop, USR1) or is stale
            # (USR2): only one arriving from here on, while this attempt starts, goes to the new child
            self.missed.clear()
            if self.stop_requested or self.usr1_requested:  # a stop signal arrived before this attempt started
                log("stop signal received before starting; not starting")
                if self.usr1_requested:
                    return self.on_saved_exit(EXIT_SAVED_ON_SIGNAL)
                return 128 + next(s for s in reversed(self.received) if s in STOP)
            attempt += 1
            start = latest_step(self.save)
            where = f"resuming from checkpoint step {start}" if start is not None else "no checkpoint: from scratch"
            log(f"attempt {attempt}: starting ({where}): {' '.join(self.cmd)}")
            try:
                rc = self.run_once(attempt)
            except OSError as e:
                log(f"giving up: cannot start {self.cmd[0]!r}: {e}")
                return 127
            end = latest_step(self.save)
            if rc == 0:
                log(f"attempt {attempt}: finished (exit code 0); latest checkpoint: step {end}")
                return 0
            if (rc == EXIT_SAVED_ON_SIGNAL and not self.stalled) or self.usr1_requested:
                return self.on_saved_exit(rc)
            if self.stop_requested:
                log(f"attempt {attempt}: {describe(rc)} after a stop signal; not restarting")
                return shell_status(rc)
            progressed = end is not None and (start is None or end > start)
            failures = 0 if progressed else failures + 1
            what = f"hung, stopped ({describe(rc)})" if self.stalled else describe(rc)
            log(f"attempt {attempt}: failed ({what}); checkpoint step {start} -> {end} "
                f"({'progress' if progressed else 'no progress'}); "
                f"{failures}/{self.max_failures} consecutive failures without progress")
            if failures >= self.max_failures:
                log(f"giving up: {failures} consecutive failure(s) without checkpoint progress "
                    f"(--max-failures {self.max_failures}); last: {describe(rc)}; latest checkpoint: step {end}")
                return shell_status(rc) or 1
            if self.backoff > 0:
                log(f"restarting in {self.backoff:g} s")
                deadline = time.monotonic() + self.backoff
                while time.monotonic() < deadline and not (self.stop_requested or self.usr1_requested):
                    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        i = argv.index("--")
        own, cmd = argv[:i], argv[i + 1:]
    else:
        own, cmd = argv, []
    ap = ArgumentParser(prog="supervisor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s [options] -- COMMAND [ARGS...]")
    ap.add_argument("--max-failures", type=int, default=3,
                    help="give up after this many consecutive failures without checkpoint progress (default 3)")
    ap.add_argument("--save", default=None,
                    help="checkpoint directory to watch (default: COMMAND's --save, else its --load)")
    ap.add_argument("--backoff", type=float, default=10.0, help="seconds to wait before a restart (default 10)")
    ap.add_argument("--requeue-on-signal", dest="requeue", action="store_true", default=True,
                    help="under Slurm, 'scontrol requeue' the job when the child saved and stopped on a signal "
                         "(default)")
    ap.add_argument("--no-requeue-on-signal", dest="requeue", action="store_false")
    ap.add_argument("--stall-timeout", type=float, default=3600.0,
                    help="seconds without progress (the progress file not growing) after which the child is "
                         "stopped as hung and restarted (default 3600; 0: no watchdog)")
    ap.add_argument("--progress-file", default=None,
                    help="file the trainer appends to every step (default: COMMAND's --run-dir/metrics.jsonl)")
    ap.add_argument("--kill-grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL of a hung child")
    args = ap.parse_args(own)
    if not cmd:
        print("error: no command given (usage: supervisor.py [options] -- COMMAND [ARGS...])", file=sys.stderr)
        sys.exit(2)
    if args.max_failures < 1:
        print(f"error: --max-failures must be >= 1 (got {args.max_failures})", file=sys.stderr)
        sys.exit(2)
    for name in ("stall_timeout", "backoff", "kill_grace"):
        if getattr(args, name) < 0:
            print(f"error: --{name.replace('_', '-')} must be >= 0 (got {getattr(args, name)})", file=sys.stderr)
            sys.exit(2)
    progress = args.progress_file
    if progress is None and flag_value(cmd, "--run-dir"):
        progress = os.path.join(flag_value(cmd, "--run-dir"), "metrics.jsonl")
    if args.stall_timeout > 0 and progress is None:
        log("no --run-dir in the command and no --progress-file: the hang watchdog is off")
    save = args.save or flag_value(cmd, "--save") or flag_value(cmd, "--load")
    if save is None:
        log("no --save directory: every failure counts as a failure without progress")
    sup = Supervisor(cmd, save, args.max_failures, args.backoff, args.requeue, args.stall_timeout, progress,
                     args.kill_grace)
    sup.install()
    sys.exit(sup.run())


if __name__ == "__main__":
    main()
