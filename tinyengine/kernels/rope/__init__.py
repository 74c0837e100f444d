"""Rotary embeddings: the Llama-family prologue (per-head norms, RoPE and the
KV-cache write as one op) in reference.py (torch) and triton.py (kernel), and
a standalone q/k rotation with both implementations in rotary.py."""
