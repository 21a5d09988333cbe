"""`python train.py` / `persrag`: LightningCLI (fit, validate, test, predict) plus `export`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import lightning as L
import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

CONFIG_DIRS = (Path("configs"), Path(__file__).resolve().parent.parent / "configs")


def resolve_config_path(name: str) -> str:
    """A `--config` value that is not a file is looked up in ./configs and in the repository's configs/."""
    if Path(name).exists():
        return name
    for folder in CONFIG_DIRS:
        if (folder / name).exists():
            return str(folder / name)
    return name


def resolve_config_args(argv: list[str]) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] in ("--config", "-c"):
            arg = resolve_config_path(arg)
        elif arg.startswith("--config="):
            arg = "--config=" + resolve_config_path(arg.split("=", 1)[1])
        out.append(arg)
    return out


class PersragCLI(LightningCLI):
    """Adds a run name (runs/<run>/<stage> for logs, checkpoints/<run>/<stage> for the serving bundle),
    validates the best checkpoint after fit and exports it."""

    export_after_validate = False

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_name", type=str, default="synthlamp",
                            help="names runs/<run_name>/ (logs, checkpoints) and checkpoints/<run_name>/ (exports)")
        parser.add_argument("--export_root", type=str, default="checkpoints",
                            help="folder that holds the exported bundles of every run")

    def _cfg(self):
        return self.config[self.subcommand] if self.subcommand else self.config

    def _stage_name(self) -> str:
        """The module's bundle name (user_encoder, retriever, reranker), read from its class before instantiation."""
        path = self._cfg().model.class_path
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return getattr(cls, "bundle_name", name)

    def before_instantiate_classes(self) -> None:
        """Logs and checkpoints of a stage go to runs/<run_name>/<stage>/ (CSV logger unless one is configured);
        `{run_dir}` in the data's paths is checkpoints/<run_name>, where the earlier stages exported."""
        cfg = self._cfg()
        run_dir = str(Path(cfg.export_root) / cfg.run_name)
        for key, value in vars(cfg.data.init_args).items():
            if isinstance(value, str) and "{run_dir}" in value:
                setattr(cfg.data.init_args, key, value.replace("{run_dir}", run_dir))
        root = Path("runs") / cfg.run_name / self._stage_name()
        if not cfg.trainer.get("default_root_dir"):
            cfg.trainer.default_root_dir = str(root)
        if cfg.trainer.get("logger") in (None, True):
            cfg.trainer.logger = Namespace(class_path="lightning.pytorch.loggers.CSVLogger",
                                           init_args=Namespace(save_dir=str(root), name="logs"))

    def export_dir(self) -> Path:
        cfg = self._cfg()
        return Path(cfg.export_root) / cfg.run_name / self._stage_name()

    def export_bundle(self) -> None:
        """Rank 0 writes the bundle of the weights the trainer holds now."""
        if self.trainer.is_global_zero:
            path = self.model.export(self.export_dir(), self.datamodule)
            print(f"exported {self._stage_name()} to {path}")
        self.trainer.strategy.barrier("export")

    def after_fit(self) -> None:
        """Evaluate and export the best checkpoint (the last weights when no checkpoint was kept)."""
        best = getattr(self.trainer.checkpoint_callback, "best_model_path", "") or None
        if self.trainer.fast_dev_run:
            return
        self.trainer.validate(self.model, datamodule=self.datamodule, ckpt_path=best, verbose=True)
        if best:
            state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
            self.model.load_state_dict(state)
        self.export_bundle()

    def after_validate(self) -> None:
        if self.export_after_validate:
            self.export_bundle()


class ExportCLI(PersragCLI):
    export_after_validate = True


def feedback_command(args: list[str]) -> None:
    """`persrag feedback --config X [--shard i --num-shards n] [--stats]`: build (a shard of) the LLM-feedback
    labels of a stage's DataModule, or print their statistics; the rest of the arguments configure as for `fit`."""
    parser = argparse.ArgumentParser(prog="persrag feedback", add_help=False)
    parser.add_argument("--shard", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_ID", 0)))
    parser.add_argument("--num-shards", type=int, default=None)
    parser.add_argument("--stats", action="store_true", help="print label statistics of the finished cache")
    opts, rest = parser.parse_known_args(args)
    num_shards = opts.num_shards or int(os.environ.get("SLURM_ARRAY_TASK_COUNT", 1))
    cli = PersragCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                     args=rest, run=False)
    dm = cli.datamodule
    if not hasattr(dm, "build_feedback"):
        raise SystemExit(f"{type(dm).__name__} has no LLM-feedback labels (use a retriever or reranker config)")
    if opts.stats:
        from persrag_lightning.data.feedback import feedback_stats

        dm.setup("fit")
        for split, examples in ((dm.hparams.train_split, dm.train_examples), (dm.hparams.val_split, dm.val_examples)):
            print(f"\n{split} ({dm.builder().root}):\n{feedback_stats(examples).table()}")
        return
    builder = dm.build_feedback(opts.shard, num_shards)
    print(f"shard {opts.shard}/{num_shards}: {builder.llm_calls} LLM calls; cache {builder.root}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of `train.py` and the `persrag` console script: bad input ends with one clear line."""
    from persrag_lightning.data.lamp import LampFormatError
    from persrag_lightning.llm.base import LLMBackendError

    try:
        run(argv)
    except (LampFormatError, LLMBackendError, FileNotFoundError) as err:
        print(f"persrag: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err


def run(argv: list[str] | None = None) -> None:
    args = resolve_config_args(list(sys.argv[1:] if argv is None else argv))
    if args and args[0] == "feedback":
        return feedback_command(args[1:])
    cli_class = PersragCLI
    if args and args[0] == "export":  # export = validate the given checkpoint, then write the bundle
        args[0] = "validate"
        cli_class = ExportCLI
    if argv is None:  # keep LightningCLI reading sys.argv (it warns when given both)
        sys.argv[1:] = args
    cli_class(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
               args=None if argv is None else args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
