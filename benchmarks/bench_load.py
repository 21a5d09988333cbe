"""Many users at once: `persrag serve --no_llm` on loopback under N concurrent clients (chat completions of
exported users, so every chat runs CFRAG's retrieval; or, with `--endpoint answers`, POST /v1/answers: CFRAG's
retrieval and the run's trained reader, as the run's record serves them, or as `--serve_args` overrides it). Two
servers up side by side, loaded in turn at each level: one batches (the chats' retrievals, their LLM replies, the
label questions and the memory bank's texts, each up to `--max_batch` waiting at most `--max_wait_ms`: `persrag
serve --max_batch`, `--llm_max_batch`, `--answers_max_batch`, `--bank_max_batch` and their waits), the other serves
each request alone (all four at 1).
Prints requests/s, p50/p95/p99 latency, errors and the server's resident memory (start, max, end of each level)
as a markdown table. With `--llm` the servers answer chats with the LLM (`--llm_model`, `--max_new_tokens`) and
the table adds the LLM path's tokens per second: per stream (an answer's tokens over its request's time, p50 and
p5 over the requests) and over all streams (every answer's tokens over the level's time), tokens counted with the
LLM's tokenizer; a third server batches like the second but generates its replies in whole batches
(`--llm_batching batches`) instead of continuously (a reply joining those in flight between two tokens, the
default). Each `--variant ARGS` adds a server that batches with these `persrag serve` arguments too (an A/B in
the same run, e.g. `--variant "--llm_dtype bf16_if_native"`). Bounded: loopback only, at most `--requests` per level and `--seconds` per level. Asserts
nothing.

    python benchmarks/bench_load.py --clients 1,4,16 --requests 300             # a tiny export built here
    python benchmarks/bench_load.py --run checkpoints/synthlamp-quick --clients 1,4,16
    python benchmarks/bench_load.py --run checkpoints/synthlamp-quick --endpoint answers --clients 1,4,16
    python benchmarks/bench_load.py --run checkpoints/synthlamp-quick --llm --clients 1,16 --requests 32 --warmup 2
    python benchmarks/bench_load.py --run checkpoints/synthlamp-quick --endpoint answers --clients 1,16 \
        --serve_args "--reranker reranker_split_l5"
    python benchmarks/bench_load.py --run checkpoints/synthlamp-quick --llm --clients 1,16 --requests 32 --warmup 2 \
        --variant "--llm_dtype bf16_if_native"
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the servers' environment: taken before tests/conftest.py (which builds the tiny export) sets the suite's own;
# both servers get the GEMM paths of --gemm: the run's record's by default (each measuring its own at start
# could choose differently)
SERVER_ENV = dict(os.environ)

from persrag_lightning.data.synth_text import LAMP2_PROMPT  # after the path and the environment above

HOST = "127.0.0.1"  # loopback only: this benchmark never reaches another machine
ADMIN = "bench-load-admin"
MAX_CLIENTS = 64
MESSAGES = ["a detective hunts a killer in a rainy city", "a space ship lost near a dying star",
            "two friends open a bakery in Paris", "a knight, a dragon and a stolen crown", "a heist in a casino",
            "a ghost in an old house by the sea", "a comedy about a wedding gone wrong", "robots learn to paint",
            "a war story told by a nurse", "a documentary on deep-sea fish", "a spy thriller in Berlin",
            "a musical about a small-town band"]
# --questions distinct: each request's message a plot of MESSAGES set in a place, with a twist, in an era, none
# sent twice in a run (12 x 24 x 24 x 16 = 110,592 messages, 10,000 per level at most): a served question is new
# to the server, as a product's are, so no cache of question texts answers it
PLACES = ["in Lagos", "in Oslo", "on Mars", "in a desert town", "on a night train", "in a mountain village",
          "in a prison", "on an island", "in Tokyo", "in a hospital", "at a boarding school", "on a farm",
          "in a submarine", "in Venice", "in a jungle", "in New York", "in a castle", "on a cruise ship",
          "in a mine", "at the North Pole", "in a circus", "in a library", "in Cairo", "in a casino town"]
TWISTS = ["told backwards", "with a twin", "and a talking cat", "after a flood", "during an election",
          "with no dialogue", "and a lost letter", "on a single day", "with a secret map", "and a rival chef",
          "after a blackout", "with a fake identity", "and a time loop", "during a storm", "with a broken clock",
          "and a missing child", "in black and white", "with a stolen painting", "and an old diary",
          "with a robot butler", "during a festival", "and a locked room", "with a runaway bride", "and a curse"]
ERAS = ["in 1920", "in 1950", "in 1969", "in 1985", "in 1999", "in 2010", "in 2049", "in 2300", "in the ice age",
        "in ancient Rome", "in the middle ages", "in the wild west", "during the cold war", "in the jazz age",
        "in the far future", "today"]
REQUESTS_PER_LEVEL = 10_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    """The process's resident memory (Linux /proc), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def build_tiny_export(root: Path, encoder: str, users: int) -> Path:
    """A run as the serving tests build one: stage 1 trained for an epoch over SynthLaMP, untrained retriever and
    reranker exports beside it (`encoder`: `tiny`, the tests' random 32-wide BERT, or a name such as minilm)."""
    from tests.conftest import build_tiny_bert, tiny_serving_run

    if encoder == "tiny":
        encoder = build_tiny_bert(root / "tiny_bert")
    from transformers import AutoConfig

    from persrag_lightning.models.text_encoder import resolve_model_path

    dim = AutoConfig.from_pretrained(resolve_model_path(encoder)).hidden_size
    args = ["fit", "--config", "cfrag_user_encoder.yaml", "--run_name", "bench", f"--data.init_args.encoder={encoder}",
            f"--data.init_args.synth.num_users={users}", "--trainer.max_epochs=1", "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false"]
    with contextlib.redirect_stdout(sys.stderr):  # Lightning's tables: stdout keeps only this script's report
        return tiny_serving_run(root / "export", args, "bench", encoder, user_dim=dim)


@dataclass
class Server:
    """`persrag serve` in a subprocess on a free loopback port (`--no_llm` unless `llm` names the LLM's flags),
    with accounts claimed for exported users."""

    name: str
    flags: list[str]
    run: Path
    tmp: Path
    bank_encoder: str
    gemm: str
    llm: list[str] | None = None
    port: int = field(default_factory=free_port)
    tokens: list[str] = field(default_factory=list)

    @property
    def slug(self) -> str:
        """The name as a file name (a variant's name holds its arguments)."""
        return re.sub(r"[^\w]+", "-", self.name).strip("-")

    def start(self) -> None:
        cmd = [sys.executable, str(ROOT / "train.py"), "serve", "--run", str(self.run), "--host", HOST,
               "--port", str(self.port), "--state", str(self.tmp / f"state-{self.slug}"),
               *(self.llm if self.llm is not None else ["--no_llm"]),
               "--extraction", "verbatim", "--encoder", self.bank_encoder, "--cache_dir", str(self.tmp / "cache"),
               "--signup_rate", "0", "--request_rate", "0", *self.flags]
        self.log = open(self.tmp / f"server-{self.slug}.err", "w")  # noqa: SIM115  (closed in stop)
        env = {**SERVER_ENV, "PERSRAG_ADMIN_TOKEN": ADMIN, "PYTHONPATH": str(ROOT), "PERSRAG_GEMM": self.gemm}
        if self.gemm == "record":  # unset: the server takes the run's recorded paths (measured if it has none)
            env.pop("PERSRAG_GEMM")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: server did not start; see {self.log.name}")
            try:
                if request(self.port, "GET", "/healthz")[0] == 200:
                    return
            except OSError:
                time.sleep(0.5)

    def sign_up(self, users: list[str]) -> None:
        for u in users:  # the admin claims an exported user: their docs are in the store, so chats retrieve
            status, body = request(self.port, "POST", "/v1/users", {"user_id": u, "answers": {"goals": f"goal of {u}"}},
                                   ADMIN)
            if status != 201:
                raise RuntimeError(f"{self.name}: sign-up of {u} answered {status}: {body[:200]}")
            self.tokens.append(json.loads(body)["access_token"])

    def stop(self) -> str:
        """Stop the server (SIGINT: uvicorn's graceful shutdown); its log."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        return Path(self.log.name).read_text()


def request(port: int, method: str, path: str, body: dict | None = None, token: str | None = None,
            conn: http.client.HTTPConnection | None = None) -> tuple[int, str]:
    own = conn is None
    conn = conn or http.client.HTTPConnection(HOST, port, timeout=120)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        if own:
            conn.close()


def message(level: int, n: int, distinct: bool = True) -> str:
    """The `n`-th request's message at level `level`: distinct, a combination of MESSAGES, PLACES, TWISTS and ERAS
    no other request of the run gets; else one of the 12 MESSAGES in turn."""
    if not distinct:
        return MESSAGES[n % len(MESSAGES)]
    k = level * REQUESTS_PER_LEVEL + n
    parts = []
    for words in (MESSAGES, PLACES, TWISTS, ERAS):
        parts.append(words[k % len(words)])
        k //= len(words)
    if k:
        raise ValueError(f"request {n} of level {level}: more requests than distinct messages")
    return " ".join(parts)


def request_body(endpoint: str, i: int, text: str) -> tuple[str, dict]:
    """The path and body of client `i`'s request of `text`: a chat turn, or a LaMP-2 question for
    /v1/answers."""
    if endpoint == "answers":
        return "/v1/answers", {"input": LAMP2_PROMPT + text}
    return "/v1/chat/completions", {"session_id": f"load-{i}", "messages": [{"role": "user", "content": text}]}


def answer_tokens(body: str, count: Callable[[str], int]) -> int:
    """The tokens of a chat completion's answer, as `count` counts them."""
    return count(json.loads(body)["choices"][0]["message"]["content"])


def load(server: Server, clients: int, requests: int, seconds: float, endpoint: str = "chat",
         count: Callable[[str], int] | None = None, level: int = 0, distinct: bool = True) -> dict:
    """`clients` threads, one account and one keep-alive connection each, send `endpoint`'s requests until
    `requests` are sent or `seconds` have passed, the messages of `level` (`message`); latencies, errors and the
    server's RSS sampled every 0.2 s; with `count`, each answer's tokens."""
    latencies: list[float] = []
    tokens: list[int] = []
    errors = [0]
    sent = [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    rss = [rss_mb(server.proc.pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            rss.append(rss_mb(server.proc.pid))

    def client(i: int) -> None:
        conn = http.client.HTTPConnection(HOST, server.port, timeout=120)
        token = server.tokens[i % len(server.tokens)]
        while time.monotonic() < stop_at:
            with lock:
                if sent[0] >= requests:
                    break
                n = sent[0]
                sent[0] += 1
            path, body = request_body(endpoint, i, message(level, n, distinct))
            t0 = time.perf_counter()
            try:
                status, answer = request(server.port, "POST", path, body, token, conn)
            except (OSError, http.client.HTTPException):
                status = 0
                conn.close()
                conn = http.client.HTTPConnection(HOST, server.port, timeout=120)
            ms = 1000 * (time.perf_counter() - t0)
            counted = [answer_tokens(answer, count)] if status == 200 and count is not None else []
            with lock:
                if status == 200:
                    latencies.append(ms)
                    tokens.extend(counted)
                else:
                    errors[0] += 1
        conn.close()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    rss.append(rss_mb(server.proc.pid))
    return {"done": len(latencies), "errors": errors[0], "wall": wall, "lat": latencies, "rss": rss, "tokens": tokens}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=None, help="an exported run (default: a tiny export built in a temp folder)")
    ap.add_argument("--encoder", default="tiny", help="the built export's encoder: tiny (the tests' random BERT) "
                                                     "or a name such as minilm")
    ap.add_argument("--bank_encoder", default=None, help="the memory bank's encoder (default: the export's encoder "
                                                         "when built here, minilm with --run)")
    ap.add_argument("--users", type=int, default=24, help="users of the built export (and accounts claimed, at most)")
    ap.add_argument("--clients", default="1,4,16", help="concurrency levels, comma-separated")
    ap.add_argument("--requests", type=int, default=300, help="chat requests per level (bounded)")
    ap.add_argument("--seconds", type=float, default=180, help="time limit per level")
    ap.add_argument("--max_batch", type=int, default=16)
    ap.add_argument("--max_wait_ms", type=float, default=5.0)
    ap.add_argument("--gemm", default="record", help="PERSRAG_GEMM of both servers: a float32 GEMM path or pin "
                                                     "(persrag_lightning/runtime.py), the same for both; record: "
                                                     "unset, so both take the run's recorded paths (torch's for "
                                                     "an export without a record)")
    ap.add_argument("--warmup", type=int, default=10, help="sequential requests before measuring (not counted)")
    ap.add_argument("--llm", action="store_true", help="chat with the LLM (not --no_llm) and report its tokens/s")
    ap.add_argument("--llm_model", default="smollm2", help="with --llm: the servers' LLM (persrag serve --llm_model)")
    ap.add_argument("--max_new_tokens", type=int, default=64, help="with --llm: the most tokens an answer has")
    ap.add_argument("--serve_args", default="", help="more `persrag serve` arguments for both servers, e.g. "
                                                      "\"--reranker reranker_split_l5\" to serve another reranker "
                                                      "than the run's record chose")
    ap.add_argument("--variant", action="append", default=[], metavar="ARGS",
                    help="another batched server with these `persrag serve` arguments too, loaded in turn with the "
                         "others (repeatable)")
    ap.add_argument("--questions", choices=["distinct", "repeat"], default="distinct",
                    help="distinct: every request's message new to the server (none sent twice in the run); repeat: "
                         "the 12 messages in turn, so a server's caches of question texts answer most of them")
    ap.add_argument("--endpoint", choices=["chat", "answers"], default="chat",
                    help="chat: chat completions (retrieval, the memory bank); answers: POST /v1/answers (retrieval "
                         "and the run's trained reader; a label run whose record chose the trained reader)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    if not all(1 <= c <= MAX_CLIENTS for c in levels) or not 1 <= args.requests <= REQUESTS_PER_LEVEL:
        raise SystemExit(f"--clients must be in 1..{MAX_CLIENTS}, --requests in 1..{REQUESTS_PER_LEVEL}")
    if args.llm and args.endpoint != "chat":
        raise SystemExit("--llm measures chat completions: leave --endpoint as chat")
    count = token_counter(args.llm_model) if args.llm else None
    distinct = args.questions == "distinct"
    llm = ["--llm_model", args.llm_model, "--max_new_tokens", str(args.max_new_tokens)] if args.llm else None
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp_name:
        tmp = Path(tmp_name)
        run = Path(args.run) if args.run else build_tiny_export(tmp, args.encoder, args.users)
        bank = args.bank_encoder or ("minilm" if args.run else str(tmp / "tiny_bert") if args.encoder == "tiny"
                                     else args.encoder)
        from persrag_lightning.data.docstore import read_docstore
        from persrag_lightning.record import read_reference
        from persrag_lightning.retrieval.base import DocStore

        users = DocStore(read_docstore(run / "docstore")).corpus.user_ids[:max(levels)]
        if args.gemm == "record" and read_reference(run) is None:
            args.gemm = "torch"  # no record to take the paths from: one path for both, not each one's measurement
        # each batcher of the server: the chats' retrievals, their LLM replies, the label questions, the bank's texts
        batchers = ("--", "--llm_", "--answers_", "--bank_")
        batched = [f for b in batchers for f in (f"{b}max_batch", str(args.max_batch), f"{b}max_wait_ms",
                                                 str(args.max_wait_ms))]
        alone = [f for b in batchers for f in (f"{b}max_batch", "1")]
        extra = shlex.split(args.serve_args)
        servers = [Server("unbatched", [*extra, *alone], run, tmp, bank, args.gemm, llm),
                   Server("batched", [*extra, *batched], run, tmp, bank, args.gemm, llm)]
        if args.llm:  # the replies' earlier batching, beside the default (continuous) in the same run
            servers.append(Server("batched, whole reply batches", [*extra, *batched, "--llm_batching", "batches"],
                                  run, tmp, bank, args.gemm, llm))
        servers += [Server(f"batched, {v}", [*extra, *batched, *shlex.split(v)], run, tmp, bank, args.gemm, llm)
                    for v in args.variant]
        rows, logs = [], {}
        try:
            for s in servers:
                s.start()
                s.sign_up(users)
                load(s, 1, args.warmup, args.seconds, args.endpoint, level=len(levels), distinct=distinct)
            # the two servers in turn at each level: both meet the same load of the machine and the same messages
            for level, clients in enumerate(levels):
                for s in servers:
                    rows.append((s, clients, load(s, clients, args.requests, args.seconds, args.endpoint, count,
                                                  level, distinct)))
        finally:
            for s in servers:
                logs[s.name] = s.stop() if hasattr(s, "proc") else ""
        print_table(args, run, bank, len(users), rows, logs)


def token_counter(model: str) -> Callable[[str], int]:
    """An answer's tokens as the LLM's own tokenizer counts them (the server's usage counts words)."""
    from transformers import AutoTokenizer

    from persrag_lightning.llm.base import resolve_model
    from persrag_lightning.llm.gguf import local_model_path

    tokenizer = AutoTokenizer.from_pretrained(local_model_path(resolve_model(model)), local_files_only=True)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def llm_cells(r: dict) -> str:
    """The LLM path's cells: tokens/s per stream (p50, p5 over the requests), over all streams, tokens per answer."""
    per_stream = [t / (ms / 1000) for t, ms in zip(r["tokens"], r["lat"], strict=True)]
    mean = sum(r["tokens"]) / len(r["tokens"]) if r["tokens"] else float("nan")
    return (f" {pct(per_stream, .5):.1f} | {pct(per_stream, .05):.1f} | {sum(r['tokens']) / r['wall']:.1f} | "
            f"{mean:.1f} |")


def print_table(args: argparse.Namespace, run: Path, bank: str, accounts: int, rows: list, logs: dict) -> None:
    where = args.run or f"a tiny export built here ({args.encoder} encoder, {args.users} users)"
    what = ("POST /v1/answers (the trained reader)" if args.endpoint == "answers" else "chat completions") + (
        f" with the LLM {args.llm_model} (at most {args.max_new_tokens} new tokens)" if args.llm else " without the LLM")
    print(f"run: {where}; bank encoder: {Path(bank).name}; {accounts} accounts (exported users), one per client; "
          f"{what}; questions {args.questions} (--questions); loopback {HOST}; at most {args.requests} requests and "
          f"{args.seconds:.0f} s per level; GEMM path {args.gemm}; batched: --max_batch {args.max_batch} --max_wait_ms {args.max_wait_ms}"
          + (f"; both servers: {args.serve_args}" if args.serve_args else ""))
    print()
    llm = (" tokens/s per stream p50 | p5 | tokens/s, all streams | tokens per answer |", "---|---|---|---|")
    print("| server | clients | requests | errors | requests/s | p50 ms | p95 ms | p99 ms | RSS start MB | "
          "RSS max MB | RSS end MB |" + (llm[0] if args.llm else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + (llm[1] if args.llm else ""))
    for s, clients, r in rows:
        lat, rss = r["lat"], r["rss"]
        print(f"| {s.name} | {clients} | {r['done']} | {r['errors']} | {r['done'] / r['wall']:.1f} | "
              f"{pct(lat, .5):.0f} | {pct(lat, .95):.0f} | {pct(lat, .99):.0f} | {rss[0]:.0f} | {max(rss):.0f} | "
              f"{rss[-1]:.0f} |" + (llm_cells(r) if args.llm else ""))
    print()
    for name, log in logs.items():
        for line in log.splitlines():
            if re.search(r"batches:|GEMM path|\[serving\] serving", line):
                print(f"{name}: {line.strip()}")


if __name__ == "__main__":
    main()
