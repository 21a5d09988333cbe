"""Generator stage throughput: LoRA (or full) fine-tuning steps of the LLM on SynthLaMP training prompts, and the
dev answers of its validation, on this machine. Prints examples/s; no assertion on time.

    python benchmarks/bench_generator.py [--examples 32] [--batch 8] [--strategy bm25] [--lora-r 8]

Prompts come from the stage's own DataModule (BM25 by default: needs no trained bundle), so they are the real
training prompts (Table 4, k = 5 docs, 512-token budget, chat template)."""

from __future__ import annotations

import argparse
import time

import torch

from persrag_lightning.data.splits import SplitSettings
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.datamodules.generator import GeneratorDataModule, collate_generator
from persrag_lightning.logs import configure_logs
from persrag_lightning.modules.generator import GeneratorModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--strategy", default="bm25")
    parser.add_argument("--run_dir", default="checkpoints/synthlamp")
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--val-examples", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast, as --trainer.precision=bf16-mixed")
    args = parser.parse_args()
    configure_logs(verbose=False)  # no loading bars or peft's deprecation note in the table
    if args.threads:
        torch.set_num_threads(args.threads)
    data = GeneratorDataModule(synth=SynthConfig(num_users=300), strategy=args.strategy, run_dir=args.run_dir,
                               tokenizer=args.model, splits=SplitSettings(max_train_examples=args.examples,
                                                                      max_val_examples=args.val_examples),
                               batch_size=args.batch)
    t0 = time.perf_counter()
    data.prepare_data()
    data.setup("fit")
    prep = time.perf_counter() - t0
    torch.manual_seed(0)
    module = GeneratorModule(model=args.model, lora_r=args.lora_r)
    module.task = data.task
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=2e-4)
    ex = data.train_examples
    tokens = [len(p) for p, _ in module.backend.encode_pairs([e.prompt for e in ex], [e.target for e in ex])]
    module.train()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    t0 = time.perf_counter()
    for start in range(0, len(ex), args.batch):
        with autocast:
            loss = module.loss(collate_generator(ex[start:start + args.batch]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    train_s = time.perf_counter() - t0
    module.eval()
    t0 = time.perf_counter()
    with torch.no_grad(), autocast:
        module.reader.answer_prompts(module.task, [e.prompt for e in data.val_examples])  # validation's reader
    val_s = time.perf_counter() - t0
    print("| model | precision | LoRA r | trainable params | batch | prompt tokens (mean) | train examples/s | "
          "validation answers/s | prompts built (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.model} | {'bf16-mixed' if args.bf16 else 'float32'} | {args.lora_r} | {trainable:,} | {args.batch} | {sum(tokens) / len(tokens):.0f} | "
          f"{len(ex) / train_s:.2f} | {len(data.val_examples) / val_s:.2f} | {prep:.1f} |")


if __name__ == "__main__":
    main()
