"""Continuous batching's decoder (llm/hf_stepping.py) on the tiny random llama: rows that join the batch at
different steps, with prompts of different lengths and different budgets, each decode exactly what `generate`
gives the same prompt alone; rows leave when their budget is spent, and cache positions no row uses go with them."""

from __future__ import annotations

import pytest

from persrag_lightning.llm.hf import HFLLM
from persrag_lightning.llm.hf_stepping import GreedyRows, stepping_unsupported

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["a detective hunts a killer in a rainy city at night, with the rain falling on every roof of the old town",
           "two friends", "a space ship lost near a dying star", "hi", "a knight, a dragon and a long road home"]


@pytest.fixture(scope="module")
def llm(tiny_llm) -> HFLLM:
    return HFLLM(tiny_llm, device="cpu", dtype="float32")


def test_rows_joining_and_leaving_decode_what_each_decodes_alone(llm):
    rows, out = GreedyRows(llm), {}

    def record(ended) -> None:
        for e in ended:
            assert e.key not in out
            out[e.key] = e.text

    record(rows.admit([0, 1], PROMPTS[:2], budget=9))
    for _ in range(3):
        record(rows.step())
    record(rows.admit([2], PROMPTS[2:3], budget=4))  # joins two rows three tokens in, ends before them
    record(rows.step())
    record(rows.admit([3, 4], PROMPTS[3:], budget=12))
    widths = []
    while len(rows):
        record(rows.step())
        widths.append(rows._mask.shape[1] if len(rows) else 0)
    assert sorted(out) == [0, 1, 2, 3, 4]
    budgets = [9, 9, 4, 12, 12]
    for i, prompt in enumerate(PROMPTS):
        assert out[i] == llm.generate([prompt], budgets[i])[0], i
    # once the long first prompt's row left, its positions went: the cache is as wide as the rows left need
    assert max(widths[-3:]) < max(widths)


def test_a_row_ends_at_its_budget_and_the_decoder_empties(llm):
    rows = GreedyRows(llm)
    ended = rows.admit(["only"], ["hi"], budget=1)  # its first token spends the budget: it ends at the prefill
    assert [e.key for e in ended] == ["only"] and len(rows) == 0 and rows.step() == []
    with pytest.raises(ValueError, match="budget"):
        rows.admit(["x"], ["hi"], budget=0)


def test_what_cannot_decode_row_by_row_is_named(llm, tiny_llm):
    class OtherBackend:
        backend = "llamacpp"

    assert stepping_unsupported(llm) is None
    assert "llamacpp" in stepping_unsupported(OtherBackend())
    beams = HFLLM(tiny_llm, device="cpu", dtype="float32", num_beams=2)
    assert "beam" in stepping_unsupported(beams)
    with pytest.raises(ValueError, match="beam"):
        GreedyRows(beams)
