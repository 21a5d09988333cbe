"""The users' histories shipped next to the exported bundles, so serving renders prompts without the
LaMP files."""

from __future__ import annotations

import json
from pathlib import Path

from persrag_lightning.data.lamp import format_date, parse_date
from persrag_lightning.data.records import HistoryDoc, LampDataset, User
from persrag_lightning.data.tasks import define_task, task_record
from persrag_lightning.utils import atomic_open, atomic_write_json

__all__ = ["USERS_FILE", "history_from_json", "read_docstore", "write_docstore"]

USERS_FILE = "users.jsonl"


def write_docstore(path: str | Path, dataset: LampDataset) -> Path:
    """One JSON line per user ({user_id, docs: [{id, date, fields}], share: false only for private
    users}) plus the task (a label task with its labels, so serving knows them without the folder);
    written atomically."""
    path = Path(path)
    with atomic_open(path / USERS_FILE) as f:
        for uid in dataset.user_ids():
            docs = [{"id": d.doc_id, "date": format_date(d.date), "fields": d.fields} for d in dataset.users[uid].docs]
            line = {"user_id": uid, "docs": docs, **({"share": False} if uid in dataset.private else {})}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    record = task_record(dataset.task)
    atomic_write_json(path / "task.json", {"task": record.pop("name"), **record})
    return path


def history_from_json(docs: list[dict]) -> list[HistoryDoc]:
    """Docs given as {id, date, fields} (serving's add_user uses the same shape), oldest first."""
    out = [HistoryDoc(str(d["id"]), parse_date(str(d["date"])), {k: str(v) for k, v in d["fields"].items()})
           for d in docs]
    return sorted(out, key=lambda d: d.date)


def read_docstore(path: str | Path) -> LampDataset:
    path = Path(path)
    if not (path / USERS_FILE).exists():
        raise FileNotFoundError(f"no docstore at {path}; it is exported with the user encoder "
                                "(`python train.py fit --config cfrag_user_encoder.yaml`)")
    stored = json.loads((path / "task.json").read_text())
    task = define_task({**stored, "name": stored["task"]})
    users, private = {}, set()
    with open(path / USERS_FILE, encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            users[obj["user_id"]] = User(obj["user_id"], history_from_json(obj["docs"]))
            if obj.get("share", True) is False:
                private.add(obj["user_id"])
    return LampDataset(task, users, private=private)
