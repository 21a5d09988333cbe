"""The generator stage's data: training prompts built by a retrieval strategy of the evaluation, cached."""
