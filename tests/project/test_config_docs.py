"""Every field a YAML in configs/ can set has a description: jsonargparse reads the `Args:` sections of the
classes the configs name by `class_path` (and of the dataclasses their parameters take) into `--help` and
`--model.help` / `--data.help` text."""

from __future__ import annotations

import dataclasses
import importlib
import typing
from pathlib import Path

import pytest
import yaml
from jsonargparse import ArgumentParser

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# fitted state a strategy may be handed by code (numpy arrays), never written in a YAML
RUNTIME_OBJECTS = ("CohortModel",)
STAGE_CONFIGS = ("cfrag_user_encoder.yaml", "cfrag_retriever.yaml", "cfrag_reranker.yaml",
                 "cfrag_reranker_distilled.yaml", "generator.yaml")


def class_paths(node: object) -> set[str]:
    """Our class paths anywhere in a parsed YAML (Lightning's own, e.g. callbacks, document themselves)."""
    found: set[str] = set()
    if isinstance(node, dict):
        if str(node.get("class_path", "")).startswith("persrag_lightning."):
            found.add(node["class_path"])
        for value in node.values():
            found |= class_paths(value)
    elif isinstance(node, list):
        for value in node:
            found |= class_paths(value)
    return found


def configured_classes() -> list[str]:
    """Every class a config names, and the LaMP evaluator an evaluate config gets when it names none."""
    paths = {"persrag_lightning.evaluation.evaluate.Evaluation"}
    for path in sorted(CONFIGS.glob("**/*.yaml")):
        paths |= class_paths(yaml.safe_load(path.read_text()))
    return sorted(paths)


def load(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def hints(cls: type) -> list:
    return list(typing.get_type_hints(cls if dataclasses.is_dataclass(cls) else cls.__init__).values())


def nested_dataclasses(cls: type) -> set[type]:
    """Dataclasses a parameter of `cls` takes (e.g. `synth: SynthConfig | None`), and theirs: YAML sets their
    fields too."""
    found: set[type] = set()
    pending = hints(cls)
    while pending:
        hint = pending.pop()
        if (isinstance(hint, type) and dataclasses.is_dataclass(hint) and hint is not cls and hint not in found
                and hint.__name__ not in RUNTIME_OBJECTS):
            found.add(hint)
            pending.extend(hints(hint))
        pending.extend(typing.get_args(hint))
    return found


def undocumented(cls: type) -> list[str]:
    """Fields of `cls`, as LightningCLI's subclass mode adds them, whose help text is empty."""
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "init_args", fail_untyped=False)
    actions = [a for a in parser._actions if a.dest.startswith("init_args.")]
    assert actions, f"{cls.__name__} adds no arguments"
    return [a.dest for a in actions if not (a.help or "").strip()]


def test_stage_configs_name_their_classes():
    """The stage configs' model and data classes are among the classes checked below."""
    checked = set(configured_classes())
    for name in STAGE_CONFIGS:
        config = yaml.safe_load((CONFIGS / name).read_text())
        assert {config["model"]["class_path"], config["data"]["class_path"]} <= checked, name


@pytest.mark.parametrize("class_path", configured_classes())
def test_every_configured_field_has_a_description(class_path: str):
    cls = load(class_path)
    missing = {f"{cls.__name__}": undocumented(cls)}
    for nested in sorted(nested_dataclasses(cls), key=lambda c: c.__name__):
        missing[nested.__name__] = undocumented(nested)
    missing = {name: fields for name, fields in missing.items() if fields}
    assert not missing, f"fields without an `Args:` entry: {missing}"


@pytest.mark.parametrize("config", STAGE_CONFIGS)
def test_print_config_comments_describes_every_model_and_data_field(config, capsys) -> None:
    """`train.py fit --config X --print_config=comments` (ruamel.yaml writes the comments): each field of the
    model's and the data's init_args is preceded by its description."""
    from persrag_lightning.commands.train import lightning_command

    with pytest.raises(SystemExit):
        lightning_command(["fit", "--config", config, "--print_config=comments"])
    text = capsys.readouterr().out
    for section in ("model", "data"):
        block = text.split(f"\n{section}:\n", 1)[1].split("\n\n# ", 1)[0]
        fields = [line for line in block.splitlines() if line.startswith("    ") and not line.startswith("     ")
                  and ":" in line and not line.lstrip().startswith("#")]
        lines = block.splitlines()
        assert fields, f"{config}: no {section} fields printed"
        for line in fields:
            i, comment = lines.index(line) - 1, []
            while i >= 0 and lines[i].strip().startswith("#"):  # the comment block right above the field
                comment.insert(0, lines[i].strip().lstrip("# "))
                i -= 1
            described = " ".join(comment).split("(type:", 1)[0].strip()  # jsonargparse adds the type to any help
            assert described, f"{config}: {section} field {line.strip()!r} has no description"
