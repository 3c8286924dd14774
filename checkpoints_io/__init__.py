"""Checkpoint I/O: the O_DIRECT DCP storage writer (odirect.py); atomic sharded save/resume comes next."""
