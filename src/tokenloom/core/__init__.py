"""Scheduling and the paged KV cache, in token counts and block ids; nothing here imports torch."""
