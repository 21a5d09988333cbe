"""Serving under load: N clients (bounded, loopback only) sign up and chat at once against `persrag serve`'s app
on a real uvicorn server; counts lost / duplicated rows and prints p50 / p95 latency of recall and of a whole chat
turn, without the LLM and with it. Asserts nothing.

    python benchmarks/bench_serve.py --run checkpoints/synthlamp-quick --clients 4 --turns 5
    python benchmarks/bench_serve.py --run checkpoints/synthlamp-smoke --clients 4 --turns 3 --llm-turns 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.serving.app import create_app
from persrag_lightning.serving.limits import Limits
from persrag_lightning.serving.service import ChatService
from tests.helpers.serve_helpers import ThreadServer

ADMIN = "bench-admin"
MAX_CLIENTS = 16


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def load(service: ChatService, clients: int, turns: int, tag: str) -> dict:
    """Every client signs up and sends `turns` messages; returns latencies and the row check."""
    chat_ms: list[float] = []
    acked: dict[str, list[str]] = {}  # user → memory ids the server acknowledged (sign-up and chat turns)
    with ThreadServer(create_app(service, limits=Limits(signup_per_minute=0, requests_per_minute=0))) as server:
        def one(i: int) -> int:
            with httpx.Client(base_url=server.url, timeout=600) as http:
                user = f"{tag}-{i}"
                r = http.post("/v1/users", json={"user_id": user, "answers": {"goals": f"goal of {user}"}})
                r.raise_for_status()
                acked[user] = [m.id for m in service.bank.list(user)]
                headers = {"Authorization": f"Bearer {r.json()['access_token']}"}
                for t in range(turns):
                    t0 = time.perf_counter()
                    r = http.post("/v1/chat/completions", headers=headers, json={
                        "session_id": "bench", "messages": [{"role": "user", "content": f"fact {t}: I like item {t}"}]})
                    r.raise_for_status()
                    chat_ms.append(1000 * (time.perf_counter() - t0))
                    if r.json()["provenance"]["memory_stored"]:
                        acked[user].append(r.json()["provenance"]["memory_stored"])
                return i

        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, range(clients)))
        wall = time.perf_counter() - t0
    lost = dup = 0
    for i in range(clients):
        ids = [m.id for m in service.bank.list(f"{tag}-{i}")]
        lost += len(set(acked[f"{tag}-{i}"]) - set(ids))
        dup += len(ids) - len(set(ids)) + len(set(ids) - set(acked[f"{tag}-{i}"]))  # rows nobody acknowledged
        turns_logged = service.bank.turns(f"{tag}-{i}")
        lost += 2 * turns - len(turns_logged)
    recall_ms = []
    for i in range(clients):
        for q in ("what do I like?", "what is my goal?", "which item?", "tell me a fact", "anything else?"):
            t0 = time.perf_counter()
            service.bank.recall(f"{tag}-{i}", q, tags=None)
            recall_ms.append(1000 * (time.perf_counter() - t0))
    return {"chat": chat_ms, "recall": recall_ms, "lost": lost, "dup": dup, "wall": wall,
            "turns": clients * turns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="checkpoints/synthlamp-quick")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5, help="chat turns per client without the LLM")
    ap.add_argument("--llm-turns", type=int, default=2, help="chat turns per client with the LLM (0: skip)")
    ap.add_argument("--llm-backend", default="hf")
    ap.add_argument("--llm-model", default="smollm2")
    args = ap.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS:
        raise SystemExit(f"--clients must be in 1..{MAX_CLIENTS}")
    import torch

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLMConfig(backend=args.llm_backend, model=args.llm_model, max_new_tokens=32)
        for use_llm, turns in ((False, args.turns), (True, args.llm_turns)):
            if turns == 0:
                continue
            service, _ = ChatService.open(args.run, Path(tmp) / f"state-{use_llm}", llm=llm, admin_token=ADMIN,
                                          use_llm=use_llm, extraction="llm" if use_llm else "verbatim")
            if use_llm:
                service.pipeline.llm  # load before timing  # noqa: B018
            rows.append(("with LLM (extraction + answer)" if use_llm else "without LLM", load(
                service, args.clients, turns, "llm" if use_llm else "plain")))
    print(f"run={args.run} clients={args.clients} (loopback, uvicorn, one process)")
    print("| chat turn | turns | lost rows | duplicated rows | turn p50 ms | turn p95 ms | recall p50 ms | "
          "recall p95 ms | turns/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['turns']} | {r['lost']} | {r['dup']} | {pct(r['chat'], .5):.0f} | "
              f"{pct(r['chat'], .95):.0f} | {pct(r['recall'], .5):.1f} | {pct(r['recall'], .95):.1f} | "
              f"{r['turns'] / r['wall']:.2f} |")


if __name__ == "__main__":
    main()
