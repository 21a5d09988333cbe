"""The chats' LLM replies in float32 and in bfloat16 (`persrag serve --llm_dtype`): what a prefill and a decoding
step cost in each, and how often the replies agree. The prompts are the chat service's (serving/prompt.py) for
`--rows` exported users of `--run`, each asking one of bench_load.py's messages: the docs the run's pipeline
retrieves for it, the user's sign-up answer as a memory, the LLM's 512-token budget. For each dtype, decoded with
continuous batching's decoder (llm/hf_stepping.py): the prefill of all rows together and of one row alone, the
median decoding step with every row in flight and with one, and every reply to its end (`--max_new_tokens`).
Against the first dtype: the replies that are the same text, and the tokens each reply shares with the first
dtype's before they part (median over the rows). Asserts nothing.

    python benchmarks/bench_reply_dtype.py --run checkpoints/synthlamp-quick --rows 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bench_load import message
from persrag_lightning.llm.hf import HFLLM
from persrag_lightning.llm.hf_stepping import GreedyRows
from persrag_lightning.serving.cfrag_pipeline import CFRAGPipeline
from persrag_lightning.serving.prompt import build_serving_prompt


def chat_prompts(pipeline: CFRAGPipeline, rows: int, llm: HFLLM) -> list[str]:
    """The service's prompt for the first `rows` exported users, one bench_load message each."""
    users = pipeline.store.corpus.user_ids[:rows]
    messages = [message(0, i) for i in range(len(users))]
    retrieved = pipeline.retrieve_batch(users, messages)
    return [build_serving_prompt(msg, [f"goal of {u}"], [d.text for d in docs], [], llm.count_tokens,
                                 pipeline.llm_config.max_prompt_tokens)
            for u, msg, docs in zip(users, messages, retrieved)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def decode(llm: HFLLM, prompts: list[str], budget: int, steps: int) -> dict:
    """Prefill and step times (ms) over all rows and one row, and every row's reply."""
    warm = GreedyRows(llm)  # the first forward of a dtype pays for its kernels' setup: not timed
    warm.admit([0], prompts[:1], 2)
    warm.step()
    one = GreedyRows(llm)
    prefill_one = timed(lambda: one.admit([0], prompts[:1], budget))
    step_one = statistics.median([timed(one.step) for _ in range(min(steps, budget - 1)) if len(one)])  # until it ends
    rows = GreedyRows(llm)
    replies: dict[int, str] = {}

    def keep(ended: list) -> None:
        replies.update((e.key, e.text) for e in ended)

    prefill_all = timed(lambda: keep(rows.admit(list(range(len(prompts))), prompts, budget)))
    step_times = []
    while len(rows):
        full = len(rows) == len(prompts)
        took = timed(lambda: keep(rows.step()))
        if full:
            step_times.append(took)
    return {"prefill_all": prefill_all, "prefill_one": prefill_one, "step_one": step_one,
            "step_all": statistics.median(step_times) if step_times else float("nan"),
            "replies": [replies[i] for i in range(len(prompts))]}


def shared_tokens(llm: HFLLM, a: str, b: str) -> int:
    """Tokens `a` and `b` share before they part."""
    x, y = llm.tokenizer.encode(a, add_special_tokens=False), llm.tokenizer.encode(b, add_special_tokens=False)
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="an exported run, e.g. checkpoints/synthlamp-quick")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, default=16, help="chats decoded together (bench_load's 16 clients)")
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="steps timed with one row in flight")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; the first is the reference")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    # first: the pipeline takes the run's recorded float32 GEMM paths, which the float32 LLM then runs on, as served
    pipeline = CFRAGPipeline.from_pretrained(args.run)
    results, prompts = {}, None
    for name in dtypes:
        llm = HFLLM(args.model, dtype=name)
        prompts = prompts or chat_prompts(pipeline, args.rows, llm)
        results[name] = (llm, decode(llm, prompts, args.max_new_tokens, args.steps))
    lengths = [results[dtypes[0]][0].count_tokens(p) for p in prompts]
    print(f"{args.model}, {torch.get_num_threads()} threads; run {args.run}; {len(prompts)} chat prompts of "
          f"{min(lengths)}-{max(lengths)} tokens (before the chat template); at most {args.max_new_tokens} new "
          f"tokens; greedy\n")
    print(f"| dtype | GEMM path | prefill, {len(prompts)} rows ms | prefill, 1 row ms | step, {len(prompts)} rows ms "
          f"(median) | step, 1 row ms (median) | replies the same as {dtypes[0]}'s | shared leading tokens "
          f"(median) | reply tokens (median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    reference = results[dtypes[0]][1]["replies"]
    for name, (llm, r) in results.items():
        same = sum(a == b for a, b in zip(r["replies"], reference))
        shared = statistics.median(shared_tokens(llm, a, b) for a, b in zip(r["replies"], reference))
        tokens = statistics.median(llm.count_tokens(a) for a in r["replies"])
        print(f"| {llm.dtype} | {llm.gemm} | {r['prefill_all']:.0f} | {r['prefill_one']:.0f} | {r['step_all']:.0f} | "
              f"{r['step_one']:.0f} | {same} of {len(prompts)} | {shared:.0f} | {tokens:.0f} |")


if __name__ == "__main__":
    main()
