"""Indexes and strategies. Importing the package configures faiss's batched exact search (persrag_lightning/index.py)."""

from persrag_lightning import index as _index  # noqa: F401  (sets faiss's BLAS threshold once)
