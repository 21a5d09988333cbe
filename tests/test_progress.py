"""Progress lines of long phases: counts, the ETA, the final line, and results kept in order."""

from __future__ import annotations

from persrag_lightning import progress as progress_module
from persrag_lightning.progress import in_blocks


def test_in_blocks_keeps_order_and_reports_each_block(capsys):
    calls = []

    def compute(part):
        calls.append(list(part))
        return [i * 10 for i in part]

    assert in_blocks(range(7), compute, "phase x", block=3, every=0) == [0, 10, 20, 30, 40, 50, 60]
    assert calls == [[0, 1, 2], [3, 4, 5], [6]]
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("[phase x] 3/7 prompts (43 %) (ETA ")
    assert lines[-1].startswith("[phase x] 7/7 prompts in ")


def test_no_phase_or_one_block_is_one_call_and_silent(capsys):
    calls = []
    assert in_blocks([4, 5], lambda part: calls.append(part) or part, "p", block=8) == [4, 5]
    assert in_blocks(range(20), lambda part: calls.append(part) or part, None, block=8) == list(range(20))
    assert len(calls) == 2 and capsys.readouterr().err == ""


def test_eta_is_empty_before_the_first_item():
    assert progress_module.eta(0.0, 0, 10) == ""
