"""`persrag pipeline`: every CFRAG stage on the embedded default, in order, skipping stages already
exported.

user encoder → feedback + retriever (and the ROPG-style baseline, on the same labels) → feedback +
reranker (and its "w/o e_u" ablation) → the generator (the LLM tuned on CFRAG's prompts) →
evaluation on the test split, ending with the results table (intervals, paired tests). A preset
(configs/presets/*.yaml, read by presets.py) says what each kind of stage overrides, which stages of
stages.py train and which rows the table reports. `--task` runs the same stages on another LaMP task
(SynthLaMP generates LaMP-1, 2, 3, 4, 5 and 7); the main job is LaMP-2. With `--data_dir` the task
defaults to the folder's (its convert.json), which is how a converted log's own label set (`labels`)
reaches every stage.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, get_args

from persrag_lightning.commands.evaluate import evaluation_config, run_evaluation
from persrag_lightning.commands.train import run_stage, stage_config
from persrag_lightning.data.folder_task import resolve_task
from persrag_lightning.models.user_encoder import Judgments
from persrag_lightning.pipeline.choice import check_rows
from persrag_lightning.pipeline.execution import JobRun, print_minutes, write_record
from persrag_lightning.pipeline.flow import plan_job, run_job
from persrag_lightning.pipeline.job import resolve_job
from persrag_lightning.pipeline.runs import DEV_SELECTION_EXAMPLES, EVALUATE_CONFIG, EvaluationRun, StageRun
from persrag_lightning.presets import load_preset, preset_names
from persrag_lightning.utils import one_flag_style

if TYPE_CHECKING:
    from jsonargparse import Namespace

    from persrag_lightning.evaluation.base import EvaluationReport

__all__ = ["LocalRunner", "main", "parse_args"]


class LocalRunner:
    """The pipeline's stages and evaluations resolved and run in this process: the stage's config by
    LightningCLI's parser (`stage_config`), the evaluation's by the evaluate parser."""

    def stage_config(self, run: StageRun) -> Namespace:
        return stage_config(run.config, run.overrides, run.extra, run.overlays)

    def fit(self, config: Namespace) -> None:
        run_stage(config)

    def evaluation_config(self, run: EvaluationRun) -> Namespace:
        return evaluation_config(run.overrides, run.only, run.names, EVALUATE_CONFIG)

    def evaluate(self, config: Namespace) -> EvaluationReport:
        return run_evaluation(config)


def check_data_dir(data_dir: str, task: str, splits: tuple[str, ...]) -> None:
    """Refuse, in one line, a LaMP folder that lacks a split the pipeline trains on or reports (exit
    2)."""
    from persrag_lightning.data.lamp import LampFormatError, outputs_path, questions_path

    for split in splits:
        for path in (questions_path(data_dir, split), outputs_path(data_dir, split)):
            if not path.is_file():
                raise LampFormatError(f"{path}: missing; the pipeline's --data_dir needs {split} questions and "
                                      f"outputs for {task} (it trains on train, selects on dev, reports on --split)")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="persrag pipeline", description=__doc__)
    parser.add_argument("--preset", default="quick",
                        help=f"a preset of configs/presets/ ({', '.join(preset_names())}) or a YAML file of your own "
                             "(docs/training/configs.md)")
    parser.add_argument("--task", default=None,
                        help="LaMP task, or labels (a converted folder's own label set); default: the --data_dir "
                             "folder's (its convert.json), else LaMP-2, the main job")
    parser.add_argument("--data_dir", default=None,
                        help="a LaMP-format folder (train/dev/<split> questions and outputs) that every stage and "
                             "the evaluation read; default: the embedded SynthLaMP")
    parser.add_argument("--split", default="test", choices=["dev", "test"],
                        help="the split the table reports (test; dev where a folder's test outputs are hidden)")
    parser.add_argument("--judgments", choices=get_args(Judgments), default=None,
                        help="stage 1's input per history doc: the paper's text only (none), + a label embedding "
                             "(label), + a label-specific map of the doc vector (paired), that map's mean alone, "
                             "untrained (profile); default: the preset's "
                             "(quick: paired, with the paper's text-only chain trained beside it)")
    parser.add_argument("--run_name", default=None,
                        help="default: synthlamp-<preset> (LaMP-2), synthlamp-lamp<N>-<preset> for another task, "
                             "with -<judgments> appended when not the preset's; <folder name>-... with --data_dir")
    parser.add_argument("--export_root", default="checkpoints")
    parser.add_argument("--llm_backend", default=None,
                        help="auto, hf, llamacpp, openai or vllm for feedback labels and evaluation answers alike; "
                             "default: the configs' (feedback auto: the faster exact backend, timed once per machine; "
                             "evaluation hf, bfloat16 where native)")
    parser.add_argument("--questions", type=int, default=None,
                        help="read only the first N dev and test questions by id (a fixed subset) in the dev choice "
                             f"and the table; default: every one (the dev choice at most {DEV_SELECTION_EXAMPLES}). "
                             "Fewer questions take less time and give wider intervals")
    parser.add_argument("--plan", action="store_true",
                        help="print the machine, the precision and runtime decisions, the plan and its estimate "
                             "against this CPU class's budget, then exit before anything trains")
    opts, extra = one_flag_style(parser).parse_known_args(argv)
    if opts.questions is not None and opts.questions < 1:
        parser.error(f"--questions must be a positive number of questions, got {opts.questions}")
    try:
        opts.task = resolve_task(opts.task, opts.data_dir)
    except ValueError as e:
        parser.error(str(e))
    return opts, extra


def main(argv: list[str]) -> None:
    """`python train.py pipeline`: the decisions and the plan, then every stage the preset names (those already
    exported are skipped), the dev choices and the table on `--split`; pipeline.json records what ran.

    Args:
        argv: the arguments after `pipeline` (`--preset`, `--task`, `--data_dir`, `--plan`, ...; `--help` lists
            them), and any `fit` override for every stage.
    """
    opts, extra = parse_args(argv)
    preset = load_preset(opts.preset)
    check_rows(preset, opts.preset)
    if opts.data_dir is not None:
        check_data_dir(opts.data_dir, opts.task, ("train", "dev", opts.split) if opts.split != "dev" else ("train", "dev"))
    job, runner = resolve_job(opts, extra, preset), LocalRunner()
    decisions, plan = plan_job(job, runner, opts.questions, opts.data_dir)
    if opts.plan:
        print("[pipeline] --plan: nothing trained; the same command without --plan runs this plan")
        return
    execution = JobRun(runner)
    job, choices = run_job(job, execution)
    print_minutes(execution.ran, plan, job.reader)
    call = {"argv": argv, "preset": opts.preset, "split": opts.split, "questions": opts.questions}
    write_record(job, execution.ran, plan, call, decisions, choices)
