"""Tensor parallelism's process group: tp.py (which rank this process is,
and the collectives its sharded layers call)."""
