"""LightningModules, one per training stage (user encoder, retriever, reranker, its distillation,
generator), and the user-history DataModule; models/ holds what they train."""

__all__ = ["distillation", "generator", "losses", "progress_lines", "reranker", "retriever",
           "user_encoder"]  # the package's modules, imported on use
