"""What bfloat16 buys the main job's inference passes besides the evaluation's reader, against float32 in the same
run: the corpus embedding (every history doc through MiniLM, three times per quick run) and the evaluation's
reranker (30 candidates per question through the cross-encoder, in every reranking row), both in bf16 autocast,
and the feedback stages' log-likelihood labels (SmolLM2 with bf16 weights, as the evaluation's reader).

    python benchmarks/bench_inference_precision.py                                  # the embedding only
    python benchmarks/bench_inference_precision.py --run checkpoints/synthlamp-quick   # and that run's reranker, labels

Embedding: docs/s on --docs unique SynthLaMP LaMP-2 docs (one warm-up batch first), the cosine of each bf16 vector
to its float32 one, and how many of each doc's top-5 neighbours (by the float32 vectors of the first 200 docs as
queries) are the same. Reranker: ms per dev question of the run's CFRAG row (retrieval only, no LLM), fp32 then
bf16, each measured --repeats times (the median kept), and how many of the top-5 lists are identical, in order and
as sets. Labels: labels/s of the retriever stage's candidates (m = 3 x k = 2) for --label_questions train
questions, the gap between each bf16 label and its float32 one, how often the best candidate is the same, and the
KL between the two training targets softmax(label / T) at the retriever's T = 1 and the reranker's T = 0.1.
Prints Markdown; asserts nothing about time. bf16 pays only on a CPU that computes it natively (AVX512-BF16
or AMX); elsewhere it is emulated and slower, and the framework keeps float32 there (persrag_lightning/hardware.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.source import LampSource
from persrag_lightning.hardware import cpu_has_native_bf16, describe_cpu
from persrag_lightning.models.corpus_embeddings import precision_autocast
from persrag_lightning.models.text_encoder import TextEncoder


def embedding_rows(n_docs: int, cache_dir: str) -> list[list]:
    source = LampSource("LaMP-2", None, None, cache_dir)
    source.prepare()
    texts = list(dict.fromkeys(Corpus.from_dataset(source.load()).texts))
    random.Random(0).shuffle(texts)
    texts = texts[:n_docs]
    encoder = TextEncoder.from_pretrained("minilm")
    encoder.encode(texts[:64])  # warm-up
    vectors, rates = {}, {}
    for precision in ("fp32", "bf16"):
        started = time.perf_counter()
        with precision_autocast(precision):
            vectors[precision] = encoder.encode(texts)
        rates[precision] = len(texts) / (time.perf_counter() - started)
    a, b = vectors["fp32"], vectors["bf16"]
    cosine = torch.nn.functional.cosine_similarity(a, b)
    queries = a[:200]
    top_a = (queries @ a.T).topk(6).indices[:, 1:]  # the doc itself is its own first neighbour
    top_b = (queries @ b.T).topk(6).indices[:, 1:]
    same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(top_a, top_b)) / top_a.numel()
    return [[f"corpus embedding (MiniLM, {len(texts)} docs)", "docs/s", f"{rates['fp32']:.0f}", f"{rates['bf16']:.0f}",
             f"{rates['bf16'] / rates['fp32']:.2f}x", f"min cosine {cosine.min():.5f}; top-5 neighbours same {same:.3f}"]]


def reranker_rows(run_dir: str, n_questions: int, repeats: int) -> list[list]:
    from persrag_lightning.evaluation.evaluate import Evaluation
    from persrag_lightning.retrieval.base import DocStore, Query
    from persrag_lightning.retrieval.strategies import strategy_by_name
    from persrag_lightning.utils import resolve_config_path

    evaluation = Evaluation(split="dev", max_examples=n_questions)
    evaluation.source.prepare()
    dataset = evaluation.source.load()
    store = DocStore(dataset)
    queries = [Query(e.user_id, e.query, e.input, e.example_id) for e in evaluation.examples(dataset)]
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    rows: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for runtime in ("fp32", "bf16"):
            strategy = strategy_by_name(resolve_config_path("evaluate_cfrag.yaml"), "CFRAG", run_dir, runtime)
            strategy.prepare(store)
            started = time.perf_counter()
            retrieved = strategy.retrieve(queries, 5)
            times[runtime].append(1000 * (time.perf_counter() - started) / len(queries))
            rows[runtime] = [[d.row for d in docs] for docs in retrieved]
    ms = {r: statistics.median(t) for r, t in times.items()}
    a, b = rows["fp32"], rows["bf16"]
    identical = sum(x == y for x, y in zip(a, b)) / len(a)
    overlap = sum(len(set(x) & set(y)) for x, y in zip(a, b)) / sum(len(x) for x in a)
    return [[f"reranker of the CFRAG row ({len(queries)} dev questions, median of {repeats})", "ms per question",
             f"{ms['fp32']:.0f}", f"{ms['bf16']:.0f}", f"{ms['fp32'] / ms['bf16']:.2f}x",
             f"top-5 lists identical {identical:.2f}; top-5 docs same {overlap:.3f}"]]


def label_rows(run_dir: str, n_questions: int, cache_dir: str) -> list[list]:
    """The quick preset's retriever-stage feedback labels (log p(gold | one candidate's prompt), m = 3 users x k = 2
    docs from the run's stage-1 export and the untuned MiniLM) in float32 and in bfloat16 on the same prompts."""
    from persrag_lightning.datamodules.feedback import FeedbackDataModule
    from persrag_lightning.feedback.settings import CandidateSettings, FeedbackSettings
    from persrag_lightning.llm.answer import build_prompts
    from persrag_lightning.llm.registry import LLMConfig
    from persrag_lightning.retrieval.base import Query

    dm = FeedbackDataModule(cache_dir=cache_dir,
                            candidates=CandidateSettings(user_encoder=f"{run_dir}/user_encoder", m=3, k=2),
                            feedback=FeedbackSettings(metric="loglik"))
    dm.source.prepare()
    builder = dm.builder()
    builder.retriever.prepare()
    examples = builder.examples("train")[:n_questions]
    proposals = builder.candidate_source().propose([Query(e.user_id, e.query, e.input, e.example_id)
                                                    for e in examples])
    flat = [(e, d) for e, cands in zip(examples, proposals) for d in cands]
    targets = [e.target for e, _ in flat]
    labels, rates, prompts = {}, {}, []
    for dtype in ("float32", "bfloat16"):
        llm = LLMConfig(backend="hf", options={"dtype": dtype}).load()
        prompts = prompts or build_prompts("LaMP-2", llm, [e.input for e, _ in flat],  # one tokenizer: built once
                                           [[builder.store.history_doc(d.row)] for _, d in flat], 512)
        llm.score(prompts[:8], targets[:8])  # warm-up
        started = time.perf_counter()
        scores = torch.tensor(llm.score(prompts, targets))
        rates[dtype] = len(prompts) / (time.perf_counter() - started)
        labels[dtype] = list(scores.split([len(c) for c in proposals]))
        llm.close()
    gaps = torch.cat([(a - b).abs() for a, b in zip(labels["float32"], labels["bfloat16"])])
    same_top = sum(int(a.argmax() == b.argmax()) for a, b in zip(labels["float32"], labels["bfloat16"]))

    def kl(t: float) -> float:  # KL(p_float32 || p_bf16) of the stage's training target softmax(label / t)
        return statistics.mean(float(torch.nn.functional.kl_div((b / t).log_softmax(0), (a / t).log_softmax(0),
                                                                log_target=True, reduction="sum"))
                               for a, b in zip(labels["float32"], labels["bfloat16"]))
    return [[f"feedback labels (SmolLM2, {len(gaps)} candidates of {len(examples)} train questions)", "labels/s",
             f"{rates['float32']:.2f}", f"{rates['bfloat16']:.2f}", f"{rates['bfloat16'] / rates['float32']:.2f}x",
             (f"|label gap| median {gaps.median():.3f} nat, max {gaps.max():.3f}; best candidate same "
              f"{same_top}/{len(examples)}; target KL {kl(1.0):.4f} (T = 1, retriever), {kl(0.1):.4f} (T = 0.1, "
              "reranker)")]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=2048)
    parser.add_argument("--run", default=None, help="an exported quick run (checkpoints/<run_name>)")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--passes", default="embedding,reranker,labels",
                        help="which of embedding, reranker, labels (the last two need --run)")
    parser.add_argument("--label_questions", type=int, default=32, help="train questions whose labels are compared")
    parser.add_argument("--cache_dir", default=".cache/persrag")
    args = parser.parse_args()
    passes = set(args.passes.split(","))
    rows = embedding_rows(args.docs, args.cache_dir) if "embedding" in passes else []
    if args.run and "reranker" in passes:
        rows += reranker_rows(args.run, args.questions, args.repeats)
    if args.run and "labels" in passes:
        rows += label_rows(args.run, args.label_questions, args.cache_dir)
    print(f"{describe_cpu()}; bfloat16 native: {'yes' if cpu_has_native_bf16() else 'no'}; "
          f"torch threads {torch.get_num_threads()}\n")
    print("| pass | unit | float32 | bfloat16 | speed-up | agreement with float32 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
