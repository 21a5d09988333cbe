"""A label task of a converted folder in the reader's path: Table 4's LaMP-2 row over the folder's labels, the
labels `choose` scores, and the lenient mapping of an answer onto them."""

from __future__ import annotations

from persrag_lightning.data import tasks
from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.tasks import LAMP2_LABELS, label_task, register_task
from persrag_lightning.llm.answer import allowed_labels
from persrag_lightning.llm.postprocess import default_max_new_tokens, postprocess
from persrag_lightning.llm.prompts import build_prompt, content_free_prompt, task_prompt
from tests.llm.test_choose import ScriptedLLM, answer

LABELS = ("BUSINESS", "STYLE & BEAUTY", "WORLD NEWS")


def test_the_prompt_lists_the_folders_labels_and_the_reader_scores_them(monkeypatch):
    monkeypatch.setattr(tasks, "_FOLDER_TASKS", {})
    register_task(label_task(LABELS))
    doc = HistoryDoc("d1", (2020, 1, 1), {"text": "Paris shows a new season of dresses.", "label": "STYLE & BEAUTY"})
    prompt = build_prompt("labels", "Which label ... text: Markets rally after the merger.", [doc], lambda s: len(s))
    assert "select the label from [BUSINESS, STYLE & BEAUTY, WORLD NEWS]" in prompt
    assert '"text":Paris shows a new season of dresses.; "label":STYLE & BEAUTY' in prompt
    assert prompt.endswith('"text":Markets rally after the merger.; "label":')
    assert content_free_prompt("labels", "N/A").endswith('"text":N/A; "label":')
    assert allowed_labels("labels") == LABELS and default_max_new_tokens("labels") == 16
    llm = ScriptedLLM({("p", "WORLD NEWS"): -0.2, ("p", "BUSINESS"): -0.9})
    assert answer(llm, "labels", ["p"], mode="choose") == ["WORLD NEWS"]
    assert postprocess("labels", "Label: style & beauty.") == "STYLE & BEAUTY"
    assert f"[{', '.join(LAMP2_LABELS)}]" in task_prompt("LaMP-2").instruction  # LaMP-2 keeps its 15 tags
