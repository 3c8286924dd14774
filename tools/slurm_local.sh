#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for tests and for trying slurm/pretrain_k3.sh.
#
#   bash tools/slurm_local.sh start     # munged + slurmctld + slurmd "node1", "node2"; waits until idle
#   bash tools/slurm_local.sh status    # sinfo / squeue
#   bash tools/slurm_local.sh env       # prints 'export SLURM_CONF=...' (eval it before sbatch/sinfo)
#   bash tools/slurm_local.sh stop      # cancels jobs, stops the daemons (pid files, SIGKILL after 10 s)
#
# Installs nothing: needs Debian's slurmctld slurmd slurm-client munge (CI: apt-get install -y
# --no-install-recommends slurmctld slurmd slurm-client munge) and root (slurmd starts job steps as the
# submitting user; slurmctld runs as root too, so the state directory may sit anywhere, e.g. under a 0700
# pytest tmp dir). Everything lives in $K3_SLURM_DIR (default /tmp/k3-slurm): slurm.conf, state, spool,
# pid and log files; clients find the cluster through SLURM_CONF=$K3_SLURM_DIR/slurm.conf. Ports:
# $K3_SLURM_PORT (default 16817) for slurmctld, the next two for the slurmd of node1 and node2.
#
# Pitfalls handled here (see ../shared/notes/ecosystem_on_this_machine.md): no systemd, so munged runs as
# user munge by hand and must answer `munge -n | unmunge` before slurmd starts (otherwise slurmd loops
# and ignores SIGTERM); no cgroups (proctrack/linuxproc, task/none, no cgroup.conf); both "nodes" are
# this host (NodeHostname=$(hostname -s), NodeAddr=127.0.0.1, one port each, %n in their paths) and
# node1/node2 must resolve (an /etc/hosts line) so a job's MASTER_ADDR=node1 works.
set -euo pipefail

DIR=${K3_SLURM_DIR:-/tmp/k3-slurm}
PORT=${K3_SLURM_PORT:-16817}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF

say() { echo "slurm_local: $*" >&2; }
die() { echo "error: $*" >&2; exit 2; }

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfiles() {  # stop the daemons of these pid files together: SIGTERM, then SIGKILL after 10 s
  local f pid i alive pids=()
  for f in "$@"; do
    [[ -f $f ]] || continue
    pid=$(cat "$f")
    kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    rm -f "$f"
  done
  for i in $(seq 100); do
    alive=()
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    ((${#alive[@]})) || return 0
    sleep 0.1
  done
  for pid in "${alive[@]}"; do
    say "pid $pid ignored SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  done
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

write_conf() {
  local host cpus sockets cores threads mem
  host=$(hostname -s)
  read -r cpus sockets cores threads mem < <(slurmd -C | awk '/^NodeName/ {
      for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
      print v["CPUs"], v["SocketsPerBoard"], v["CoresPerSocket"], v["ThreadsPerCore"], v["RealMemory"] }')
  cat > "$CONF" <<EOF
# written by tools/slurm_local.sh: two nodes on one host, no accounting, no cgroups
ClusterName=k3local
SlurmctldHost=$host
SlurmctldPort=$PORT
SlurmUser=root
AuthType=auth/munge
CryptoType=crypto/munge
# a requeued job may start again after the credential lifetime + 1 s (default 120 s)
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=node[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 1))-$((PORT + 2)) CPUs=$cpus SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

start() {
  [[ $(id -u) == 0 ]] || die "tools/slurm_local.sh needs root (slurmd launches job steps as the submitting user)"
  for b in slurmctld slurmd sinfo sbatch munged munge unmunge; do
    command -v "$b" >/dev/null || [[ -x /usr/sbin/$b ]] || die "$b not found: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
  done
  if pid_alive "$DIR/run/slurmctld.pid"; then
    say "already running ($DIR)"
    return 0
  fi
  mkdir -p "$DIR"/{ctld,spool/node1,spool/node2,run,log}
  write_conf

  # munge: reuse a working munged, else start one as user munge
  if ! munge_ok; then
    [[ -s /etc/munge/munge.key ]] || { mungekey --create --force >/dev/null 2>&1 || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    runuser -u munge -- /usr/sbin/munged --force
    cp /run/munge/munged.pid "$DIR/run/munged.pid" 2>/dev/null || true
    for i in $(seq 100); do munge_ok && break; sleep 0.1; done
    munge_ok || die "munged did not come up (see /var/log/munge/munged.log)"
  fi

  # node names must resolve: MASTER_ADDR is the first host of the job
  if ! getent hosts node1 >/dev/null || ! getent hosts node2 >/dev/null; then
    if [[ -w /etc/hosts ]]; then
      echo "127.0.0.1 node1 node2   # tools/slurm_local.sh" >> /etc/hosts
    else
      say "warning: node1/node2 do not resolve and /etc/hosts is not writable"
    fi
  fi

  slurmctld -f "$CONF" -i
  for i in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
  scontrol ping >/dev/null 2>&1 || die "slurmctld did not answer (see $DIR/log/slurmctld.log)"
  slurmd -f "$CONF" -N node1
  slurmd -f "$CONF" -N node2
  local i state
  for i in $(seq 300); do
    state=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ')
    if [[ $state == "node1 idle node2 idle " ]]; then
      say "up: $state(SLURM_CONF=$CONF)"
      return 0
    fi
    sleep 0.1
  done
  die "nodes not idle after 30 s: '$state' (logs in $DIR/log)"
}

stop() {
  if pid_alive "$DIR/run/slurmctld.pid"; then
    # cancel what still runs, so every slurmstepd ends before its slurmd goes away
    local jobs i
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      scancel $jobs 2>/dev/null || true
      for i in $(seq 150); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.2; done
    fi
  fi
  stop_pidfiles "$DIR/run/slurmd-node1.pid" "$DIR/run/slurmd-node2.pid" "$DIR/run/slurmctld.pid"
  stop_pidfiles "$DIR/run/munged.pid"   # only present if this script started munged
  say "stopped ($DIR)"
}

status() {
  if ! pid_alive "$DIR/run/slurmctld.pid"; then
    say "not running ($DIR)"
    return 1
  fi
  sinfo
  squeue
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env   (state in \$K3_SLURM_DIR, default /tmp/k3-slurm)" >&2; exit 2 ;;
esac
