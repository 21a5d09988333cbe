"""Reading: the one door from a question and its retrieved docs to label scores and an answer
(`Reader`), with the LLM reader and the trained reader behind it, opened by `open_reader`; the
words of the door (calibrations, decision rules, `LabelReading`) in `decision` and `label_reading`.

Importing the package imports no LLM code (`open_reader` imports the readers when it opens one):
llm/registry.py checks its settings with reading.decision, which sits below llm/ in the layers."""

from persrag_lightning.reading.base import Reader
from persrag_lightning.reading.open import LLM_READER, open_reader

__all__ = ["LLM_READER", "Reader", "open_reader"]
