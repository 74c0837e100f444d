"""Linear layers at decode shapes: reference.py (torch), triton.py (the skinny
GEMM kernel and its dispatcher), silu.py (its fused SiLU-and-mul epilogue) and
tiles.py."""
