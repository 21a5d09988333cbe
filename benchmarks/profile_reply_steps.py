"""One decoding step of the chats' replies: continuous batching's decoder (llm/hf_stepping.py, its cache keeping
room for the tokens to come) against transformers' own `generate` over the same left-padded rows (its
DynamicCache concatenated at every token, what whole reply batches run). Both decode the same `--rows` prompts of
about `--words` words greedily; a step's time is the median over `--steps` steps (for `generate`: its time for
`--steps` + 1 tokens less its time for one, over `--steps`). Then `torch.profiler`'s table of the decoder's own
steps. Asserts nothing.

    python benchmarks/profile_reply_steps.py --rows 16 --words 350 --steps 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from persrag_lightning.llm.hf import HFLLM
from persrag_lightning.llm.hf_stepping import GreedyRows

WORDS = "the of and to in is was for that with as on by at from their this which be are an or it have has".split()  # noqa: SIM905


def prompts(rows: int, words: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(words + 10 * i)) + " Summarize." for i in range(rows)]


def generate_ms(llm: HFLLM, texts: list[str], steps: int) -> float:
    """`generate`'s time per token after the first, over the rows as one left-padded batch."""
    from transformers import GenerationConfig

    ids, mask = llm._left_pad(llm._encode_prompts(texts))
    took = []
    for tokens in (1, steps + 1):
        config = GenerationConfig(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                  eos_token_id=llm._eos_ids, pad_token_id=llm._pad_id)
        start = time.perf_counter()
        with torch.inference_mode():
            llm.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        took.append(time.perf_counter() - start)
    return (took[1] - took[0]) / steps * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--words", type=int, default=350)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    llm = HFLLM(args.model)
    texts = prompts(args.rows, args.words)
    lengths = [len(ids) for ids in llm._encode_prompts(texts)]
    rows = GreedyRows(llm)
    rows.admit(list(range(args.rows)), texts, budget=args.steps * 3 + 2)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        rows.step()
        times.append((time.perf_counter() - start) * 1000)
    print(f"{args.model}, {llm.dtype}, {torch.get_num_threads()} threads; {args.rows} rows, prompts of "
          f"{min(lengths)}-{max(lengths)} tokens with the chat template; {args.steps} steps\n")
    print("| decoder | ms per step (median) |\n|---|---|")
    print(f"| continuous (llm/hf_stepping.py, room kept) | {statistics.median(times):.0f} |")
    print(f"| transformers generate, one left-padded batch (DynamicCache) | {generate_ms(llm, texts, args.steps):.0f} |")
    print()
    with torch.profiler.profile() as prof:
        for _ in range(5):
            rows.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
