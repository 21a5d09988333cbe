"""The Lightning side of the CLI: `fit`, `validate`, `test`, `predict` and `export` of every stage,
with run names, Slurm-aware log folders and requeue, W&B configuration and the export of the best
checkpoint."""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import lightning as L
import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import WandbLogger

from persrag_lightning.logs import is_verbose
from persrag_lightning.modules.progress_lines import ProgressLines
from persrag_lightning.stages import fill_run_dir, run_folder
from persrag_lightning.utils import resolve_config_path

__all__ = ["PersragCLI", "check_task", "lightning_command", "resolve_config_args", "run_stage",
           "stage_config"]


def resolve_config_args(argv: list[str]) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] in ("--config", "-c"):
            arg = resolve_config_path(arg)
        elif arg.startswith("--config="):
            arg = "--config=" + resolve_config_path(arg.split("=", 1)[1])
        out.append(arg)
    return out


def check_task(task: str | None, data_dir: str | None = None) -> None:
    """An unknown task, or one its folder's convert.json contradicts, is bad input like any other:
    one line naming it (exit code 2), raised here because the argument parser would wrap the
    constructor's error into a traceback. A converted folder's own label set is registered on the
    way (data/folder_task.py).

    Args:
        task: the task a stage's config names; None is left to the config's default.
        data_dir: the stage's LaMP folder, whose convert.json may fix the task; None for SynthLaMP.
    """
    if task is not None or data_dir is not None:
        from persrag_lightning.data.folder_task import resolve_task

        resolve_task(task, data_dir)


def _slurm_version() -> str | None:
    """`slurm-<job id>[_<array task id>]` inside a Slurm job (None outside one, or in an interactive
    one): the logger version of the job, stable across requeues, so a requeued job resumes its own
    run folder."""
    if "SLURM_JOB_ID" not in os.environ or os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return f"slurm-{os.environ['SLURM_JOB_ID']}"


class PersragCLI(LightningCLI):
    """Adds a run name (runs/<run>/<stage> for logs, checkpoints/<run>/<stage> for the serving
    bundle), validates the best checkpoint after fit and exports it."""

    export_after_validate = False

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_name", type=str, default="synthlamp",
                            help="names runs/<run_name>/ (logs, checkpoints) and checkpoints/<run_name>/ (exports)")
        parser.add_argument("--export_root", type=str, default="checkpoints",
                            help="folder that holds the exported bundles of every run")
        parser.add_argument("--stage_name", type=str, default=None,
                            help="name of this stage's folders (default: the module's bundle name, e.g. retriever); "
                                 "variants such as an ablation get their own, e.g. reranker_no_user")

    def _cfg(self):
        return self.config[self.subcommand] if self.subcommand else self.config

    def _stage_name(self) -> str:
        """--stage_name, else the module's bundle name (user_encoder, retriever, reranker) read from
        its class."""
        if self._cfg().get("stage_name"):
            return self._cfg().stage_name
        path = self._cfg().model.class_path
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return getattr(cls, "bundle_name", name)

    def before_instantiate_classes(self) -> None:
        """Logs and checkpoints of a stage go to runs/<run_name>/<stage>/ (CSV logger unless one is
        configured); the run folder's placeholder (`stages.RUN_DIR`) in the data's and the model's
        paths is checkpoints/<run_name>, where earlier stages exported."""
        cfg = self._cfg()
        check_task(cfg.data.init_args.get("task"), cfg.data.init_args.get("data_dir"))
        run_dir = str(run_folder(cfg.export_root, cfg.run_name))
        for args in (cfg.data.init_args, cfg.model.init_args):
            fill_run_dir(args, run_dir)
        root = Path("runs") / cfg.run_name / self._stage_name()
        # quiet logs (logs.py)
        if cfg.trainer.get("enable_model_summary") is None and not is_verbose():
            cfg.trainer.enable_model_summary = False
        job = _slurm_version()
        if cfg.trainer.get("logger") in (None, True):
            cfg.trainer.logger = Namespace(
                class_path="lightning.pytorch.loggers.CSVLogger",
                init_args=Namespace(save_dir=str(root), name="logs", version=job),
            )
        for logger in (
            cfg.trainer.logger if isinstance(cfg.trainer.logger, list) else [cfg.trainer.logger]
        ):
            if isinstance(logger, Namespace) and logger.get("class_path", "").endswith(
                "WandbLogger"
            ):
                self._configure_wandb(logger.init_args, root, job)
        if not cfg.trainer.get("default_root_dir"):
            cfg.trainer.default_root_dir = str(
                root if job is None else self._job_dir(cfg, root, job)
            )
            if job is not None and self.subcommand == "fit" and not cfg.get("ckpt_path"):
                self._resume_requeued_job(cfg)

    def _configure_wandb(self, args: Namespace, root: Path, job: str | None) -> None:
        """W&B runs are named <run_name>/<stage> and live in the stage's run folder (unless
        WANDB_DIR says otherwise); under Slurm the run id follows the job id, so a requeued job
        resumes its W&B run."""
        cfg = self._cfg()
        if not args.get("name"):
            args.name = f"{cfg.run_name}/{self._stage_name()}"
        if args.get("save_dir") in (None, ".") and not args.get("dir"):
            args.save_dir = None if os.environ.get("WANDB_DIR") else str(root)
        if job is not None and not args.get("version") and not args.get("id"):
            args.version = f"{cfg.run_name}-{self._stage_name()}-{job}".replace("/", "-")

    @staticmethod
    def _job_dir(cfg: Namespace, root: Path, job: str) -> Path:
        """This Slurm job's own folder (the first logger's version folder, where its checkpoints/
        go): Lightning's SIGUSR1 handler saves hpc_ckpt_<n>.ckpt into it, and only this job
        (requeued) finds it."""
        logger = (
            cfg.trainer.logger[0] if isinstance(cfg.trainer.logger, list) else cfg.trainer.logger
        )
        # no logger (False) or an instance: the job's own folder
        if not isinstance(logger, Namespace):
            return root / job
        args = logger.get("init_args") or Namespace()
        name = args.get("project") if logger.get("class_path", "").endswith("WandbLogger") else args.get("name")
        version = args.get("version") or args.get("id")
        if args.get("save_dir") and name and version:
            return Path(args.save_dir) / name / str(version)
        return root / job

    @staticmethod
    def _resume_requeued_job(cfg: Namespace) -> None:
        """A requeued job resumes from the newest of its hpc checkpoint (saved on SIGUSR1) and its
        last.ckpt (a job killed without the signal); the newest matters once a resumed job has saved
        further epochs. The CSV of the earlier attempt is kept as metrics.<n>.csv (Lightning's CSV
        logger would delete it)."""
        job_dir = Path(cfg.trainer.default_root_dir)
        found = [*job_dir.glob("hpc_ckpt_*.ckpt"), *job_dir.glob("checkpoints/last.ckpt")]
        if not found:
            return
        cfg.ckpt_path = str(max(found, key=lambda p: p.stat().st_mtime))
        metrics = job_dir / "metrics.csv"
        if metrics.exists() and os.environ.get("SLURM_PROCID", "0") == "0":
            n = 0
            while (job_dir / f"metrics.{n}.csv").exists():
                n += 1
            metrics.rename(job_dir / f"metrics.{n}.csv")
        print(f"requeued Slurm job: resuming from {cfg.ckpt_path}", file=sys.stderr)

    def export_dir(self) -> Path:
        cfg = self._cfg()
        return run_folder(cfg.export_root, cfg.run_name) / self._stage_name()

    def export_bundle(self) -> None:
        """Rank 0 writes the bundle of the weights the trainer holds now."""
        if self.trainer.is_global_zero:
            path = self.model.export(self.export_dir(), self.datamodule)
            print(f"exported {self._stage_name()} to {path}")
            for logger in self.trainer.loggers:
                if isinstance(logger, WandbLogger):  # the bundle the W&B run produced
                    logger.experiment.summary["export_path"] = str(Path(path).resolve())
        self.trainer.strategy.barrier("export")

    def add_progress_lines(self) -> None:
        """Without a progress bar (the pipeline, Slurm jobs) training and validation print lines
        with an ETA."""
        present = any(isinstance(c, ProgressLines) for c in self.trainer.callbacks)
        if self.trainer.progress_bar_callback is None and not present:
            self.trainer.callbacks.append(ProgressLines(self._stage_name()))

    def keep_last_without_validation(self) -> None:
        """A fit that validates nothing (`--trainer.limit_val_batches=0`: the quick preset's
        feedback stages) keeps its last weights: the checkpoint callbacks stop monitoring a
        validation metric that is never logged (Lightning would warn that it cannot find it and keep
        no best checkpoint)."""
        if self.trainer.limit_val_batches == 0:
            for callback in self.trainer.checkpoint_callbacks:
                callback.monitor = None

    def before_fit(self) -> None:
        """Progress lines; W&B records the whole CLI config (Lightning logs only the model's and
        data's args)."""
        self.add_progress_lines()
        self.keep_last_without_validation()
        for logger in self.trainer.loggers:
            if isinstance(logger, WandbLogger):
                config = self._parser(self.subcommand).dump(
                    self._cfg(), format="json", skip_check=True
                )
                logger.log_hyperparams({"cli": json.loads(config)})

    def after_fit(self) -> None:
        """Evaluate and export the best checkpoint (the last weights when no checkpoint was
        kept)."""
        best = getattr(self.trainer.checkpoint_callback, "best_model_path", "") or None
        if self.trainer.fast_dev_run:
            return
        self.trainer.validate(self.model, datamodule=self.datamodule, ckpt_path=best, verbose=True)
        if best:
            state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
            # a LoRA generator's checkpoint holds its trainable weights only (the base is the model
            # source's)
            self.model.load_state_dict(state, strict=getattr(self.model, "strict_loading", True))
        self.export_bundle()

    def before_validate(self) -> None:
        self.add_progress_lines()

    def after_validate(self) -> None:
        if self.export_after_validate:
            self.export_bundle()


class ExportCLI(PersragCLI):
    export_after_validate = True


def _run_cli(cli_class: type[PersragCLI], args: list[str] | Namespace | None) -> None:
    # `_ParserOnly` builds the parser from these same settings
    cli_class(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
              args=args, save_config_kwargs={"overwrite": True})


def lightning_command(args: list[str], from_sys_argv: bool = False) -> None:
    """fit / validate / test / predict, and `export` (validate the given checkpoint, then write the
    bundle), from a command line.

    Args:
        args: the command line after `train.py` (`fit --config cfrag_retriever.yaml
            --run_name=...`).
        from_sys_argv: let LightningCLI read `sys.argv` itself (the console script), with `args`
            written there.
    """
    args = resolve_config_args(args)
    cli_class = PersragCLI
    if args and args[0] == "export":
        args[0] = "validate"
        cli_class = ExportCLI
    if from_sys_argv:  # keep LightningCLI reading sys.argv (it warns when given both)
        sys.argv[1:] = args
    _run_cli(cli_class, None if from_sys_argv else args)


class _ParserOnly(PersragCLI):
    """PersragCLI's parsers as `_run_cli`'s LightningCLI builds them (`setup_parser` with the
    subcommands, PersragCLI's own arguments included), and nothing after: no parse, seeding, logging
    set-up or instantiation, which `LightningCLI.__init__` goes on to do. This `__init__` keeps the
    settings that `__init__` keeps before it builds the parser (the ones `_run_cli` gives, the rest
    its defaults); a test holds the parse equal to the CLI's own."""

    def __init__(self) -> None:  # not LightningCLI.__init__: that one parses and runs
        self.model_class = self._model_class = L.LightningModule
        self.datamodule_class = self._datamodule_class = L.LightningDataModule
        self.subclass_mode_model = self.subclass_mode_data = True
        self.trainer_class, self.trainer_defaults = L.Trainer, {}
        self.seed_everything_default, self.auto_configure_optimizers = True, True
        self.parser_class, self.parser_kwargs = LightningArgumentParser, {}
        self.setup_parser(True, *self._setup_parser_kwargs(self.parser_kwargs))


@lru_cache(maxsize=16)
def _parsed_config_files(paths: tuple[str, ...], cwd: str) -> tuple[LightningArgumentParser, Namespace]:
    """The `fit` parser and the values of config files laid one over the other, as `train.py fit
    --config <path> [--config <path> ...]` parses them (cached per files and folder; used through
    clones)."""
    cli = _ParserOnly()
    return cli._parser("fit"), cli.parser.parse_args(["fit", *(a for p in paths for a in ("--config", p))])


def stage_config(config: str, overrides: Mapping[str, Any], extra: Sequence[str] = (),
                 overlays: Sequence[str] = ()) -> Namespace:
    """A stage's `fit` configuration resolved as `train.py fit --config <config> [--config <overlay>
    ...] --<key>=<value> ... <extra>` resolves it, without writing the typed overrides as text: the
    object `run_stage` trains from and a plan reads.

    Args:
        config: the stage's config file (a name of configs/ or a path).
        overrides: dotted keys (`data.init_args.candidates.m`) with typed values, applied in order
            after the files; None values are left out (the config's own value).
        extra: arguments of a user's command line, applied last as they were typed.
        overlays: config files laid over `config`, in order (configs/overlays/...).
    """
    files = tuple(resolve_config_path(path) for path in (config, *overlays))
    parser, parsed = _parsed_config_files(files, os.getcwd())
    given = {k: v for k, v in overrides.items() if v is not None}
    # the file's parse holds the defaults already: parsing them again would only repeat the work
    fit = parser.parse_object(given, namespace=parsed.fit.clone(), defaults=False)
    if extra:
        fit = parser.parse_args(list(extra), namespace=fit)
    resolved = parsed.clone()
    resolved.fit = fit
    return resolved


def run_stage(config: Namespace) -> None:
    """Train one stage in this process from its resolved configuration (`stage_config`):
    LightningCLI is given the object, not a command line.

    Args:
        config: the parsed configuration, its `subcommand` (fit) and that subcommand's settings.
    """
    _run_cli(PersragCLI, config)
