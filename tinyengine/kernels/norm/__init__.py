"""RMSNorm, plain and fused with the residual add: reference.py (torch) and
triton.py (kernel)."""
