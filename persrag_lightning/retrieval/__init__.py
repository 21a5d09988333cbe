"""Indexes and strategies. Importing the package configures faiss's batched exact search
(persrag_lightning/index.py)."""

from persrag_lightning import index as _index  # noqa: F401  (sets faiss's BLAS threshold once)

__all__ = ["base", "baselines", "candidates", "cfrag", "cfrag_inference", "cluster_index", "clusterrag",
           "cohort_export", "cohort_settings", "cohorts", "corpus_retriever", "llm_cache", "memory", "pbr",
           "pbr_anchor", "pbr_prompts", "pbr_settings", "pbr_strategy", "strategies", "tuned_generator",
           "user_clustering", "user_index"]  # the package's modules, imported on use
