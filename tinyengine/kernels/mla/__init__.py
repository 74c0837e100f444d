"""MLA decode over a paged latent cache: reference.py (torch), triton.py
(launcher) with split.py (Triton kernels), gluon.py (the Hopper kernel) and
tiles.py beside it."""
