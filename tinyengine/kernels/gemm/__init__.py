"""Linear layers at any M on tensor cores, for the batch-invariant op set:
triton.py (the kernel; its reference is F.linear, gemv/reference.py)."""
