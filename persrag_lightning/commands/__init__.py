"""Subcommands of `persrag` / `train.py`; cli.py dispatches to them (arrows run cli → commands,
never back)."""

# the package's modules, imported on use
__all__ = ["cluster", "data", "evaluate", "feedback", "serve", "train"]
