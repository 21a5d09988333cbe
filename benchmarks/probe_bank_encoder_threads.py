"""The memory bank's encoder alone under concurrent threads, as chats call it from their worker threads: each of
`--threads` threads embeds `--per_thread` of bench_load.py's distinct messages, one text per call. Prints texts/s over
all and each call's p50/p99 ms for torch (`--bank_runtime fp32`), ONNX Runtime float32 with one session that the
threads call at once (`--bank_runtime onnx`) and OpenVINO float32 with one infer request under a lock
(`--bank_runtime openvino`): each first from one thread alone (the encoder's own rate, the baseline), then from the
threads with every call alone (`--bank_max_batch 1`) and with concurrent calls embedded together (`BatchedEncoder`,
`--bank_max_batch 16`); and two OpenVINO configurations the package does not serve: an infer request per thread
under the latency hint and under the throughput hint. Measures only.

    python benchmarks/probe_bank_encoder_threads.py [--threads 16] [--per_thread 40] [--encoder minilm]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import message

from persrag_lightning.serving.bank_encoder import BatchedEncoder, bank_encoder
from persrag_lightning.serving.batcher import Batching

Encode = Callable[[list[str]], torch.Tensor]


def measure(name: str, encode: Encode, threads: int, per_thread: int) -> str:
    """One table row: `threads` threads each embedding their own `per_thread` texts, one per call."""
    texts = [[message(1, t * per_thread + i) for i in range(per_thread)] for t in range(threads)]
    for text in texts[0][:5]:  # warm-up: first calls, compiles
        encode([text])
    seconds: list[float] = []
    guard = threading.Lock()

    def work(batch: list[str]) -> None:
        for text in batch:
            t0 = time.perf_counter()
            encode([text])
            with guard:
                seconds.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, texts))
    wall = time.perf_counter() - t0
    ms = np.array(seconds) * 1e3
    return f"| {name} | {threads * per_thread / wall:.0f} | {np.percentile(ms, 50):.1f} | {np.percentile(ms, 99):.1f} |"


def request_per_thread(encoder, path: Path, hint: str) -> tuple[Encode, int]:
    """The encoder's ONNX export in OpenVINO float32 under `hint`, one infer request per calling thread; (encode,
    the compiled model's streams)."""
    import openvino as ov

    core = ov.Core()
    config = {"PERFORMANCE_HINT": hint, "INFERENCE_NUM_THREADS": torch.get_num_threads(),
              "INFERENCE_PRECISION_HINT": "f32"}
    compiled = core.compile_model(core.read_model(str(path)), "CPU", config)
    names = {i.get_any_name() for i in compiled.inputs}
    local = threading.local()

    def session(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if not hasattr(local, "request"):
            local.request = compiled.create_infer_request()
        feed = {k: v.numpy() for k, v in inputs.items() if k in names}
        return torch.from_numpy(local.request.infer(feed)[0].copy()).float()

    return (lambda texts: encoder.encoder.encode(texts, session=session)), int(compiled.get_property("NUM_STREAMS"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=16, help="threads calling the encoder at once")
    ap.add_argument("--per_thread", type=int, default=40, help="texts each thread embeds, one per call")
    ap.add_argument("--encoder", default="minilm", help="the bank's encoder (persrag serve --encoder)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bank-threads-") as cache:
        served = bank_encoder(args.encoder, cache, "openvino")  # its export is the file the others read
        path = next((Path(cache) / "onnx").glob("bank-text-*.onnx"))
        encoders = (("torch fp32", bank_encoder(args.encoder, cache, "fp32")),
                    ("ONNX Runtime f32, one session, no lock", bank_encoder(args.encoder, cache, "onnx")),
                    ("OpenVINO f32, one request, locked", served))
        for name, encoder in encoders:
            rows.append(measure(f"{name}, one thread alone", encoder.encode, 1, 4 * args.per_thread))
            rows.append(measure(f"{name}, each call alone", encoder.encode, args.threads, args.per_thread))
            with contextlib.closing(BatchedEncoder(encoder, Batching(max_batch=16, max_wait_ms=0))) as batched:
                rows.append(measure(f"{name}, calls batched", batched.encode, args.threads,
                                    args.per_thread))
        for hint in ("LATENCY", "THROUGHPUT"):
            encode, streams = request_per_thread(served, path, hint)
            rows.append(measure(f"OpenVINO f32, a request per thread, {hint.lower()} hint ({streams} streams)",
                                encode, args.threads, args.per_thread))
    print(f"{args.threads} threads x {args.per_thread} one-text calls, torch threads {torch.get_num_threads()}\n")
    print("| encoder | texts/s | p50 ms | p99 ms |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
