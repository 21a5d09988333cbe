"""Quiet logs by default: what a run prints is its own progress (with ETAs), its metrics and its
errors.

Without `--verbose` (or `PERSRAG_VERBOSE=1`) the libraries' chatter is silenced: the "Loading
weights" and "Writing model shards" bars of transformers, Lightning's boilerplate info lines ("Seed
set to 0", "GPU available", the litlogger tip, "Using bfloat16 Automatic Mixed Precision",
"`Trainer.fit` stopped", the restore-best-checkpoint lines), its model summary table (unless
`--trainer.enable_model_summary=true` asks for it) and warnings that are not actionable here
(LightningCLI's args-and-argv notice when a command starts a stage from Python, the `srun` hint on
machines that have Slurm installed, deprecations raised inside Lightning, torch and transformers).
What is about the user's run still shows: warnings, DDP membership, Slurm requeue and resume lines,
metrics.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings

__all__ = ["configure_logs", "is_verbose", "pop_verbose"]

VERBOSE_FLAGS = ("--verbose", "-v")
_BOILERPLATE = ("Seed set to", "GPU available", "TPU available", "HPU available", "💡 Tip", "Restoring states from",
                "Loaded model weights from", "Using bfloat16 Automatic Mixed Precision",
                "Using 16bit Automatic Mixed Precision", "`Trainer.fit` stopped",
                "Loading `train_dataloader` to estimate")
_NOT_ACTIONABLE = (
    r"LightningCLI's args parameter is intended to run from within Python",
    r"The `srun` command is available on your system but is not used",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # transformers 5, read by peft when it wraps a model
    r"`is_gradient_checkpointing` is deprecated",
)


def is_verbose() -> bool:
    """Whether this process (or the command that started it) was asked for the libraries' logs."""
    return os.environ.get("PERSRAG_VERBOSE", "") not in ("", "0")


def pop_verbose(args: list[str]) -> tuple[list[str], bool]:
    """Remove the global `--verbose` / `-v` flag from a command line; the environment can set it
    too."""
    kept = [a for a in args if a not in VERBOSE_FLAGS]
    return kept, is_verbose() or len(kept) < len(args)


def _drop_boilerplate(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_BOILERPLATE)


def configure_logs(verbose: bool) -> None:
    """Set the libraries' verbosity for this process (and, through the environment, its DDP
    children)."""
    if verbose:
        os.environ["PERSRAG_VERBOSE"] = "1"
        return
    # importing them installs the handlers filtered below
    for module in ("lightning.fabric", "lightning.pytorch"):
        importlib.import_module(module)

    for name in ("", "lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(_drop_boilerplate)
    for pattern in _NOT_ACTIONABLE:
        warnings.filterwarnings("ignore", message=pattern)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    # transformers is a dependency; this only guards a broken install's error message
    except ImportError:
        pass
