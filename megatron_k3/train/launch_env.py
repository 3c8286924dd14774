"""Rank discovery for the trainer: torchrun / Slurm srun / MPI (mpiexec) / a single process.

``discover()`` fills RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT when the launcher did not:
- torchrun (or anything that set RANK/WORLD_SIZE): kept as is;
- Slurm ``srun`` (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is the first host of the job,
  ``scontrol show hostnames``);
- MPI (``mpiexec -n N``, Open MPI / MPICH / Intel MPI environment variables): rank, size and local rank
  through mpi4py (``COMM_TYPE_SHARED`` split for the local rank), the master address broadcast from rank 0;
- otherwise a world of one on 127.0.0.1 with a free port.
"""
from __future__ import annotations

import os
import socket
import subprocess

MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "HYDI_CONTROL_FD", "PMI_RANK")


def free_port(host: str = "127.0.0.1", span: int = 2700) -> int:
    """A rendezvous port that is free now and outside the kernel's ephemeral range.

    Binding port 0 returns a port from ``/proc/sys/net/ipv4/ip_local_port_range`` (32768-60999 by default),
    the same range the kernel hands to outgoing connections: another job's gloo sockets can take it between
    this check and the store's bind (seen as EADDRINUSE when two test workers start process groups at once).
    So the port is drawn at random from the ``span`` ports just below that range and checked to be bindable.
    """
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - span)
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(first, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{low - 1} on {host}; set MASTER_PORT")


def discover() -> str:
    """Set the rendezvous environment; returns which launcher was found."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        env.setdefault("LOCAL_RANK", "0")
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:
            nodes = subprocess.run(["scontrol", "show", "hostnames", env.get("SLURM_JOB_NODELIST", "")],
                                   capture_output=True, text=True).stdout.split()
            env["MASTER_ADDR"] = nodes[0] if nodes else "127.0.0.1"
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return "slurm"
    if any(v in env for v in MPI_VARS):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if comm.Get_size() > 1:
            local = comm.Split_type(MPI.COMM_TYPE_SHARED)
            addr, port = comm.bcast((socket.gethostbyname(socket.gethostname()), free_port()) if comm.Get_rank() == 0
                                    else None, root=0)
            env["RANK"], env["WORLD_SIZE"] = str(comm.Get_rank()), str(comm.Get_size())
            env["LOCAL_RANK"] = str(local.Get_rank())
            env.setdefault("MASTER_ADDR", addr)
            env.setdefault("MASTER_PORT", str(port))
            return "mpi"
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))
    return "single"
