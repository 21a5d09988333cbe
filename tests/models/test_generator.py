"""The generator stage on tiny random models: the loss mask, LoRA merge, the peft-free export, resume after a kill,
causal and seq2seq steps, and `fit --config generator.yaml` end to end with its "+ tuned generator" rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from persrag_lightning.datamodules.generator import GeneratorBatch
from persrag_lightning.llm.hf import HFLLM
from persrag_lightning.models.common import LoraSettings, apply_lora, merged_copy
from persrag_lightning.models.generator import IGNORE_INDEX, causal_lm_batch, target_token_loss
from persrag_lightning.modules.optim import OptimizerSettings
from tests.conftest import REPO, fake_evaluate, fake_fit, word_level_llama

WORDS = ["user", "assistant", "which", "tag", "comedy", "horror", "a", "film"]


def _perturb_lora(model: torch.nn.Module, seed: int = 3) -> None:
    """LoRA's B starts at zero (merge would be trivially exact): give every adapter weight random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_loss_masks_only_the_target_tokens(tmp_path):
    """Hand-checked on a word-level chat model: the prompt `which tag` is 7 tokens once chat-formatted, the target
    `comedy` plus the end-of-turn token are the only labelled positions, and the loss is their mean NLL."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = word_level_llama(tmp_path / "llama", WORDS)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    llm = HFLLM.from_model(model, tok)
    ((prompt, target),) = llm.encode_pairs(["which tag"], ["comedy"])
    vocab = tok.get_vocab()
    assert prompt == [vocab[w] for w in ["<|im_start|>", "user", "which", "tag", "<|im_end|>", "<|im_start|>",
                                         "assistant"]]
    assert target == [vocab["comedy"], vocab["<|im_end|>"]]
    # a second, longer pair pads the first one on the left (targets end every row)
    pairs = [(prompt, target), *llm.encode_pairs(["which tag a film"], ["horror"])]
    batch = causal_lm_batch(pairs, pad_id=0)
    assert batch["labels"][0].tolist() == [IGNORE_INDEX] * 9 + target
    assert batch["attention_mask"][0].tolist() == [0] * 2 + [1] * 9
    assert batch["position_ids"][0, 2:].tolist() == list(range(9)) and int(batch["logits_to_keep"]) == 3
    with torch.no_grad():  # each row alone, unpadded: the reference the padded batch must reproduce
        logp = [model(input_ids=torch.tensor([p + t])).logits.log_softmax(-1)[0] for p, t in pairs]
    first = -(logp[0][6, vocab["comedy"]] + logp[0][7, vocab["<|im_end|>"]])  # position i predicts token i + 1
    second = -(logp[1][8, vocab["horror"]] + logp[1][9, vocab["<|im_end|>"]])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], logits_to_keep=3).logits
    assert logits.shape[1] == 3
    torch.testing.assert_close(target_token_loss(logits, batch["labels"]), (first + second) / 4, atol=1e-5,
                               rtol=1e-5)
    # the same pair scored by the backend (what `choose` and the feedback labels use) is the target's log-lik
    assert llm.score(["which tag"], ["comedy"])[0] == pytest.approx(float(logp[0][6, vocab["comedy"]]), abs=1e-5)


def test_lora_merge_reproduces_unmerged_logits(tiny_llm):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llm)
    model = apply_lora(base, LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj"))).eval()
    _perturb_lora(model)
    ids = torch.randint(5, 1000, (2, 12))
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
        merged = merged_copy(model)(input_ids=ids).logits
    assert not any("lora" in n for n, _ in merged_copy(model).named_parameters())
    assert (unmerged - merged).abs().max() < 1e-4
    # and the adapters did change the model (the check above is not comparing the base with itself)
    with torch.no_grad(), model.disable_adapter():
        assert (model(input_ids=ids).logits - unmerged).abs().max() > 1e-3


def _module(model: str, **kwargs):
    from persrag_lightning.metrics import lamp_metric
    from persrag_lightning.modules.generator import GeneratorModule

    torch.manual_seed(0)
    module = GeneratorModule(model=model, **kwargs)
    module.task, module.metrics = "LaMP-2", {"none": lamp_metric("LaMP-2")}
    return module


BATCH = GeneratorBatch(["e1", "e2"], ["The historical profiles are as follows: a film tag comedy.\nwhich tag?",
                                      "which tag for a horror film?"], ["comedy", "horror"])


def test_export_loads_with_plain_transformers_without_peft(tiny_llm, tmp_path, one_thread):
    """A fresh interpreter where `import peft` fails loads the export with AutoModelForCausalLM and through the hf
    backend, and reproduces the LoRA model's logits and label scores."""
    module = _module(tiny_llm, lora_r=4).eval()
    _perturb_lora(module.lm)
    path = module.export(tmp_path / "generator")
    meta = json.loads((path / "persrag_generator.json").read_text())
    assert meta["lora_r"] == 4 and meta["base_model"] == tiny_llm and meta["weights_sha256"]
    ids = torch.randint(5, 1000, (2, 10))
    with torch.no_grad():
        want = module.lm(input_ids=ids).logits
    want_scores = module.backend.score(BATCH.prompts, BATCH.targets)
    torch.save({"ids": ids, "logits": want, "scores": torch.tensor(want_scores)}, tmp_path / "want.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.modules["peft"] = None  # any import of peft raises ImportError
        from transformers import AutoModelForCausalLM
        ref = torch.load({str(tmp_path / "want.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(path)!r}).eval()
        with torch.no_grad():
            got = model(input_ids=ref["ids"]).logits
        assert (got - ref["logits"]).abs().max() < 1e-4, (got - ref["logits"]).abs().max()
        from persrag_lightning.llm.registry import LLMConfig
        llm = LLMConfig(model={str(path)!r}).load()
        scores = torch.tensor(llm.score({BATCH.prompts!r}, {BATCH.targets!r}))
        assert (scores - ref["scores"]).abs().max() < 1e-4, (scores, ref["scores"])
        assert "lightning" not in sys.modules and sys.modules["peft"] is None
    """)
    run = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("fixture", ["tiny_llm", "tiny_t5"])
@pytest.mark.parametrize("lora_r", [4, 0])
def test_tiny_causal_and_seq2seq_models_train_a_step(fixture, lora_r, request, one_thread):
    path = request.getfixturevalue(fixture)
    module = _module(path, lora_r=lora_r, training=OptimizerSettings(lr=1e-2, weight_decay=1e-4, warmup_ratio=0.05,
                                                                     lr_schedule="linear"))
    assert module.seq2seq == (fixture == "tiny_t5")
    trainable = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    if lora_r:
        assert trainable and all("lora_" in n for n in trainable) and frozen
    else:
        assert not frozen
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    module.train()
    first = module.loss(BATCH)
    first.backward()
    optimizer.step()
    optimizer.zero_grad()
    assert torch.isfinite(first)
    changed = [n for n, p in module.named_parameters() if n in trainable and not torch.equal(p, trainable[n])]
    assert changed
    assert all(torch.equal(p, frozen[n]) for n, p in module.named_parameters() if n in frozen)
    for _ in range(4):
        loss = module.loss(BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert module.loss(BATCH) < first  # it learns the pairs
    module.eval()
    with torch.no_grad():
        reading = module.reader.read_prompts("LaMP-2", BATCH.prompts, every_calibration=True)  # validation's
    assert len(reading.answers) == 2 and set(reading.answers) <= set(reading.labels)  # reading works for both kinds
    assert set(reading.terms_by) == {"none", "contextual", "pmi"}


# ---- the CLI: fit --config generator.yaml, resume after a kill, the evaluation rows ----------------------------

def fit_args(model: str, epochs: int, *extra: str) -> list[str]:
    return ["fit", "--config", "generator.yaml", "--run_name", "t", "--trainer.accelerator=cpu",
            f"--trainer.max_epochs={epochs}", "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1",
            f"--model.init_args.model={model}", "--model.init_args.lora_r=4",
            "--model.init_args.lora_dropout=0.0", "--model.init_args.training.lr=1e-3", "--model.init_args.eval_batch_size=4",
            "--data.init_args.synth.num_users=12", "--data.init_args.strategy=bm25",
            "--data.init_args.splits.max_train_examples=12", "--data.init_args.splits.max_val_examples=4",
            "--data.init_args.batch_size=4", "--data.init_args.max_prompt_tokens=128", *extra]


def test_fit_generator_yaml_exports_and_evaluates_tuned_rows(in_tmp_cwd, tiny_llm, one_thread):
    from persrag_lightning.cli import main

    main(fit_args(tiny_llm, 2))
    export = in_tmp_cwd / "checkpoints" / "t" / "generator"
    assert (export / "config.json").exists() and (export / "model.safetensors").exists()
    meta = json.loads((export / "persrag_generator.json").read_text())
    assert meta["strategy"] == "bm25" and meta["train_examples"] == 12
    metrics = next((in_tmp_cwd / "runs" / "t" / "generator").rglob("metrics.csv")).read_text().splitlines()
    header = metrics[0].split(",")
    for name in ("train/loss", "val/loss", "val/metric", "val/accuracy", "val/f1", "train/examples_per_s"):
        assert name in header, name
    ckpts = list((in_tmp_cwd / "runs" / "t" / "generator").rglob("last.ckpt"))
    state = torch.load(ckpts[0], map_location="cpu", weights_only=False)["state_dict"]
    assert state and all("lora_" in k for k in state)  # trainable weights only: the base comes from the source
    retrievals = in_tmp_cwd / ".cache" / "persrag" / "retrievals"
    assert len(list(retrievals.glob("bm25-*.json"))) == 2  # train and dev prompts' retrievals, cached

    from persrag_lightning.commands.evaluate import evaluate_command

    evaluated = evaluate_command(["--config", "evaluate_cfrag.yaml", "--run_name", "t",
                                  "--evaluation.synth.num_users=12", "--evaluation.max_examples=4",
                                  f"--evaluation.llm.model={tiny_llm}", "--evaluation.llm.answer_mode=choose",
                                  "--evaluation.reference=bm25", "--evaluation.n_resamples=50",
                                  "--only=[bm25 + tuned generator, CFRAG + tuned generator]"])
    # CFRAG's bundles are not trained: skipped, named; the reader-free rows need no bundle
    assert set(evaluated.results) == {"bm25 + tuned generator", "majority label (train)", "user's own majority"}
    # the row read as label scores hands its reading back, one row per question, in the golds' order
    reading = evaluated.readings["bm25 + tuned generator"]
    assert set(evaluated.readings) == {"bm25 + tuned generator"} and len(reading.log_scores) == len(evaluated.golds) == 4
    assert set(reading.answers) <= set(reading.labels)
    assert len(list(retrievals.glob("bm25-*.json"))) == 3  # the test split's bm25 retrieval, read by its wrapper
    report = (in_tmp_cwd / "runs" / "t" / "evaluate" / "results.md").read_text()
    assert "CFRAG + tuned generator" in report and "not trained" in report


def test_a_fit_without_validation_retrieves_no_dev_prompt_and_exports_its_last_weights(in_tmp_cwd, tiny_llm,
                                                                                       one_thread):
    """`--trainer.limit_val_batches=0` (the quick and smoke presets: one epoch keeps one checkpoint): no dev
    retrieval or prompt is built, nothing is validated, and the export holds the last weights."""
    from persrag_lightning.cli import main

    main(fit_args(tiny_llm, 1, "--trainer.limit_val_batches=0"))
    assert (in_tmp_cwd / "checkpoints" / "t" / "generator" / "model.safetensors").exists()
    assert len(list((in_tmp_cwd / ".cache" / "persrag" / "retrievals").glob("bm25-*.json"))) == 1  # train only
    assert [p.name for p in (in_tmp_cwd / ".cache" / "persrag" / "generator_prompts").rglob("*.json")] == ["train.json"]
    metrics = next((in_tmp_cwd / "runs" / "t" / "generator").rglob("metrics.csv")).read_text().splitlines()
    assert "train/loss" in metrics[0] and "val/" not in metrics[0]


def test_choose_on_a_generation_task_is_one_line_exit_2_before_training(in_tmp_cwd, tiny_llm, capsys, one_thread):
    """generator.yaml validates with `choose`; on LaMP-7 (no labels) that once failed at the end of the first
    epoch, in the middle of `pipeline --task LaMP-7`. Now setup refuses it, naming the switch."""
    from persrag_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*fit_args(tiny_llm, 1), "--data.init_args.task=LaMP-7"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("persrag: error:")]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert "LaMP-7" in lines[0] and "--model.init_args.answer_mode=generate" in lines[0]
    assert not list((in_tmp_cwd / "runs").rglob("*.ckpt"))


def test_pipeline_validates_the_generator_by_generating_on_generation_tasks(monkeypatch, tmp_path):
    from persrag_lightning.pipeline import command as pipeline

    for task, generate in (("LaMP-7", True), ("LaMP-5", True), ("LaMP-1", False), ("LaMP-2", False)):
        fits: list = []
        monkeypatch.setattr(pipeline, "run_stage", fake_fit(fits))
        monkeypatch.setattr(pipeline, "run_evaluation", fake_evaluate())
        pipeline.main(["--preset", "smoke", "--task", task, "--export_root", str(tmp_path)])
        run = "synthlamp-smoke" if task == "LaMP-2" else f"synthlamp-lamp{task[-1]}-smoke"
        record = json.loads((tmp_path / run / "pipeline.json").read_text())
        stages = {r["stage"]: r["overrides"] for r in record["stages"]}
        assert (stages["generator"].get("model.init_args.answer_mode") == "generate") == generate, task
        assert fits[-1].fit.model.init_args.answer_mode == ("generate" if generate else "choose"), task
        assert not any("model.init_args.answer_mode" in o for s, o in stages.items() if s != "generator"), task


def test_unknown_strategy_is_one_line_exit_2(in_tmp_cwd, tiny_llm, capsys, one_thread):
    from persrag_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*fit_args(tiny_llm, 1), "--data.init_args.strategy=nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("persrag: error:")]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert "evaluate_cfrag.yaml" in lines[0] and "'nope'" in lines[0] and "CFRAG" in lines[0]


def test_a_killed_fit_resumes_to_the_uninterrupted_result(in_tmp_cwd, tiny_llm):
    """SIGKILL a fit once its first epoch's last.ckpt exists; `--ckpt_path last.ckpt` finishes the remaining
    epochs and ends with the weights (and export) of a run that was never interrupted."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    epochs = 4
    args = fit_args(tiny_llm, epochs)
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args, "--run_name", "killed"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = in_tmp_cwd / "runs" / "killed" / "generator"
    deadline = time.time() + 600
    while not list(root.rglob("last.ckpt")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    err = proc.communicate()[1]
    assert proc.returncode == -signal.SIGKILL, err[-3000:]  # killed before the end
    last = next(root.rglob("last.ckpt"))
    killed_at = torch.load(last, map_location="cpu", weights_only=False)["epoch"]
    assert killed_at < epochs - 1
    assert not (in_tmp_cwd / "checkpoints" / "killed" / "generator").exists()

    run = subprocess.run([sys.executable, str(REPO / "train.py"), *args, "--run_name", "killed",
                          f"--ckpt_path={last}"], check=False, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = subprocess.run([sys.executable, str(REPO / "train.py"), *args, "--run_name", "ref"], check=False, env=env,
                         capture_output=True, text=True, timeout=900)
    assert ref.returncode == 0, ref.stderr[-3000:]
    newest = max(root.rglob("last.ckpt"), key=lambda f: f.stat().st_mtime)  # the resumed run's own version folder
    got = torch.load(newest, map_location="cpu", weights_only=False)
    want = torch.load(next((in_tmp_cwd / "runs" / "ref" / "generator").rglob("last.ckpt")), map_location="cpu",
                      weights_only=False)
    assert got["epoch"] == want["epoch"] == epochs - 1 and got["global_step"] == want["global_step"]
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, atol=1e-6, rtol=1e-6)
    assert (in_tmp_cwd / "checkpoints" / "killed" / "generator" / "model.safetensors").exists()


def test_the_generator_data_fits_prompts_with_the_modules_model_unless_told_otherwise():
    """The LLM is a knob of the module alone: the DataModule reads it from the trainer's module."""
    from types import SimpleNamespace

    from persrag_lightning.datamodules.generator import GeneratorDataModule
    from persrag_lightning.utils import ConfigError

    data = GeneratorDataModule()
    with pytest.raises(ConfigError, match="set `tokenizer`"):
        _ = data.prompt_model
    data.trainer = SimpleNamespace(lightning_module=SimpleNamespace(hparams={"model": "some/llm"}))
    assert data.prompt_model == "some/llm"
    assert GeneratorDataModule(tokenizer="other/llm").prompt_model == "other/llm"
