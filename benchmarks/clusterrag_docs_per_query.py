"""Docs per query of ClusterRAG's three modes on SynthLaMP's test questions (k = 5, B = 1), under the seed's fill
rule ("fewer") and `fill: next_cluster`: retrieval only (no LLM), the evaluate config's data and defaults.

    python benchmarks/clusterrag_docs_per_query.py CACHE_DIR > docs_per_query.md

CACHE_DIR holds the generated data and the corpus embeddings (created if missing).
"""

from __future__ import annotations

import argparse

import numpy as np

from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.cluster_index import ClusterIndexSettings
from persrag_lightning.retrieval.clusterrag import ClusterRAG, ClusterRAGSettings, CorpusEmbedder


def main(cache: str) -> None:
    source = LampSource("LaMP-2", None, SynthConfig(num_users=300, seed=0), cache)
    source.prepare()
    store = DocStore(source.load())
    queries = [Query(e.user_id, e.query, e.input, e.example_id) for e in store.dataset.examples["test"]]
    embedder = CorpusEmbedder(cache_dir=cache)
    print(f"SynthLaMP LaMP-2 (300 users, seed 0), {len(queries)} test questions, k = 5, B = 1\n")
    print("| mode | fill | docs per query | queries with < 5 docs | clusters in the index |")
    print("|---|---|---|---|---|")
    cohorts = None
    for mode in ("user", "collab", "hybrid"):
        for fill in ("fewer", "next_cluster"):
            s = ClusterRAG(embedder, ClusterRAGSettings(mode, index=ClusterIndexSettings(fill=fill)),
                           cache_dir=cache, cohorts=cohorts)
            s.prepare(store)
            cohorts = s.cohorts if s.cohorts is not None else cohorts
            docs = s.retrieve(queries, 5)
            n = np.array([len(d) for d in docs])
            print(f"| {mode} | {fill} | {n.mean():.2f} | {(n < 5).mean():.3f} | {s.index.n_clusters} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache_dir", help="the generated data and the corpus embeddings (created if missing)")
    main(parser.parse_args().cache_dir)
