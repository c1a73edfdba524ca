"""blockserve: an LLM inference engine built around a paged KV cache that is correct by construction."""

__version__ = "0.1.0"
