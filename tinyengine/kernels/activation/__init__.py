"""SiLU-and-mul: reference.py (torch) and triton.py (kernel)."""
