"""Serving without Lightning: CFRAGPipeline over exported bundles (`cfrag_pipeline.py`), and the
HTTP chat service `persrag serve` (`app.py` over `service.py`; its bodies in `requests.py`, refusals
in `validation.py`, accounts in `accounts.py`, the per-user gate in `gate.py`), imported from their
modules so the pipeline needs no web stack."""

from persrag_lightning.serving.cfrag_pipeline import CFRAGPipeline, Generation

__all__ = ["CFRAGPipeline", "Generation"]
