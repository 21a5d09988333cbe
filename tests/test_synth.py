"""SynthLaMP: determinism, the community structure CFRAG needs, idempotency and the command line."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from persrag_lightning.data.lamp import load_lamp
from persrag_lightning.data.synth import (
    FILM_KINDS,
    SynthConfig,
    build_world,
    generate_synth_lamp,
    is_complete,
    iter_synth_users,
    load_communities,
    main,
)
from persrag_lightning.data.tasks import LAMP2_LABELS

SMALL = SynthConfig(num_users=120, docs_per_user=(10, 30), seed=7)


def all_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    a = all_bytes(generate_synth_lamp(tmp_path / "a", SMALL))
    b = all_bytes(generate_synth_lamp(tmp_path / "b", SMALL))
    c = all_bytes(generate_synth_lamp(tmp_path / "c", replace(SMALL, seed=8)))
    assert a == b
    assert sorted(a) == ["communities.json", "dev_outputs.json", "dev_questions.json", "synth_config.json",
                         "train_outputs.json", "train_questions.json"]
    assert a["train_questions.json"] != c["train_questions.json"]
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]  # no temp files left behind


def test_files_match_latents_and_questions_follow_history(tmp_path: Path) -> None:
    generate_synth_lamp(tmp_path, SMALL)
    ds = load_lamp(tmp_path, "LaMP-2")
    users = list(iter_synth_users(SMALL))
    assert load_communities(tmp_path) == {u.user_id: u.community for u in users}
    examples = {e.example_id: e for split in ds.examples.values() for e in split}
    for u in users:
        history = ds.users[u.user_id].docs
        assert [d.doc_id for d in history] == [d.doc_id for d in u.docs]
        assert [d.fields for d in history] == [d.fields for d in u.docs]
        dev_q = [q for q in u.questions if q.split == "dev"]
        train_q = [q for q in u.questions if q.split == "train"]
        assert u.docs[-1].date < min(q.date for q in u.questions)  # every question is newer than the history
        assert max(q.date for q in train_q) < min(q.date for q in dev_q)  # time-based split
        for q in u.questions:
            ex = examples[q.example_id]
            assert (ex.target, ex.split, ex.user_id) == (q.target, q.split, u.user_id)
            assert ex.query in q.input and q.target in LAMP2_LABELS


def test_unseen_questions_are_answered_by_the_community(tmp_path: Path) -> None:
    """The Fig. 1 situation: a question on an unseen kind is answerable from same-community users."""
    world = build_world(SMALL)
    users = list(iter_synth_users(SMALL, world))
    by_kind_style: dict[tuple[int, int, int], set[str]] = defaultdict(set)  # (community, kind, style) -> users
    for u in users:
        for d in u.docs:
            by_kind_style[u.community, d.kind, d.style].add(u.user_id)
    questions = [(u, q) for u in users for q in u.questions]
    unseen = [(u, q) for u, q in questions if q.unseen]
    assert 0.5 < len(unseen) / len(questions) < 0.7  # unseen_fraction = 0.6
    supported = 0
    for u, q in unseen:
        assert q.kind not in {d.kind for d in u.docs}
        assert q.style == world.styles[u.community, q.kind]  # the target is the community's tag for that kind
        supported += bool(by_kind_style[u.community, q.kind, q.style] - {u.user_id})
    assert supported / len(unseen) > 0.9
    # Seen questions are answerable from the user's own history (up to noise).
    for u, q in questions:
        if not q.unseen:
            assert any(d.kind == q.kind and d.style == q.style for d in u.docs) or all(
                d.noisy for d in u.docs if d.kind == q.kind)
    # Communities really disagree: most kinds get different tags in different communities.
    disagree = sum(len(set(world.styles[:, k].tolist())) > 1 for k in range(len(FILM_KINDS)))
    assert disagree >= len(FILM_KINDS) // 2
    noisy = sum(d.noisy for u in users for d in u.docs) / sum(len(u.docs) for u in users)
    assert 0.05 < noisy < 0.15


@pytest.mark.parametrize("task,fields", [("LaMP-5", {"title", "abstract"}), ("LaMP-4", {"text", "title"})])
def test_title_tasks(tmp_path: Path, task: str, fields: set[str]) -> None:
    config = SynthConfig(task=task, num_users=60, docs_per_user=(8, 16), test_questions_per_user=1, seed=1)
    generate_synth_lamp(tmp_path, config)
    ds = load_lamp(tmp_path, task)
    assert {s: len(v) for s, v in ds.examples.items()} == {"train": 120, "dev": 60, "test": 60}
    assert set(next(iter(ds.users.values())).docs[0].fields) == fields
    world = build_world(config)
    users = list(iter_synth_users(config, world))
    styles: dict[tuple[int, int, int], set[str]] = defaultdict(set)  # (community, kind, style) -> users
    for u in users:
        for d in u.docs:
            styles[u.community, d.kind, d.style].add(u.user_id)
    unseen = supported = 0
    for u in users:
        for q in u.questions:
            ex = next(e for e in ds.examples[q.split] if e.example_id == q.example_id)
            assert ex.target == q.target and ex.query and ex.query in q.input
            if q.unseen:  # the community's style of titling shows in other users' titles on that topic
                unseen += 1
                supported += bool(styles[u.community, q.kind, q.style] - {u.user_id})
    assert supported / unseen > 0.75


def test_idempotent_and_regenerates_on_new_config(tmp_path: Path) -> None:
    config = SynthConfig(num_users=20, docs_per_user=(3, 6))
    generate_synth_lamp(tmp_path, config)
    assert is_complete(tmp_path, config)
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    generate_synth_lamp(tmp_path, SynthConfig(num_users=20, docs_per_user=[3, 6], task="LaMP_2"))  # same config
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps

    bigger = replace(config, num_users=25, test_questions_per_user=1)
    generate_synth_lamp(tmp_path, bigger)
    assert not is_complete(tmp_path, config) and is_complete(tmp_path, bigger)
    assert len(load_lamp(tmp_path, "LaMP-2").users) == 25
    generate_synth_lamp(tmp_path, config)  # back again: the stale test split is removed
    assert not (tmp_path / "test_questions.json").exists()
    assert json.loads((tmp_path / "synth_config.json").read_text())["config"]["num_users"] == 20


def test_refuses_to_overwrite_foreign_lamp_data(tmp_path: Path) -> None:
    (tmp_path / "train_questions.json").write_text("[]")
    with pytest.raises(FileExistsError, match="not made by SynthLaMP"):
        generate_synth_lamp(tmp_path, SynthConfig(num_users=5))
    assert load_communities(tmp_path) is None


def test_config_validation() -> None:
    assert SynthConfig(task="lamp5").task == "LaMP-5"
    for bad in ({"task": "LaMP-3"}, {"kinds_per_user": (3, 16)}, {"docs_per_user": (5, 2)},
                {"train_questions_per_user": 0}, {"unseen_fraction": 1.5}):
        with pytest.raises(ValueError):
            SynthConfig(**bad)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = main([str(tmp_path / "cli"), "--task", "LaMP-5", "--num-users", "15", "--seed", "2",
                "--docs-per-user", "3", "5"])
    assert capsys.readouterr().out.strip() == str(out)
    assert is_complete(out, SynthConfig(task="LaMP-5", num_users=15, seed=2, docs_per_user=(3, 5)))
