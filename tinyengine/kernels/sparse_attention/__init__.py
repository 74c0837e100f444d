"""DeepSeek-V4 attention: shared-KV MQA over a sliding window of raw KV plus
compressed entries (all of them, or an indexer's top k), with per-head
sinks. reference.py (torch)."""
