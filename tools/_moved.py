"""The old paths of scripts that moved to ``benchmarks/`` on 2026-12-05: each ``tools/<name>.py`` of them runs
``benchmarks/<name>.py`` with the same arguments (exec: the same process, exit code and output)."""
import os
import sys


def run_moved(name: str) -> None:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", name)
    os.execv(sys.executable, [sys.executable, path, *sys.argv[1:]])
