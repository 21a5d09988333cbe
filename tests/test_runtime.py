"""The runtime policy: the fastest measured float32 GEMM path wins (a failing one is skipped with a line), and a
model routed through any path answers as torch's does, while training stays torch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from persrag_lightning import runtime
from persrag_lightning.runtime import GemmLinear, GemmPath, apply_gemm_path, measure_gemm

SMALL = {"reader": ((64, 16, 32),), "encoders": ((64, 8, 16),)}


def fake_timer(seconds: dict[str, float]):
    """A timer that answers by path name (no clock): the choice is arithmetic."""
    return lambda name, fn, x: seconds[name]


def no_path(w, b, threads):
    raise ImportError("No module named 'nowhere'")


def test_the_fastest_measured_path_wins_and_a_failing_path_is_skipped_with_a_line():
    paths = [runtime.PATHS["torch"], runtime.PATHS["torch-kn"], GemmPath("broken", "cannot load", no_path)]
    choice = measure_gemm(paths, SMALL, threads=1, timer=fake_timer({"torch": 2.0, "torch-kn": 1.0}))
    assert choice.chosen == {"reader": "torch-kn", "encoders": "torch-kn"}
    assert choice.skipped == {"broken": "No module named 'nowhere'"}
    assert choice.rates["reader"]["torch-kn"] == pytest.approx(2 * runtime.gflops(SMALL["reader"], 2.0))
    lines = choice.lines()
    assert lines[0] == "float32 GEMM path broken: skipped (No module named 'nowhere')"
    assert lines[1].startswith("float32 GEMM path for the reader: torch-kn (GFLOP/s on 1 threads: torch-kn ")
    assert "broken" not in choice.rates["reader"] and choice.record()["skipped"] == choice.skipped


def test_torch_stays_unless_another_path_is_clearly_faster():
    paths = [runtime.PATHS["torch"], runtime.PATHS["torch-kn"]]
    near = fake_timer({"torch": 1.0, "torch-kn": 1.0 / (runtime.MIN_GAIN - 0.05)})
    assert measure_gemm(paths, SMALL, 1, near).chosen["reader"] == "torch"
    assert runtime.choose_path({"torch": 10.0, "torch-kn": 12.0, "onednn": 11.5}) == "torch-kn"
    assert runtime.choose_path({"torch": 10.0, "onednn": 9.0}) == "torch"


def test_a_path_with_its_own_thread_pool_is_measured_and_shown_but_chosen_only_when_named():
    """numpy's OpenBLAS, OpenVINO and ONNX Runtime run their own threads beside torch's: fast alone, they lost end
    to end in the reader (docs/performance/runtime.md), so a measurement alone never picks them."""
    assert runtime.choose_path({"torch": 10.0, "onednn": 11.5, "numpy": 20.0, "openvino": 30.0}) == "onednn"
    paths = [runtime.PATHS["torch"], runtime.PATHS["numpy"]]
    choice = measure_gemm(paths, SMALL, 1, fake_timer({"torch": 2.0, "numpy": 1.0}))
    assert choice.chosen == {"reader": "torch", "encoders": "torch"} and choice.rates["reader"]["numpy"] > 0
    numpy = choice.rates["reader"]["numpy"]
    assert choice.lines()[0].endswith(f"; beside torch's threads, chosen only when named: numpy {numpy:.0f})")


def test_no_path_at_all_is_an_error_that_names_why():
    with pytest.raises(RuntimeError, match="nowhere"):
        measure_gemm([GemmPath("broken", "", no_path)], SMALL, 1, fake_timer({}))


def test_the_environment_names_a_path_without_measuring(monkeypatch):
    monkeypatch.setenv(runtime.ENV, "torch-kn")
    choice = runtime.gemm_choice()
    assert choice.forced and choice.chosen == {"reader": "torch-kn", "encoders": "torch-kn"}
    assert choice.lines() == ["float32 GEMM path: torch-kn (PERSRAG_GEMM; not measured)"]
    monkeypatch.setenv(runtime.ENV, "mkl-please")
    with pytest.raises(ValueError, match="PERSRAG_GEMM='mkl-please': use auto or one of torch, torch-kn"):
        runtime.gemm_choice()


def test_a_measured_choice_prints_the_pin_that_repeats_it_per_consumer(monkeypatch):
    """The paths sum in different orders, so a run's table can follow its choice: a measured choice names the
    `PERSRAG_GEMM` value that gives another run the same paths, one per consumer where they differ, and that value
    gives them without measuring."""
    choice = runtime.GemmChoice(2, {"reader": {"torch": 1.0, "onednn": 2.0}, "encoders": {"torch": 1.0}},
                                {"reader": "onednn", "encoders": "torch"})
    assert choice.lines()[-1] == "PERSRAG_GEMM=reader:onednn,encoders:torch gives another run these paths without measuring"
    assert choice.record()["pin"] == "reader:onednn,encoders:torch"
    monkeypatch.setenv(runtime.ENV, choice.pin())
    pinned = runtime.gemm_choice()
    assert pinned.forced and pinned.chosen == choice.chosen and pinned.rates == {}
    assert pinned.lines() == ["float32 GEMM path: reader:onednn,encoders:torch (PERSRAG_GEMM; not measured)"]
    assert runtime.pinned_paths("encoders:torch-kn") == {"reader": "torch", "encoders": "torch-kn"}
    with pytest.raises(ValueError, match="'readers:onednn' is not <consumer>:<path> with a consumer of reader, encoders"):
        runtime.pinned_paths("readers:onednn")
    with pytest.raises(ValueError, match="'encoders:mkl' is not <consumer>:<path>"):
        runtime.pinned_paths("reader:onednn, encoders:mkl")


def test_the_thread_count_changes_only_where_torch_measures_clearly_faster():
    threads = torch.get_num_threads()
    faster_on_two = lambda name, fn, x: {1: 2.0, 2: 1.0}[torch.get_num_threads()]
    try:
        torch.set_num_threads(1)
        assert runtime.best_threads([1, 2], faster_on_two) == 2
        assert runtime.best_threads([1, 2], lambda name, fn, x: 1.0) == 1
        assert runtime.best_threads([1], faster_on_two) == 1
        assert torch.get_num_threads() == 1  # measuring puts torch's count back; gemm_choice sets the winner
    finally:
        torch.set_num_threads(threads)


def available(name: str) -> bool:
    try:
        runtime.PATHS[name].prepare(torch.ones(2, 2), None, 1)
    except Exception:  # noqa: BLE001 - the path cannot load here (an extra not installed)
        return False
    return True


PATHS = [pytest.param(name, marks=pytest.mark.skipif(not available(name), reason=f"{name} cannot load here"))
         for name in runtime.PATHS]


@pytest.mark.parametrize("path", PATHS)
def test_a_tiny_llm_on_every_path_gives_torchs_logits_and_trains_as_torch(path, tiny_llm, one_thread):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llm).eval()
    ids = torch.randint(5, 1000, (3, 24))  # 72 rows: above MIN_ROWS, so the path computes
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert apply_gemm_path(model, path) == (0 if path == "torch" else linears)
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    assert torch.allclose(after, before, atol=1e-5, rtol=1e-4)
    assert list(model.state_dict()) == keys
    if path != "torch":
        assert any(m in runtime._PREPARED for m in model.modules())  # the path ran, not a fallback
    model.train()  # training: autograd through torch's own linear, gradients on the same parameters
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert apply_gemm_path(model, "torch") == (0 if path == "torch" else linears)
    assert not any(isinstance(m, GemmLinear) for m in model.modules())


def test_changed_weights_are_packed_again(one_thread):
    layer = nn.Linear(8, 4).eval()
    apply_gemm_path(layer, "torch-kn")
    x = torch.randn(40, 8)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2.0)
        layer.bias.zero_()
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_the_encoders_and_the_reader_use_the_chosen_path(monkeypatch, tiny_bert, tiny_llm, one_thread):
    from persrag_lightning.llm.hf import HFLLM
    from persrag_lightning.models.text_encoder import TextEncoder

    texts = [f"a doc about topic {i} and its many words" for i in range(8)]
    encoder = TextEncoder.from_pretrained(tiny_bert)
    reference = encoder.encode(texts)
    monkeypatch.setenv(runtime.ENV, "torch-kn")
    converted = TextEncoder.from_pretrained(tiny_bert)
    assert torch.allclose(converted.encode(texts), reference, atol=1e-5)
    assert any(isinstance(m, GemmLinear) for m in converted.modules())
    llm = HFLLM(tiny_llm, batch_size=4, device="cpu", dtype="float32")
    assert llm.gemm == "torch-kn" and any(isinstance(m, GemmLinear) for m in llm.model.modules())
    monkeypatch.setenv(runtime.ENV, "torch")
    plain = HFLLM(tiny_llm, batch_size=4, device="cpu", dtype="float32")
    prompts, targets = [f"question {i} " * 12 for i in range(4)], ["yes", "no", "yes", "no"]
    assert llm.score(prompts, targets) == pytest.approx(plain.score(prompts, targets), abs=1e-4)


def test_a_named_path_that_cannot_load_is_refused_at_once(monkeypatch):
    monkeypatch.setitem(runtime.PATHS, "broken", GemmPath("broken", "cannot load", no_path))
    monkeypatch.setenv(runtime.ENV, "broken")
    with pytest.raises(ValueError, match="PERSRAG_GEMM=broken: this path cannot load here: No module named"):
        runtime.gemm_choice()


def test_a_served_run_takes_its_records_paths_unless_the_environment_names_some(monkeypatch):
    """Serving follows the run's record (`follow_recorded`): its paths become the process's where PERSRAG_GEMM is
    unset, without measuring; the variable set wins; a path that cannot load here, or none recorded, leaves the
    choice to measurement, each said in the line."""
    monkeypatch.setattr(runtime, "_FOLLOWED", {})
    monkeypatch.setenv(runtime.ENV, "torch")
    assert runtime.follow_recorded("reader:torch-kn,encoders:torch") == \
        "float32 GEMM paths: PERSRAG_GEMM=torch (the run's record: reader:torch-kn,encoders:torch)"
    assert runtime.gemm_choice().chosen == {"reader": "torch", "encoders": "torch"}
    monkeypatch.delenv(runtime.ENV)
    monkeypatch.setitem(runtime.PATHS, "broken", GemmPath("broken", "cannot load", no_path))
    assert runtime.follow_recorded("broken").startswith(
        "float32 GEMM paths: measured here; the run's broken cannot be taken here (PERSRAG_GEMM=broken: this path "
        "cannot load here: No module named")
    assert runtime.follow_recorded(None) == "float32 GEMM paths: measured here (the run's record names none)"
    assert runtime._FOLLOWED == {}
    assert runtime.follow_recorded("reader:torch-kn,encoders:torch") == ("float32 GEMM paths: reader:torch-kn,"
                                                                       "encoders:torch, as the run's record says "
                                                                       "(PERSRAG_GEMM=auto measures this machine's "
                                                                       "instead)")
    choice = runtime.gemm_choice()
    assert choice.forced and choice.chosen == {"reader": "torch-kn", "encoders": "torch"}
    runtime.follow_recorded(None)  # another run without paths: measured, not the run loaded before's
    assert runtime._FOLLOWED == {}
    assert choice.lines() == ["float32 GEMM path: reader:torch-kn,encoders:torch (the run's record; not measured)"]


@pytest.mark.skipif(not available("onnxruntime"), reason="needs onnx and onnxruntime (the onnx extra)")
def test_an_encoder_on_a_path_exports_torchs_own_graph(monkeypatch, tiny_bert, tmp_path, one_thread):
    """An ONNX export traces the model: a converted layer must hand the tracer torch's linear, not its path."""
    from persrag_lightning.models import exported
    from persrag_lightning.models.text_encoder import TextEncoder

    monkeypatch.setenv(runtime.ENV, "numpy")  # a path a tracer cannot see through: it would bake constants
    monkeypatch.setattr(runtime, "MIN_ROWS", 1)  # the export's one-query sample would fall back by its size alone
    encoder = TextEncoder.from_pretrained(tiny_bert)
    texts = [f"doc {i} about things and more things to say" for i in range(8)]
    vectors = encoder.encode(texts)
    assert any(isinstance(m, GemmLinear) for m in encoder.modules())
    session = exported.session("onnx", encoder.export_onnx(tmp_path / "encoder.onnx"))
    assert torch.allclose(encoder.encode(texts, session=session), vectors, atol=1e-4)
