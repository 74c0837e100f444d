"""DeepSeek-V4's KV compressor over paged per-token state: reference.py
(torch). One compressed entry per window of `ratio` tokens, written where the
window's last token lives."""
