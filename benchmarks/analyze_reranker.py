"""How much a run's trained reranker learned: on test questions, the share of its top-k (of CFRAG's m·k candidates)
that an untrained reranker (fresh MLP3 on the same encoder, the stage's seed) and the first stage (the trained
retriever's Eq. 5 order) also put in their top-k. A reranker that moved little from its initialisation agrees with
the untrained one far above chance. Asserts nothing.

    python benchmarks/analyze_reranker.py --run checkpoints/synthlamp-quick-b4 --questions 40
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from persrag_lightning.data.source import LampSource
from persrag_lightning.data.tasks import get_task
from persrag_lightning.models.reranker import PersonalizedReranker
from persrag_lightning.retrieval.base import Query
from persrag_lightning.retrieval.cfrag import first_stage_order
from persrag_lightning.serving.cfrag_pipeline import CFRAGPipeline


def top(scores: torch.Tensor, k: int) -> set[int]:
    return set(torch.argsort(scores, descending=True, stable=True)[:k].tolist())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="checkpoints/synthlamp-quick-b4")
    p.add_argument("--reranker", default="reranker", help="the run's reranker bundle (e.g. reranker_f256)")
    p.add_argument("--questions", type=int, default=40, help="test questions")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="the reranker stage's seed_everything (its fresh head)")
    p.add_argument("--cache-dir", default=".cache/persrag")
    args = p.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    pipe = CFRAGPipeline.from_pretrained(args.run, cache_dir=args.cache_dir, reranker_runtime="fp32",
                                         reranker=args.reranker)
    s = pipe.strategy
    trained = s._reranker
    if trained is None:
        raise SystemExit(f"{args.run}: no {args.reranker} export")
    c = trained.config
    settings = asdict(c)  # the export's shapes (LoRA already merged into it: lora_r 0)
    torch.manual_seed(args.seed)  # the module builds its model under this seed (modules/distillation.py)
    fresh = PersonalizedReranker.from_encoder(settings.pop("encoder"), settings.pop("user_dim"),
                                              **settings).eval().cache_doc_tokens()
    source = LampSource(pipe.task, cache_dir=args.cache_dir)
    source.prepare()
    spec = get_task(pipe.task)
    examples = source.load().examples["test"][:args.questions]
    same_fresh = same_first = 0.0
    with torch.inference_mode():
        for e in examples:
            q = Query(e.user_id, spec.extract_query(e.input), e.input)
            cands = s.candidates([q])[0]
            texts = [s.store.text(d.row) for d in cands]
            users = s.e_u(q.user_id).expand(len(cands), -1) if c.use_user else None
            ours = top(trained.score_pairs([q.query] * len(cands), texts, users), args.k)
            same_fresh += len(ours & top(fresh.score_pairs([q.query] * len(cands), texts, users), args.k)) / args.k
            same_first += len(ours & set(first_stage_order(cands)[:args.k])) / args.k
    n = len(examples)
    print(f"{args.run}/{args.reranker}: {n} test questions, {len(cands)} candidates each; share of the trained "
          f"reranker's top {args.k} also in the top {args.k} of an untrained reranker: {same_fresh / n:.3f}, of the "
          f"first stage: {same_first / n:.3f} (chance {args.k / len(cands):.3f})")


if __name__ == "__main__":
    main()
