"""The command line: config names resolve against configs/, bad input fails cleanly with no half-written cache."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def run_cli(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


def test_print_config_resolves_names_against_configs(in_tmp_cwd):
    out = run_cli(in_tmp_cwd, "fit", "--config", "cfrag_user_encoder.yaml", "--print_config")
    assert out.returncode == 0, out.stderr
    assert "UserEncoderModule" in out.stdout and "temperature: 0.1" in out.stdout


def test_malformed_data_exits_nonzero_naming_file_record_field(in_tmp_cwd, tiny_bert):
    data = in_tmp_cwd / "lamp"
    data.mkdir()
    question = {"id": "7", "input": "description: a film", "user_id": "u1",
                "profile": [{"id": "d1", "date": "2020/01/02", "description": "x", "tag": "comedy"}]}
    (data / "train_questions.json").write_text(json.dumps([question]))
    (data / "train_outputs.json").write_text(json.dumps({"task": "LaMP_2", "golds": [{"id": "7", "output": "comedy"}]}))
    out = run_cli(in_tmp_cwd, "fit", "--config", "cfrag_user_encoder.yaml", f"--data.init_args.data_dir={data}",
                  f"--data.init_args.encoder={tiny_bert}", "--trainer.max_epochs=1")
    assert out.returncode == 2
    message = out.stderr.strip().splitlines()[-1]
    assert message.startswith("persrag: error:")
    assert "train_questions.json" in message and "record 0" in message and "date" in message
    assert not (in_tmp_cwd / ".cache" / "persrag" / "embeddings").exists()


def test_unknown_task_is_a_clear_error(in_tmp_cwd):
    out = run_cli(in_tmp_cwd, "fit", "--config", "cfrag_user_encoder.yaml", "--data.init_args.task=LaMP-9")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("persrag: error: task: unknown task 'LaMP-9'")
    assert "LaMP-1" in out.stderr and "Traceback" not in out.stderr
    out = run_cli(in_tmp_cwd, "evaluate", "--config", "evaluate_cfrag.yaml", "--evaluation.task=LaMP-9")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "unknown task 'LaMP-9'" in out.stderr


def test_logs_are_quiet_unless_verbose(in_tmp_cwd, tiny_bert):
    """A stage started as a subprocess prints none of the libraries' chatter (their info lines, the model summary);
    `--verbose` brings it back."""
    args = ["fit", "--config", "cfrag_user_encoder.yaml", "--run_name", "q", f"--data.init_args.encoder={tiny_bert}",
            "--data.init_args.synth.num_users=24", "--trainer.max_epochs=1", "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false", "--trainer.precision=bf16-mixed"]
    quiet = run_cli(in_tmp_cwd, *args)
    assert quiet.returncode == 0, quiet.stderr
    noise = ("Loading weights", "litlogger", "Seed set to", "GPU available", "LightningCLI's args",
             "Automatic Mixed Precision", "Trainable params", "`Trainer.fit` stopped")
    assert not [n for n in noise if n in quiet.stderr + quiet.stdout], quiet.stderr + quiet.stdout
    loud = run_cli(in_tmp_cwd, *args[:3], "--verbose", *args[3:], "--run_name", "v")
    assert loud.returncode == 0, loud.stderr
    assert all(n in loud.stderr + loud.stdout for n in ("Seed set to", "Trainable params", "Automatic Mixed Precision"))


def test_only_accepts_a_strategy_name_with_a_colon_unquoted():
    """YAML reads `[CFRAG (users: cluster)]` as a list holding a mapping; the name the user typed is kept."""
    from persrag_lightning.evaluation.arguments import evaluate_parser, only_names

    cfg = evaluate_parser().parse_args(["--strategies=[]", '--only=[bm25, CFRAG (users: cluster), "w/o e_u (x)"]'])
    assert only_names(cfg.only) == ["bm25", "CFRAG (users: cluster)", "w/o e_u (x)"]


def test_every_command_takes_snake_case_flags_and_the_kebab_case_spelling_alike(capsys) -> None:
    """One flag style (LightningCLI's `--run_name`): `--llm_backend` and `--llm-backend` are one option, help lists
    the snake_case spelling first, and an abbreviation (which would match both) is refused."""
    import argparse

    from persrag_lightning.commands import cluster, data, serve
    from persrag_lightning.utils import one_flag_style

    parsers = {"serve": serve.serve_parser(), "cluster": cluster.parser(), "data": data.parser()}
    serve_args = ["--run", "r"]
    snake = parsers["serve"].parse_args([*serve_args, "--llm_backend", "llamacpp", "--max_new_tokens", "8", "--no_llm"])
    kebab = parsers["serve"].parse_args([*serve_args, "--llm-backend", "llamacpp", "--max-new-tokens", "8", "--no-llm"])
    assert snake == kebab and snake.llm_backend == "llamacpp" and snake.no_llm
    assert parsers["cluster"].parse_args(["--run-name", "x"]).run_name == "x"
    for name, parser in parsers.items():
        for action in parser._actions:
            longs = [s for s in action.option_strings if s.startswith("--")]
            if longs and any("_" in s or "-" in s[2:] for s in longs):
                assert "-" not in longs[0][2:], f"{name}: {longs}"
    toy = argparse.ArgumentParser(prog="toy")
    toy.add_argument("--llm-backend")
    with pytest.raises(SystemExit):
        one_flag_style(toy).parse_args(["--llm", "hf"])
    assert "--llm_backend LLM_BACKEND, --llm-backend LLM_BACKEND" in toy.format_help()


def test_run_dir_is_filled_inside_a_settings_group():
    """`{run_dir}` in a field of a DataModule's settings group (candidates.retriever, feedback.teacher) becomes
    <export_root>/<run_name>, as in a flat field."""
    from jsonargparse import Namespace

    from persrag_lightning.stages import fill_run_dir

    args = Namespace(cache_dir="{run_dir}/cache", candidates=Namespace(retriever="{run_dir}/retriever", m=6),
                     feedback=Namespace(teacher="{run_dir}/reranker", llm=None))
    fill_run_dir(args, "checkpoints/r")
    assert (args.cache_dir, args.candidates.retriever, args.feedback.teacher) == (
        "checkpoints/r/cache", "checkpoints/r/retriever", "checkpoints/r/reranker")
    assert args.candidates.m == 6 and args.feedback.llm is None


def test_a_command_whose_extra_the_main_install_leaves_out_names_it_in_one_line(monkeypatch, capsys):
    """`persrag serve` without the `serve` extra (the main job's install has none): exit code 2 and the pip line."""
    import importlib.util

    from persrag_lightning import cli

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else found(name, *a))
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", "--run", "checkpoints/synthlamp-quick"])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip() == 'persrag: error: persrag serve needs fastapi: pip install -e ".[serve]"'
