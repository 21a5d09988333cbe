"""One-off: the share of dropout in a batched bf16 training step at m·k = 30 (bench_retriever_reranker.py's setting:
4 examples, 60 % of each list shared, docs of 40-120 words), by timing the same step with every nn.Dropout at its
p = 0.1 and at p = 0 (attention dropout included: BERT passes its module's p to SDPA), alternating, 3 rounds of 3
steps each. Not a setting of the framework (training keeps MiniLM's dropout); it measures where time goes.

    python benchmarks/results/cpu-2026-11-23f/dropout_share.py
"""
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_retriever_reranker import make_examples, train_step

from persrag_lightning.data.candidates import collate_candidates
from persrag_lightning.logs import configure_logs
from persrag_lightning.models.reranker import PersonalizedReranker
from persrag_lightning.models.retriever import PersonalizedRetriever

configure_logs(verbose=False)
print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
for name, model, tau in (("retriever", PersonalizedRetriever.from_encoder("minilm", 384), 1.0),
                         ("reranker", PersonalizedReranker.from_encoder("minilm", 384), 0.1)):
    rng = random.Random(0); torch.manual_seed(0)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=6e-5)
    examples, corpus = make_examples(rng, 4, 30, 0.6, (40, 120))
    batch = collate_candidates(examples, {e.user_id: i for i, e in enumerate(examples)}, corpus)
    e_u = torch.randn(4, 384)
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    times: dict[float, list[float]] = {0.1: [], 0.0: []}
    for rnd in range(3):
        for p in (0.1, 0.0) if rnd % 2 == 0 else (0.0, 0.1):
            for m in drops:
                m.p = p
            train_step(model, opt, batch, e_u, tau, True)  # untimed
            start = time.perf_counter()
            for _ in range(3):
                train_step(model, opt, batch, e_u, tau, True)
            times[p].append((time.perf_counter() - start) / 3)
    on, off = min(times[0.1]), min(times[0.0])
    print(f"{name}: {len(drops)} dropout modules; bf16 step with dropout {on:.2f} s, without {off:.2f} s (best of 3): "
          f"dropout {1 - off / on:.0%} of the step; rounds {[round(t, 2) for t in times[0.1]]} / "
          f"{[round(t, 2) for t in times[0.0]]}", flush=True)
print(f"# load at the end {os.getloadavg()}")
