"""The generator stage's data: training prompts built by a retrieval strategy of the evaluation, cached."""

__all__ = ["datamodule"]  # the package's modules, imported on use
