"""Reading: the one door from a question and its retrieved docs to label scores and an answer
(`Reader`), with the LLM reader and the trained reader behind it, opened by `open_reader`."""

from persrag_lightning.reading.base import Reader
from persrag_lightning.reading.open import LLM_READER, open_reader

__all__ = ["LLM_READER", "Reader", "open_reader"]
