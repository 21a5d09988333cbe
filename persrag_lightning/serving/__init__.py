"""Serving without Lightning: CFRAGPipeline over exported bundles (and, later, the HTTP service)."""

from persrag_lightning.serving.pipeline import CFRAGPipeline, Generation

__all__ = ["CFRAGPipeline", "Generation"]
