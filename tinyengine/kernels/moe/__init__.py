"""Fused mixture-of-experts: reference.py (torch), triton.py (launcher) with
gemm.py (the grouped GEMM kernels) and tiles.py (size classes) beside it."""
