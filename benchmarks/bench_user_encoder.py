"""Stage-1 benchmark: corpus embedding throughput, user-encoder training throughput, and same-community
precision@m of the contrastive encoder versus MEAN pooling of doc embeddings (paper Table 3, row 2).

    python benchmarks/bench_user_encoder.py                 # default SynthLaMP (300 users), MiniLM
    python benchmarks/bench_user_encoder.py --users 1000 --epochs 30
    python benchmarks/bench_user_encoder.py --task LaMP-3 --judgments none label --doc-table tuned --seeds 2 \
        --skip-throughput                                   # LaMP-3: does the encoder see users who judge alike?

Prints Markdown tables; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import lightning as L
import torch

from persrag_lightning.data.histories import FIRST_DOC_ID
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.datamodules.user_history import UserHistoryDataModule
from persrag_lightning.metrics import community_chance, community_precision_at_m
from persrag_lightning.models.text_encoder import TextEncoder
from persrag_lightning.models.user_encoder import UserEncoderSettings
from persrag_lightning.modules.user_encoder import ContrastiveSettings, UserEncoderModule


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def embedding_throughput(texts: list[str], encoder: str, batch_sizes: list[int]) -> list[list]:
    """Docs/s of the frozen encoder on a sample of real corpus docs (no cache)."""
    model = TextEncoder.from_pretrained(encoder)
    model.encode(texts[:64])  # warm-up
    rows = []
    for bs in batch_sizes:
        t0 = time.perf_counter()
        model.encode(texts, batch_size=bs)
        rows.append([encoder, bs, len(texts), f"{len(texts) / (time.perf_counter() - t0):.0f}"])
    return rows


def train_user_encoder(dm: UserHistoryDataModule, epochs: int, freeze: bool, seed: int,
                       judgments: str = "none") -> tuple[UserEncoderModule, float]:
    L.seed_everything(seed, verbose=False)
    module = UserEncoderModule(UserEncoderSettings(judgments=judgments),
                               ContrastiveSettings(freeze_doc_table=freeze))
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    return module, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--task", default="LaMP-2")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--m", type=int, default=5, help="neighbours scored (the user itself excluded)")
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--embed-sample", type=int, default=2048)
    parser.add_argument("--cache-dir", default=".cache/persrag")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds averaged for precision@m")
    parser.add_argument("--judgments", nargs="+", default=["none"], choices=["none", "label", "paired", "profile"],
                        help="encoder inputs: the paper's text only, with a learned label embedding, and/or with "
                             "that plus a label-specific map of the doc vector")
    parser.add_argument("--doc-table", nargs="+", default=["tuned", "frozen"], choices=["tuned", "frozen"])
    parser.add_argument("--skip-throughput", action="store_true", help="only the precision table")
    args = parser.parse_args()

    synth = replace(SynthConfig(task=args.task), num_users=args.users)
    dm = UserHistoryDataModule(task=args.task, synth=synth, cache_dir=args.cache_dir, encoder=args.encoder)
    dm.prepare_data()
    dm.setup("fit")
    corpus = dm.corpus
    print(f"## SynthLaMP {args.task}: {len(corpus.user_ids)} users, {len(corpus)} docs\n")
    if not args.skip_throughput:
        sample = corpus.texts[:: max(1, len(corpus) // args.embed_sample)][: args.embed_sample]
        print(table(["encoder", "batch", "docs", "docs/s"], embedding_throughput(sample, args.encoder, [16, 64])))
    communities = torch.as_tensor(dm.communities)
    # the users the encoder embeds (those with a collaborative pool), from the same pools
    mean_pooled = torch.stack([dm.doc_embeddings[dm.user_history(i) - FIRST_DOC_ID].mean(0) for i in range(dm.num_users)])
    rows = [["random users (chance)", "-", "-", f"{community_chance(communities):.3f} (expected)"],
            ["MEAN of doc embeddings", "-", "-", f"{community_precision_at_m(mean_pooled, communities, args.m):.3f}"]]
    if dm.doc_labels is not None and dm.doc_labels.any():
        # Diagnostic, no training: MEAN over a user's docs of (doc vector ⊗ one-hot of its label), i.e. a mean doc
        # vector per label. It pairs each judgment with the text it judges; a sum (doc + label vector) averaged over
        # docs keeps only the mean text and the label histogram, which do not say who rated *what* how.
        width = int(dm.doc_labels.max()) + 1
        paired = []
        for i in range(dm.num_users):
            docs = torch.as_tensor(dm.user_history(i) - FIRST_DOC_ID)
            onehot = torch.nn.functional.one_hot(torch.as_tensor(dm.doc_labels[docs.numpy()]), width).float()
            paired.append((dm.doc_embeddings[docs].unsqueeze(2) * onehot.unsqueeze(1)).mean(0).flatten())
        rows.append(["MEAN of doc vector ⊗ label one-hot (no training)", "-", "-",
                     f"{community_precision_at_m(torch.stack(paired), communities, args.m):.3f}"])
    for judgments in args.judgments:
        for freeze in (table_kind == "frozen" for table_kind in args.doc_table):
            scores, speeds = [], []
            for seed in range(args.seeds):
                module, seconds = train_user_encoder(dm, args.epochs, freeze, seed, judgments)
                speeds.append(args.epochs * dm.num_users / seconds)
                scores.append(community_precision_at_m(module.user_embeddings(dm), communities, args.m))
            name = "contrastive (CFRAG §4.1)" + (", frozen doc table" if freeze else ", doc table fine-tuned")
            name += f", judgments: {judgments}" if judgments != "none" else ""
            spread = f" (seeds: {', '.join(f'{x:.3f}' for x in scores)})" if args.seeds > 1 else ""
            rows.append([name, args.epochs, f"{sum(speeds) / len(speeds):.0f}",
                         f"{sum(scores) / len(scores):.3f}{spread}"])
    print()
    print(table(["user embeddings", "epochs", "train users/s", f"same-community precision@{args.m}"], rows))


if __name__ == "__main__":
    main()
