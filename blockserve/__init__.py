"""blockserve: an LLM inference engine built around a paged KV cache that is correct by construction.

`from blockserve import LLM, SamplingParams` works as in vLLM. The heavy parts load lazily, so
`import blockserve.kv` (pure Python) never pulls in torch.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from blockserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from blockserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'blockserve' has no attribute {name!r}")
