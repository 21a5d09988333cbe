"""Label tasks of converted folders: `get_task("labels")` resolves to the folder's own label set once the folder is
read (its convert.json), and is a clear error before; a task that contradicts the folder is refused; an export's
docstore carries the labels so serving knows them without the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from persrag_lightning.data import tasks
from persrag_lightning.data.convert import ConvertOptions, convert_log
from persrag_lightning.data.docstore import read_docstore, write_docstore
from persrag_lightning.data.folder_task import folder_task, resolve_task
from persrag_lightning.data.lamp import LampFormatError, load_lamp
from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.tasks import LAMP2_LABELS, get_task
from tests.helpers.logs import news_log

OPTIONS = ConvertOptions(task="labels", user="authors", user_sep=",", date="date", text="headline,short_description",
                         label="category", item="link")


@pytest.fixture
def no_folder_read(monkeypatch):
    """A process that has read no converted folder yet."""
    monkeypatch.setattr(tasks, "_FOLDER_TASKS", {})


@pytest.fixture
def news(tmp_path) -> Path:
    log = tmp_path / "news.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in news_log()))
    convert_log(log, tmp_path / "news", OPTIONS)
    return tmp_path / "news"


def test_the_label_task_is_the_folders_once_it_is_read_and_a_clear_error_before(no_folder_read, news):
    with pytest.raises(ValueError, match="takes its labels from a converted folder: name the folder with --data_dir"):
        get_task("labels")
    dataset = load_lamp(news, "labels")
    labels = json.loads((news / "convert.json").read_text())["task"]["labels"]
    spec = get_task("labels")
    assert (spec.name, spec.kind, spec.labels, spec.label_field) == ("labels", "classification", tuple(labels),
                                                                     "label")
    assert get_task("Labels") is spec and dataset.task == "labels"
    example = dataset.examples["test"][0]
    assert example.query and example.input.endswith(example.query) and "text:" not in example.query
    assert spec.doc_label(HistoryDoc("d", (2020,), {"text": "x", "label": labels[2]})) == 3
    assert spec.doc_label(HistoryDoc("d", (2020,), {"text": "x", "label": "NOT A LABEL"})) == 0
    assert get_task("LaMP-2").labels == LAMP2_LABELS  # LaMP-2 keeps its 15 tags


def test_the_task_is_read_from_the_folder_and_a_contradiction_is_refused(no_folder_read, news, tmp_path):
    assert resolve_task(None, news) == "labels" and folder_task(news) == "labels"
    assert resolve_task(None, None) == "LaMP-2" and resolve_task(None, tmp_path) == "LaMP-2"  # no convert.json
    with pytest.raises(LampFormatError, match=f"task: 'LaMP-2', but {news} was converted for labels"):
        resolve_task("LaMP-2", news)
    with pytest.raises(LampFormatError, match="was converted for labels"):
        LampSource("LaMP-2", str(news))
    assert LampSource("labels", str(news)).task == "labels"


def test_a_labels_task_without_its_folder_says_how_to_name_it(no_folder_read):
    with pytest.raises(ValueError, match="--data_dir"):
        LampSource("labels", None)


def test_a_malformed_manifest_is_one_line_naming_it(no_folder_read, tmp_path):
    (tmp_path / "convert.json").write_text(json.dumps({"task": {"name": "labels", "labels": []}}))
    with pytest.raises(LampFormatError, match=r"convert.json: task: task 'labels': expected its labels as a list"):
        folder_task(tmp_path)


def test_an_exported_docstore_carries_the_label_set(news, tmp_path, monkeypatch):
    dataset = load_lamp(news, "labels")
    labels = get_task("labels").labels
    write_docstore(tmp_path / "store", dataset)
    monkeypatch.setattr(tasks, "_FOLDER_TASKS", {})  # a serving process, without the folder
    again = read_docstore(tmp_path / "store")
    assert again.task == "labels" and get_task("labels").labels == labels
    write_docstore(tmp_path / "lamp2", type(dataset)("LaMP-2", dataset.users))
    assert json.loads((tmp_path / "lamp2" / "task.json").read_text()) == {"task": "LaMP-2"}


def test_the_label_set_is_the_train_splits_and_a_later_label_is_not_asked(no_folder_read, tmp_path):
    """User a's labels: x, x, y, y, x, then z on its test item; user b's: x, y, x, y, x, w on its dev item. z and w
    are never in train: neither becomes a label, and the two questions are not asked (counted)."""
    rows = [{"user": u, "date": f"2020-01-0{d}", "text": f"{u} wrote {d}", "label": lab}
            for u, labels in (("a", "xxyyxz"), ("b", "xyxywx")) for d, lab in enumerate(labels, 1)]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversion = convert_log(log, tmp_path / "out", ConvertOptions(task="labels", user="user", date="date",
                                                                   text="text", label="label"))
    assert conversion.label_set == ["x", "y"] and conversion.not_asked == {"label not in the train split": 2}
    assert conversion.questions == {"train": 4, "dev": 1, "test": 1}
    dataset = load_lamp(tmp_path / "out", "labels")
    assert {e.target for s in dataset.examples.values() for e in s} == {"x", "y"}
