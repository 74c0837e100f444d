"""Paged attention and the KV-cache write: reference.py (torch), triton.py
(launchers) with kernels.py, cache_write.py and tiles.py beside it."""
