"""The draft service: an EAGLE-3 head with its own paged KV cache, growing token trees."""
