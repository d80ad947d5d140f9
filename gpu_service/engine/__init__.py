"""The engine: continuous batching of requests into steps, sampling, the paged KV cache and prefix caching."""
