"""persrag_lightning: train and serve personalized retrieval-augmented generation (CFRAG) with
Lightning."""

__version__ = "0.1.0"

__all__ = ["__version__"]
