"""Shared fixtures: tiny random encoders built in the test session, so unit tests never need real weights."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from unittest import mock

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
# the suite computes with torch's own float32 GEMM (persrag_lightning/runtime.py): tests of the runtime policy name
# their paths, and no test pays for the measurement
os.environ.setdefault("PERSRAG_GEMM", "torch")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> str:
    """A 2-layer, 32-wide random BERT with the MiniLM tokenizer, saved as a local HF folder."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


def build_tiny_bert(path: Path) -> str:
    """The tiny_bert fixture's model saved in `path` (also built by benchmarks/bench_load.py)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from persrag_lightning.models.text_encoder import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    import torch

    torch.manual_seed(0)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture()
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine the two threads wait on each
    other (a layer norm of a few hundred numbers took 8 ms); restored after the test."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def in_tmp_cwd(tmp_path, monkeypatch) -> Path:
    """Run a CLI from an empty folder that has the repository's configs/ (as a fresh checkout would)."""
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory) -> str:
    """A random 2-layer llama over the MiniLM word-piece vocabulary with a chat template: any text tokenizes,
    generation is deterministic (greedy) and fast, so feedback tests exercise the real hf backend."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from persrag_lightning.models.text_encoder import resolve_model_path

    path = tmp_path_factory.mktemp("tiny_llm")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    tokenizer.chat_template = ("{% for m in messages %}[CLS] {{ m['role'] }}: {{ m['content'] }} [SEP] {% endfor %}"
                               "{% if add_generation_prompt %}[CLS] assistant: {% endif %}")
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                         eos_token_id=tokenizer.sep_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


WORD_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def word_level_llama(out: Path, words: list[str]) -> Path:
    """A random 2-layer llama (GQA, RoPE, hidden 32) over a word-level vocabulary with a chat template, saved like
    a Hub model: every token is a known word, so token counts and positions can be checked by hand."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {w: i for i, w in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                  bos_token="<|im_start|>", unk_token="<unk>")
    tok.chat_template = WORD_CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_t5(tmp_path_factory) -> str:
    """A random 2-layer T5 (seq2seq, the FlanT5 family's architecture) over the MiniLM word-piece vocabulary."""
    import torch
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    from persrag_lightning.models.text_encoder import resolve_model_path

    path = tmp_path_factory.mktemp("tiny_t5")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    config = T5Config(vocab_size=tokenizer.vocab_size, d_model=16, d_ff=32, d_kv=8, num_layers=2, num_heads=2,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.sep_token_id,
                      decoder_start_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_serving_run(root: Path, fit_args: list[str], run_name: str, tiny_bert: str, user_dim: int = 32) -> Path:
    """Stage 1 trained through the CLI in `root` (configs copied there), with untrained tiny retriever and reranker
    exports beside it: a run folder serving and evaluation load (their training is tested elsewhere)."""
    import torch

    from persrag_lightning.cli import main
    from persrag_lightning.models.reranker import PersonalizedReranker
    from persrag_lightning.models.retriever import PersonalizedRetriever

    shutil.copytree(REPO / "configs", root / "configs")
    old = os.getcwd()
    os.chdir(root)
    try:
        main(fit_args)
    finally:
        os.chdir(old)
    run = root / "checkpoints" / run_name
    torch.manual_seed(0)
    PersonalizedRetriever.from_encoder(tiny_bert, user_dim=user_dim).save_pretrained(run / "retriever")
    PersonalizedReranker.from_encoder(tiny_bert, user_dim=user_dim).save_pretrained(run / "reranker")
    return run


def evaluate_config_rows(config: str):
    """An evaluate config of configs/ as `persrag evaluate` reads it, `{run_dir}` resolved to checkpoints/<run_name>:
    (config, run_dir, rows by name — a strategy without a name under its class path)."""
    from persrag_lightning.evaluation.arguments import evaluate_parser
    from persrag_lightning.stages import fill_run_dir

    cfg = evaluate_parser().parse_args(["--config", str(REPO / "configs" / config)])
    run = f"checkpoints/{cfg.run_name}"
    cfg = fill_run_dir(cfg, run)
    return cfg, run, {s.init_args.name if "name" in s.init_args else s.class_path: s.init_args for s in cfg.strategies}


def evaluated_rows(run) -> list[tuple[str, str]]:
    """(config name, table name) of each `only` row of an evaluation (its resolved configuration, or an
    `EvaluationRun`), under its `names`, as the real evaluation names its results."""
    from persrag_lightning.evaluation.arguments import only_names
    from persrag_lightning.pipeline.choice import table_name

    return [(n, table_name(n, run.names or {})) for n in only_names(run.only or [])]


def fake_evaluate(calls: list | None = None):
    """A stand-in for `run_evaluation` in pipeline tests: checks that it is given a resolved configuration object
    (never a command line), records it (in `calls`) and reports every `only` row alike, so the dev choice keeps
    the first candidate (CFRAG)."""
    from jsonargparse import Namespace

    from persrag_lightning.evaluation.base import EvaluationReport
    from persrag_lightning.metrics import primary_metric

    def evaluate(cfg: Namespace) -> EvaluationReport:
        assert isinstance(cfg, Namespace), f"an in-process evaluation was given {type(cfg).__name__}"
        if calls is not None:
            calls.append(cfg)
        results = {row: dict.fromkeys(("accuracy", "f1", "mae", "rmse", "rouge-1", "rouge-L"), 0.5)
                   for _, row in evaluated_rows(cfg)}
        metric = primary_metric(cfg.evaluation.init_args.task)
        return EvaluationReport(metric.name, metric.greater_is_better, "", results)

    return evaluate


def fake_fit(calls: list | None = None):
    """A stand-in for `run_stage` in pipeline tests: checks that it is given a resolved configuration object (never
    a command line) and records it (in `calls`)."""
    from jsonargparse import Namespace

    def fit(cfg: Namespace) -> None:
        assert isinstance(cfg, Namespace), f"an in-process fit was given {type(cfg).__name__}"
        if calls is not None:
            calls.append(cfg)

    return fit


def cli_parse(argv: list[str]):
    """What LightningCLI itself parses of a `train.py` command line (after `train.py`): PersragCLI run as `train.py`
    runs it, stopped right after its parse (by an exception, in tests only), before seeding, logging set-up or
    instantiation; the oracle `stage_config`'s parse is held equal to."""
    from persrag_lightning.commands import train

    class Parsed(Exception):
        pass

    class StopAfterParse(train.PersragCLI):
        def parse_arguments(self, parser, args) -> None:
            super().parse_arguments(parser, args)
            raise Parsed(self.config)

    with pytest.raises(Parsed) as parsed, mock.patch.object(sys, "argv", ["train.py"]):  # not pytest's arguments
        train._run_cli(StopAfterParse, train.resolve_config_args(argv))
    return parsed.value.args[0]
