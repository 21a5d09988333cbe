"""`persrag feedback`: build (a shard of) a stage's LLM-feedback labels, or print their
statistics."""

from __future__ import annotations

import argparse
import os

import lightning as L

from persrag_lightning.commands.train import PersragCLI
from persrag_lightning.feedback.builder import feedback_stats
from persrag_lightning.utils import one_flag_style

__all__ = ["feedback_command"]


def feedback_parser() -> argparse.ArgumentParser:
    """The feedback command's own flags; every other argument configures the stage as for `fit`."""
    parser = argparse.ArgumentParser(prog="persrag feedback", add_help=False)
    parser.add_argument(
        "--shard", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))
    )
    parser.add_argument("--num_shards", type=int, default=None)
    parser.add_argument(
        "--stats", action="store_true", help="print label statistics of the finished cache"
    )
    return one_flag_style(parser)


def feedback_command(args: list[str]) -> None:
    """`persrag feedback --config X [--shard i --num_shards n] [--stats]`: build (a shard of) the
    LLM-feedback labels of a stage's DataModule, or print their statistics; the rest of the
    arguments configure as for `fit`.

    Args:
        args: the command line after `persrag feedback`.
    """
    opts, rest = feedback_parser().parse_known_args(args)
    num_shards = opts.num_shards or int(os.environ.get("SLURM_ARRAY_TASK_COUNT", "1"))
    cli = PersragCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                     args=rest, run=False)
    dm = cli.datamodule
    if not hasattr(dm, "build_feedback"):
        raise SystemExit(
            f"{type(dm).__name__} has no LLM-feedback labels (use a retriever or reranker config)"
        )
    # The trainer `fit` would run: with `--trainer.limit_val_batches=0` it validates nothing, so no
    # dev labels are built or read here either (an array job labels exactly what the stage will
    # read).
    dm.trainer = cli.trainer
    if opts.stats:
        dm.setup("fit")
        for split, examples in ((dm.splits.train_split, dm.train_examples), (dm.splits.val_split, dm.val_examples)):
            if examples:
                print(f"\n{split} ({dm.builder().root}):\n{feedback_stats(examples).table()}")
        return
    builder = dm.build_feedback(opts.shard, num_shards)
    print(f"shard {opts.shard}/{num_shards}: {builder.llm_calls} LLM calls; cache {builder.root}")
