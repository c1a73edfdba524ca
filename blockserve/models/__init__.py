"""Models (one file per architecture family), the architecture registry and the weight loaders."""

from blockserve.models.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
