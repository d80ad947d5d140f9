"""The GPU service: embeddings, attention + KV cache, router, shared experts, norms, sampling,
tokenization and the public Generate stream. Routed experts live in the expert service."""
from moe_core.openmp import passive_by_default

passive_by_default()  # before anything imports torch
