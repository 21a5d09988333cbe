"""The evaluation's reader per runtime on this CPU: `answer_mode: choose` (the most likely of LaMP-2's 15 tags) on
the main job's prompts, float32 transformers against bfloat16 transformers and llama.cpp on re-encoded weights.

The reader answers 11 x 300 prompts of ~360 tokens in the main job, half of it on a CPU with AMX and two thirds
without; this says which runtime a machine should read with. Prompts: the first --prompts SynthLaMP LaMP-2 test
questions with BM25's top-5 docs of the user's history (the table's BM25 row, so no trained run is needed), built
by the evaluation's own prompt path. Each row: prompts/s after one warm-up call, its speed against float32
transformers in the same run, how many choices equal float32's (the exact model: SmolLM2 de-quantised from its Q4_1
file) and the median |log p| gap over all 15 options of all prompts. A second table is the float32 floor: the
decoder's linear layers' work per prompt at a lone float32 matmul's rate on this CPU and at the reader's own matmuls'
rate (the time 300 prompts would take if nothing but matmuls took any), against the reader end to end; then where a
float32 batch's time goes. `--compile` adds torch.compile (inductor) as a row, `--int8` torch's dynamic int8
quantisation of the decoder's linear layers (fbgemm: int8 weights per tensor or per output channel, activations
quantised per tensor at run time; the LM head stays float32), `--gemm` a row per float32 GEMM path of the runtime
policy (persrag_lightning/runtime.py) other than torch's, which the float32 reference keeps (`PERSRAG_GEMM=torch`).
Prints Markdown; asserts nothing about time.

    python benchmarks/bench_reader.py [--compile] [--int8] [--gemm [PATHS]] [--llamacpp_weights ""]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2
        PYTHONPATH=<llama.cpp built for AVX2 only> python benchmarks/bench_reader.py   # an AVX2-only CPU, emulated
                                                 # (llama.cpp's kernels follow its build flags, not these caps)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import statistics
import sys
import time
import warnings

import numpy as np
import torch

from persrag_lightning.evaluation.evaluate import Evaluation
from persrag_lightning.hardware import bf16_verdict, cpu_bf16_instructions, describe_cpu, linear_seconds
from persrag_lightning.llm import load_llm
from persrag_lightning.llm.answer import allowed_labels, build_prompts
from persrag_lightning.retrieval.base import DocStore
from persrag_lightning.retrieval.strategies import cached_retrieval, strategy_by_name
from persrag_lightning.runtime import ENV, PATHS

MAX_PROMPT_TOKENS = 512  # the evaluation config's budget (configs/evaluate_cfrag.yaml)


def main_job_prompts(n: int, cache_dir: str, llm, task: str = "LaMP-2", split: str = "test") -> list[str]:
    """The first `n` SynthLaMP questions of `split` with BM25's top-5 docs, as the evaluation builds them."""
    evaluation = Evaluation(task=task, max_examples=n, cache_dir=cache_dir, split=split)
    evaluation.source.prepare()
    dataset = evaluation.source.load()
    store, examples = DocStore(dataset), evaluation.examples(dataset)
    bm25 = strategy_by_name("configs/evaluate_cfrag.yaml", "bm25", "checkpoints/unused")
    retrieved, _ = cached_retrieval(bm25, store, examples, 5, evaluation.source.cache_dir,
                                    evaluation.source.data_dir.name)
    return build_prompts(task, llm, [e.input for e in examples],
                         [[store.history_doc(d.row) for d in docs] for docs in retrieved], MAX_PROMPT_TOKENS)


def common_prefix(llm, prompts: list[str]) -> int:
    """How many chat-formatted tokens all prompts share at their start (the system turn and the history header)."""
    rows = llm._encode_prompts(prompts)
    return next((j for j, column in enumerate(zip(*rows)) if len(set(column)) > 1), min(map(len, rows)))


def linear_flops(model) -> int:
    """FLOPs of one token through the decoder's linear layers (attention projections and MLP, 2 per multiply-add):
    the matmul work a float32 reader cannot avoid; the LM head runs on the options' positions only."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return 2 * sum(m.in_features * m.out_features for m in decoder.modules() if isinstance(m, torch.nn.Linear))


def matmul_gflops(rows: int, model, repeats: int = 5, rounds: int = 5) -> float:
    """GFLOP/s of float32 `linear` at the model's MLP shape (rows x hidden -> intermediate), the best of `rounds`:
    this CPU's float32 matmul rate as the reader's largest layers see it."""
    config = model.config
    x, w = torch.randn(rows, config.hidden_size), torch.randn(config.intermediate_size, config.hidden_size)
    seconds = linear_seconds(x, w, rounds, repeats)
    return 2 * rows * config.hidden_size * config.intermediate_size * repeats / seconds / 1e9


def time_shares(llm, prompts: list[str], labels: list[str]) -> tuple[dict[str, float], float]:
    """Where one call's time goes by torch.profiler's self CPU time: matmuls, attention, the rest (element-wise
    ops: norms, rotary embeddings, SiLU, residual adds); and the matmuls' seconds."""
    from torch.profiler import profile

    with profile() as prof:
        llm.score_options(prompts, labels)
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(self_us.values())
    matmul = sum(v for k, v in self_us.items() if k in ("aten::mm", "aten::addmm", "aten::bmm"))
    attention = sum(v for k, v in self_us.items() if "scaled_dot_product" in k)
    shares = {"matmuls": matmul / total, "attention": attention / total,
              "element-wise ops and the rest": 1 - (matmul + attention) / total}
    return shares, matmul / 1e6


def int8_qconfigs() -> dict:
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

    return {"per tensor": default_dynamic_qconfig, "per channel": per_channel_dynamic_qconfig}


def quantize_decoder(decoder, qconfig):
    """The decoder with every nn.Linear replaced by torch's dynamic int8 linear (the quantized engine's kernels:
    fbgemm on x86, following FBGEMM_ENABLE_INSTRUCTIONS); eager-mode quantisation is deprecated in torch 2.13 but
    still ships, so its warnings are silenced here."""
    from torch.ao.quantization import quantize_dynamic

    torch.backends.quantized.engine = "fbgemm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(decoder, {torch.nn.Linear: qconfig}, dtype=torch.qint8)


def timed_scores(llm, prompts: list[str], labels: list[str]) -> tuple[list[list[float]], float]:
    llm.score_options(prompts[:2], labels)  # warm-up: kernel selection, llama.cpp's contexts
    t0 = time.perf_counter()
    scores = llm.score_options(prompts, labels)
    return scores, len(prompts) / (time.perf_counter() - t0)


def gemm_rows(row, batch_size: int, paths: list[str]) -> None:
    """A row per float32 GEMM path of `paths`, each set by PERSRAG_GEMM as a run would choose it; a path that
    cannot load here is a row saying so."""
    for name in paths:
        os.environ[ENV] = name
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the path's own line: the row names it, the table stays whole
                llm = load_llm("hf", "smollm2", batch_size=batch_size, dtype="float32")
            row(f"transformers float32, GEMM path {name} (batch {batch_size})", llm)
        except Exception as err:  # noqa: BLE001 - a path that cannot load (its extra missing) is reported, not fatal
            print(f"| transformers float32, GEMM path {name} | skipped: {str(err).splitlines()[0][:100]} | | | |")
    os.environ[ENV] = "torch"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--batch_size", type=int, default=16, help="transformers' batch (the evaluation's)")
    parser.add_argument("--llamacpp_weights", default="f16,f32,bf16,q8_0,q4_0",
                        help="llama.cpp weight types, comma-separated (re-encoded once from the shipped Q4_1 file)")
    parser.add_argument("--compile", action="store_true",
                        help="also time float32 transformers under torch.compile (inductor, dynamic shapes)")
    parser.add_argument("--int8", action="store_true",
                        help="also time torch's dynamic int8 quantisation of the decoder's linear layers (fbgemm)")
    parser.add_argument("--gemm", nargs="?", const=",".join(p for p in PATHS if p != "torch"), default="",
                        help="also time float32 transformers on these float32 GEMM paths of runtime.py, "
                             "comma-separated (alone: every path but torch's)")
    parser.add_argument("--cache_dir", default=".cache/persrag")
    args = parser.parse_args()
    os.environ[ENV] = "torch"  # the float32 reference: torch's own GEMM (--gemm's rows name theirs)
    labels = list(allowed_labels("LaMP-2"))
    with contextlib.redirect_stdout(sys.stderr):  # the runtime policy's line (torch's path) goes with the logs
        exact = load_llm("hf", "smollm2", batch_size=args.batch_size, dtype="float32")
    prompts = main_job_prompts(args.prompts, args.cache_dir, exact)
    tokens = statistics.mean(len(exact._encode_prompts([p])[0]) for p in prompts)
    print(f"Machine: {describe_cpu()}; bfloat16 native: {bf16_verdict()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    if importlib.util.find_spec("llama_cpp"):
        import llama_cpp

        built = " ".join(re.findall(r"(\w+) = 1", llama_cpp.llama_print_system_info().decode()))
        print(f"llama-cpp-python {llama_cpp.__version__}, built for: {built}")
    print(f"\n{len(prompts)} LaMP-2 test prompts (BM25 top-5), {tokens:.0f} tokens each on average, 15 options; "
          f"the tokens every prompt begins with (a prefix a KV cache could share): {common_prefix(exact, prompts)}\n")
    print("| reader runtime | prompts/s | x float32 | same choice as float32 | median abs. log p gap |")
    print("|---|---|---|---|---|")
    reference, base = timed_scores(exact, prompts, labels)
    print(f"| transformers float32 (batch {args.batch_size}) | {base:.2f} | 1.00 | (reference) | 0 |", flush=True)
    picks = [int(np.argmax(row)) for row in reference]

    def row(name: str, llm, warm_up: bool = False) -> float:
        if warm_up:  # torch.compile: the first full pass compiles every shape it meets; time the second
            t0 = time.perf_counter()
            llm.score_options(prompts, labels)
            name += f" (compiling: {time.perf_counter() - t0:.0f} s first)"
        scores, rate = timed_scores(llm, prompts, labels)
        llm.close()
        same = sum(int(np.argmax(s)) == p for s, p in zip(scores, picks))
        gap = float(np.median(np.abs(np.array(scores) - np.array(reference))))
        print(f"| {name} | {rate:.2f} | {rate / base:.2f} | {same}/{len(prompts)} | {gap:.3f} |", flush=True)
        return rate

    # The float32 floor: each prompt's tokens and the options' fed tokens through the linear layers once (padding
    # not counted), at the rate of a float32 matmul of the MLP's shape with the reader's batch of rows; against it
    # the reader's own matmuls (one profiled batch, its padding counted, the LM head's few positions not) and the
    # reader end to end.
    fed = sum(len(t) - 1 for t in exact.tokenizer(labels, add_special_tokens=False)["input_ids"])
    per_token = linear_flops(exact.model)
    gflop = per_token * (tokens + fed) / 1e9
    batch = prompts[:args.batch_size]
    shares, matmul_s = time_shares(exact, batch, labels)
    computed = len(batch) * (max(len(e) for e in exact._encode_prompts(batch)) + fed)  # padded to the longest
    lone = matmul_gflops(int(args.batch_size * (tokens + fed)), exact.model)
    floor = [("a lone matmul of the MLP's shape (this CPU's float32 rate)", lone),
             (f"the reader's matmuls (one batch of {len(batch)}, profiled)",
              per_token * computed / matmul_s / 1e9),
             (f"the reader end to end (batch {args.batch_size})", gflop * base)]
    if args.compile:
        exact.model.forward = torch.compile(exact.model.forward, dynamic=True)
        rate = row(f"transformers float32, torch.compile (batch {args.batch_size})", exact, warm_up=True)
        floor.append((f"the reader end to end, torch.compile (batch {args.batch_size})", gflop * rate))
    exact.close()
    if args.gemm:
        gemm_rows(row, args.batch_size, [p for p in args.gemm.split(",") if p])
    if args.int8:
        for weights, qconfig in int8_qconfigs().items():
            llm = load_llm("hf", "smollm2", batch_size=args.batch_size, dtype="float32")
            llm.model.model = quantize_decoder(llm.model.model, qconfig)
            row(f"transformers int8 dynamic, weights {weights} (batch {args.batch_size})", llm)
    if cpu_bf16_instructions():  # elsewhere bfloat16 is emulated in software: far slower, never chosen
        row(f"transformers bfloat16 (batch {args.batch_size})",
            load_llm("hf", "smollm2", batch_size=args.batch_size, dtype="bfloat16"))
    if importlib.util.find_spec("llama_cpp"):
        for weights in [w for w in args.llamacpp_weights.split(",") if w]:
            row(f"llama.cpp, {weights} weights", load_llm("llamacpp", "smollm2", weights=weights,
                                                          n_threads=torch.get_num_threads()))

    print("\nThe float32 floor: the decoder's linear layers' work per prompt (the prompt's and the options' tokens, "
          "padding not counted) and the time 300 prompts take at each rate; the first two rows are that time if "
          "nothing but matmuls took any.\n")
    print("| float32 linear layers | GFLOP per prompt | GFLOP/s | minutes per 300 prompts |")
    print("|---|---|---|---|")
    for name, rate in floor:
        print(f"| {name} | {gflop:.1f} | {rate:.0f} | {gflop * 300 / rate / 60:.2f} |")
    print("\nThe profiled float32 batch's time: " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()) + ".")


if __name__ == "__main__":
    main()
