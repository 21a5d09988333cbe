"""LightningDataModules, one per kind of stage: each builds and caches what its stage reads in
`prepare_data` (once per node) and loads it in `setup` (user histories for stage 1, LLM-feedback
candidates for stages 2 and 3, the generator's prompts)."""

# the package's modules, imported on use
__all__ = ["feedback", "generator", "reader", "sampling", "user_history"]
