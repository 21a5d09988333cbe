"""Subcommands of `persrag` / `train.py`; cli.py dispatches to them (arrows run cli → commands, never back)."""
