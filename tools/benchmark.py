#!/usr/bin/env python3
"""Moved to ``benchmarks/benchmark.py`` (2026-12-05); this old path runs it with the same arguments."""
from _moved import run_moved

if __name__ == "__main__":
    run_moved("benchmark.py")
