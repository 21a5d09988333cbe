"""Label choice: `score_options` agrees with per-option `score`; the LLM reader's `choose` picks the arg max and
its `generate` answers are post-processed."""

from __future__ import annotations

from pathlib import Path

import pytest

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.llm import LLM, load_llm
from persrag_lightning.llm.answer import allowed_labels, official_postprocess
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.reading.llm import LLMReader
from tests.conftest import word_level_llama

WORDS = [f"w{i}" for i in range(40)] + ["user", "assistant", "1", "2", "3", "4", "5", "[1]", "[2]"]
# Prompts of very different lengths in one batch (left padding), options of 1 to 4 tokens and an empty one.
PROMPTS = ["w1 w2 w3", "w4", "w5 w6 w7 w8 w9 w10 w11 w12 w13", "w14 w15", "w16 w17 w18 w19 w20 w21"]
OPTIONS = ["w30 w31", "w32", "w33 w34 w35 w36", "", "w37 w38 w39", "w30"]


def answer(llm: LLM, task: str, prompts: list[str], mode: str = "generate", max_new_tokens: int | None = None,
           postprocessing: str = "official", calibration: str = "none", decision: str = "auto") -> list[str]:
    """The LLM reader's answers to built prompts under these settings (no store, no remembered terms)."""
    config = LLMConfig(answer_mode=mode, max_new_tokens=max_new_tokens, postprocessing=postprocessing,
                       calibration=calibration, decision=decision)
    return LLMReader(config, llm=llm, remember_terms=False).answer_prompts(task, prompts)


def choose(llm: LLM, prompts: list[str], options: list[str]) -> list[str]:
    """The arg max of `score_options` (ties: the earliest option; NaN never wins), as `decide` takes it."""
    from persrag_lightning.reading.decision import calibrated, decide

    return [decide(options, calibrated(row, None), "argmax") for row in llm.score_options(prompts, options)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer llama (GQA, RoPE) with a word-level tokenizer and a chat template."""
    return word_level_llama(tmp_path_factory.mktemp("tiny-llama-choose"), WORDS)


def per_option_score(llm: LLM, prompts: list[str], options: list[str]) -> list[list[float]]:
    """The reference: one `score` call per (prompt, option) pair."""
    return [[llm.score([p], [o])[0] for o in options] for p in prompts]


@pytest.mark.parametrize("batch_size", [8, 3, 2, 1])
def test_hf_score_options_equals_score(tiny_dir: Path, batch_size: int) -> None:
    """Fails if padding, positions, the packed options' attention mask or option tokenisation are off."""
    llm = load_llm("hf", str(tiny_dir), batch_size=batch_size, device="cpu")
    got = llm.score_options(PROMPTS, OPTIONS)
    want = per_option_score(llm, PROMPTS, OPTIONS)
    assert len(got) == len(PROMPTS) and all(len(r) == len(OPTIONS) for r in got)
    for g_row, w_row in zip(got, want):
        assert g_row == pytest.approx(w_row, abs=1e-4)
    assert all(row[3] == 0.0 for row in got)  # the empty option scores 0, as in `score`
    # The scores really differ between prompts (a cache mixed up across rows would not be caught otherwise).
    assert len({round(r[0], 3) for r in got}) == len(PROMPTS)


def test_hf_score_options_encodes_each_prompt_once(tiny_dir: Path) -> None:
    """One forward per batch whose rows hold each prompt once followed by the options' fed tokens (all but each
    option's last): never a prompt per label, never a copy of the prompt's cache per option."""
    llm = load_llm("hf", str(tiny_dir), batch_size=8, device="cpu")
    calls: list[tuple[int, int]] = []
    hook = llm.model.register_forward_pre_hook(  # type: ignore[attr-defined]
        lambda _m, _a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        llm.score_options(PROMPTS, OPTIONS)
    finally:
        hook.remove()
    longest_prompt = max(len(e) for e in llm._encode_prompts(PROMPTS))  # type: ignore[attr-defined]
    fed = sum(max(0, len(t) - 1) for t in llm.tokenizer(OPTIONS, add_special_tokens=False)["input_ids"])
    assert calls == [(len(PROMPTS), longest_prompt + fed)]


def test_hf_single_token_options_need_one_pass(tiny_dir: Path) -> None:
    llm = load_llm("hf", str(tiny_dir), batch_size=8, device="cpu")
    calls: list[int] = []
    hook = llm.model.register_forward_pre_hook(lambda *_: calls.append(1))  # type: ignore[attr-defined]
    try:
        got = llm.score_options(PROMPTS, ["1", "2", "3", "4", "5"])
    finally:
        hook.remove()
    assert calls == [1]
    for g_row, w_row in zip(got, per_option_score(llm, PROMPTS, ["1", "2", "3", "4", "5"])):
        assert g_row == pytest.approx(w_row, abs=1e-4)


def test_hf_choose_is_argmax_of_score(tiny_dir: Path) -> None:
    llm = load_llm("hf", str(tiny_dir), batch_size=3, device="cpu")
    options = ["w30 w31", "w32", "w33 w34 w35 w36", "w37"]
    chosen = choose(llm, PROMPTS, options)
    for prompt, pick in zip(PROMPTS, chosen):
        scores = llm.score([prompt] * len(options), options)
        assert pick == options[max(range(len(options)), key=scores.__getitem__)]
    assert llm.score_options([], options) == [] and choose(llm, [], options) == []
    with pytest.raises(ValueError, match="non-empty"):
        llm.score_options(PROMPTS, [])


class ScriptedLLM(LLM):
    """Scores from a table keyed by (prompt, target); counts `score` calls; generates a fixed text."""

    backend = "scripted"

    def __init__(self, table: dict[tuple[str, str], float], reply: str = "") -> None:
        super().__init__(batch_size=4)
        self.table, self.reply, self.pairs = table, reply, 0

    @property
    def name(self) -> str:
        return "scripted"

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        self.max_new_tokens = max_new_tokens
        return [self.reply for _ in prompts]

    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        self._check_pairs(prompts, targets)
        self.pairs += len(prompts)
        return [self.table.get((p, t), -10.0) for p, t in zip(prompts, targets)]


def test_default_score_options_and_first_option_wins_ties() -> None:
    table = {("p", "a"): -1.0, ("p", "b"): -1.0, ("p", "c"): -3.0, ("q", "c"): -0.5, ("q", "a"): -2.0}
    llm = ScriptedLLM(table)
    assert llm.score_options(["p", "q"], ["a", "b", "c"]) == [[-1.0, -1.0, -3.0], [-2.0, -10.0, -0.5]]
    assert llm.pairs == 6
    assert choose(llm, ["p", "q"], ["a", "b", "c"]) == ["a", "c"]  # tie between a and b: the first listed
    assert choose(llm, ["p"], ["b", "a", "c"]) == ["b"]
    assert choose(ScriptedLLM({("p", "b"): float("nan")}), ["p"], ["b", "a"]) == ["a"]  # NaN never wins


def test_answer_choose_uses_the_task_labels() -> None:
    table = {("p", "4"): -0.1, ("p", "dystopia"): -0.2, ("q", "[2]"): -0.3}
    llm = ScriptedLLM(table)
    assert answer(llm, "LaMP-3", ["p"], mode="choose") == ["4"]
    assert answer(llm, "LaMP-1", ["q"], mode="choose") == ["[2]"]
    assert answer(llm, "LaMP-2", ["p"], mode="choose") == ["dystopia"]
    assert allowed_labels("LaMP-3") == ("1", "2", "3", "4", "5")
    assert allowed_labels("lamp2") == LAMP2_LABELS
    for task in ("LaMP-4", "LaMP-5", "LaMP-7"):
        with pytest.raises(ValueError, match="label task"):
            answer(llm, task, ["p"], mode="choose")
    with pytest.raises(ValueError, match="answer mode"):
        answer(llm, "LaMP-2", ["p"], mode="vote")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="post-processing"):
        answer(llm, "LaMP-2", ["p"], postprocessing="strict")  # type: ignore[arg-type]


@pytest.mark.parametrize(("task", "reply", "official", "lenient"), [
    ("LaMP-2", "  The tag is: Comedy.\n", "The tag is: Comedy.", "comedy"),
    ("LaMP-2", "dystopia\n", "dystopia", "dystopia"),
    ("LaMP-3", " Score: 4/5 ", "Score: 4/5", "4"),
    ("LaMP-1", "[1]  ", "[1]", "[1]"),
    ("LaMP-1", "Answer: 2", "Answer: 2", "[2]"),
    ("LaMP-4", ' {"title": "Stocks Slide"} ', '{"title": "Stocks Slide"}', "Stocks Slide"),
])
def test_answer_generate_official_strips_only(task: str, reply: str, official: str, lenient: str) -> None:
    llm = ScriptedLLM({}, reply=reply)
    assert answer(llm, task, ["p"], mode="generate") == [official]
    assert answer(llm, task, ["p"], mode="generate", postprocessing="lenient") == [lenient]
    assert official_postprocess(task, reply) == official


def test_answer_generate_budget() -> None:
    llm = ScriptedLLM({}, reply="x")
    answer(llm, "LaMP-2", ["p"])
    assert llm.max_new_tokens == 8  # the task's default budget
    answer(llm, "LaMP-2", ["p"], max_new_tokens=3)
    assert llm.max_new_tokens == 3
    assert answer(llm, "LaMP-2", []) == []
