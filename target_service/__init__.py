"""The target service: a Llama-family model, a paged KV cache and one step operation."""
