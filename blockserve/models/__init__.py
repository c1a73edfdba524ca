"""Models: one file per architecture family over the shared shell (base.py) and layers, the
architecture registry and the weight loaders (checkpoint layouts, HF safetensors, GGUF)."""

from blockserve.models.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
