"""`stage_config` resolves a stage's `fit` configuration through PersragCLI's own parser, built without running the
CLI: for every stage config of configs/ it is what `train.py fit --config <config> ...` parses, typed overrides and
a user's arguments included."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import cli_parse

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FIT_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if "model" in (yaml.safe_load(p.read_text()) or {}))


def test_every_stage_config_is_found() -> None:
    assert {"cfrag_user_encoder.yaml", "cfrag_retriever.yaml", "cfrag_reranker.yaml", "generator.yaml",
            "reader.yaml"} <= set(FIT_CONFIGS)


@pytest.mark.parametrize("config", FIT_CONFIGS)
def test_stage_config_is_the_clis_own_parse(config: str) -> None:
    from persrag_lightning.commands.train import stage_config

    assert stage_config(config, {}) == cli_parse(["fit", "--config", config])
    extra = ["--trainer.max_epochs=5", "--config", str(CONFIGS / "wandb.yaml"), "--seed_everything=7"]
    resolved = stage_config(config, {"trainer.max_epochs": 3, "run_name": "x", "stage_name": None}, extra)
    assert resolved == cli_parse(["fit", "--config", config, "--trainer.max_epochs=3", "--run_name=x", *extra])
    assert resolved.fit.trainer.max_epochs == 5 and resolved.fit.run_name == "x"


def test_stage_config_runs_nothing(monkeypatch) -> None:
    """Only the parser is built: no seeding, no run folder, no model or trainer."""
    import lightning as L

    from persrag_lightning.commands import train

    def refuse(*_, **__):
        raise AssertionError("stage_config ran part of the CLI")

    for name in ("_set_seed", "before_instantiate_classes", "instantiate_classes", "_run_subcommand"):
        monkeypatch.setattr(train.PersragCLI, name, refuse)
    monkeypatch.setattr(L.LightningModule, "__init__", refuse)
    train._parsed_config_files.cache_clear()
    assert train.stage_config("cfrag_retriever.yaml", {}).fit.model.class_path.startswith("persrag_lightning.")


def test_a_stage_with_an_overlay_is_the_clis_parse_of_both_files() -> None:
    """The split reranker's stage lays configs/overlays/reranker_split.yaml over the distilled reranker's config:
    resolved, it is `train.py fit --config <config> --config <overlay> ...`, and its own overrides win."""
    from persrag_lightning.commands.train import stage_config
    from persrag_lightning.stages import SPLIT_RERANKER, STAGES, config_args

    stage = STAGES[SPLIT_RERANKER]
    resolved = stage_config(stage.config, stage.override_values("checkpoints/x"), (), stage.overlays)
    assert resolved == cli_parse(["fit", *config_args(stage.config, stage.overlays), *stage.arguments("checkpoints/x")])
    config = resolved.fit.model.init_args.config
    assert (config.num_layers, config.split_layer, resolved.fit.stage_name) == (None, 5, SPLIT_RERANKER)
