"""The models the stages train and serving loads, without Lightning: `from_pretrained` /
`save_pretrained` bundles."""

__all__ = ["common", "corpus_embeddings", "exported", "generator", "reranker", "retriever", "text_encoder",
           "user_encoder"]  # the package's modules, imported on use
