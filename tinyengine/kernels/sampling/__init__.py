"""The sampler's one-pass Gumbel-max draw: reference.py (torch, and the
definition of the random numbers) and triton.py (kernel)."""
