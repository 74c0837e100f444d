"""DeepSeek-V4's lightning indexer: score the compressed indexer keys for each
query and keep the top k. reference.py (torch)."""
