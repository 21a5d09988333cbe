"""LLM-feedback labels (CFRAG §4.2.2, §4.3.2): candidates → prompts → LLM → labels, cached; a room
above retrieval/, models/ and llm/, which it orchestrates. The cache's on-disk format lives in
data/feedback_cache.py."""

__all__ = ["builder", "settings"]  # the package's modules, imported on use
