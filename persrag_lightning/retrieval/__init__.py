"""Indexes and strategies. Importing the package configures faiss's batched exact search (index.py)."""

from persrag_lightning.retrieval import index as _index  # noqa: F401  (sets faiss's BLAS threshold once)
