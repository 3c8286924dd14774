"""Checkpoint I/O (sharded DCP, O_DIRECT writer, atomic save/resume). Reserved: filled by the checkpoint issue."""
