"""A user's own requests racing their deletion on a live `persrag serve`, then a byte grep: used by the test suite
(bounded, tiny models) and, as a script, for the load figures of docs/serving/security.md against a running server:

    persrag serve --run checkpoints/synthlamp-quick --no-llm --extraction verbatim --port 8765 &
    python -m tests.helpers.serve_load --url http://127.0.0.1:8765 --roots checkpoints/synthlamp-quick .cache/persrag \
        --rounds 3 --chatters 6 --chats 20 --others 4 --out race.json

Each round: the victim signs up (a marker in their answers), then at once `chatters` threads chat as them (the
marker in every message), one thread lists and deletes their memories, one replaces their history, `others`
threads sign up and chat as other users; once every chatter has had an answer the victim deletes themselves while
all of it goes on. Every thread stops at its first 401. Afterwards no file under `roots` may hold a byte of the
victim's id or the marker, and the id must sign up again with 201.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

STOPPED = 401  # the victim's token is refused from the moment their deletion begins


def files_holding(roots, needles: list[str]) -> list[str]:
    """Every file under `roots` whose bytes contain one of `needles` (JSON, npz, safetensors, faiss, and LanceDB's
    data, deletion and index files alike)."""
    hits = []
    for root in roots:
        root = Path(root)
        if not root.exists():
            continue
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # removed while we walked (a compaction of another user's rows)
                continue
            hits += [f"{path} ∋ {n[:30]!r}" for n in needles if n.encode() in data]
    return hits


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: Counter[int] = Counter()
        self.errors: list[str] = []
        self.chat_ms: list[float] = []

    def add(self, r: httpx.Response, started: float, chat: bool = False) -> int:
        with self.lock:
            self.statuses[r.status_code] += 1
            if r.status_code >= 500:
                self.errors.append(f"{r.request.method} {r.request.url.path} -> {r.status_code} {r.text[:200]}")
            elif r.status_code >= 400:
                try:
                    body = r.json()
                except ValueError:
                    body = None
                if not (isinstance(body, dict) and isinstance(body.get("error", {}).get("message"), str)):
                    self.errors.append(f"{r.request.url.path}: {r.status_code} without the error shape: {r.text[:200]}")
            if chat and r.status_code == 200:
                self.chat_ms.append((time.perf_counter() - started) * 1000)
        return r.status_code


def race_round(url: str, victim: str, marker: str, chatters: int, chats: int, others: int,
               history_docs: list[dict] | None, rec: Recorder, tag: str, timeout: float = 120) -> dict:
    with httpx.Client(base_url=url, timeout=timeout) as http:
        t0 = time.perf_counter()
        r = http.post("/v1/users", json={"user_id": victim, "answers": {"goals": f"I keep a {marker} diary."}})
        signup = rec.add(r, t0)
        if signup != 201:
            return {"signup": signup}
        token = r.json()["access_token"]
    headers = {"Authorization": f"Bearer {token}"}
    answered = threading.Barrier(chatters + 1, timeout=timeout)

    def chatter(i: int) -> None:
        first = True
        with httpx.Client(base_url=url, timeout=timeout, headers=headers) as http:
            for t in range(chats):
                t0 = time.perf_counter()
                r = http.post("/v1/chat/completions", json={"session_id": f"s{i}", "messages": [
                    {"role": "user", "content": f"{marker} entry {t} of thread {i}"}]})
                code = rec.add(r, t0, chat=True)
                if first:
                    first = False
                    answered.wait()
                if code == STOPPED:
                    return

    def memory_writer() -> None:
        with httpx.Client(base_url=url, timeout=timeout, headers=headers) as http:
            for _ in range(chats):
                t0 = time.perf_counter()
                r = http.get(f"/v1/users/{victim}/memories")
                if rec.add(r, t0) == STOPPED:
                    return
                mems = r.json()["memories"]
                if mems:
                    t0 = time.perf_counter()
                    if rec.add(http.delete(f"/v1/users/{victim}/memories/{mems[0]['id']}"), t0) == STOPPED:
                        return

    def history_writer() -> None:
        docs = [{**d, "fields": {k: f"{v} {marker}" for k, v in d["fields"].items()}} for d in history_docs or []]
        if not docs:
            return
        with httpx.Client(base_url=url, timeout=timeout, headers=headers) as http:
            for _ in range(3):
                t0 = time.perf_counter()
                if rec.add(http.post(f"/v1/users/{victim}/history", json={"history": docs}), t0) == STOPPED:
                    return

    def other(i: int) -> None:
        with httpx.Client(base_url=url, timeout=timeout) as http:
            t0 = time.perf_counter()
            r = http.post("/v1/users", json={"user_id": f"bystander-{tag}-{i}", "answers": {"goals": "g"}})
            if rec.add(r, t0) != 201:
                return
            h = {"Authorization": f"Bearer {r.json()['access_token']}"}
            for t in range(max(1, chats // 2)):
                t0 = time.perf_counter()
                rec.add(http.post("/v1/chat/completions", headers=h, json={
                    "messages": [{"role": "user", "content": f"bystander note {t}"}]}), t0, chat=True)

    threads = [threading.Thread(target=chatter, args=(i,)) for i in range(chatters)]
    threads += [threading.Thread(target=memory_writer), threading.Thread(target=history_writer)]
    threads += [threading.Thread(target=other, args=(i,)) for i in range(others)]
    for t in threads:
        t.start()
    answered.wait()  # every chatter has had one answer: the rest are in flight
    with httpx.Client(base_url=url, timeout=timeout, headers=headers) as http:
        t0 = time.perf_counter()
        r = http.delete(f"/v1/users/{victim}")
        deleted = rec.add(r, t0)
        delete_ms = (time.perf_counter() - t0) * 1000
    for t in threads:
        t.join()
    return {"signup": signup, "delete": deleted, "delete_ms": delete_ms}


def race_rounds(url: str, rounds: int = 3, chatters: int = 6, chats: int = 10, others: int = 2, roots=(),
                history_docs: list[dict] | None = None, victim: str | None = None) -> dict:
    """`rounds` races against the same victim id; returns the figures and what the grep found."""
    victim = victim or f"victim-{uuid.uuid4().hex[:10]}"
    marker = f"marker-{uuid.uuid4().hex[:12]}"
    rec = Recorder()
    t0 = time.perf_counter()
    results = [race_round(url, victim, marker, chatters, chats, others, history_docs, rec, str(i))
               for i in range(rounds)]
    leftover = files_holding(roots, [victim, marker])
    with httpx.Client(base_url=url, timeout=120) as http:  # the last deletion left the id free
        r = http.post("/v1/users", json={"user_id": victim, "answers": {"goals": "again"}})
        final = r.status_code
        if final == 201:
            http.delete(f"/v1/users/{victim}", headers={"Authorization": f"Bearer {r.json()['access_token']}"})
    ms = sorted(rec.chat_ms)
    return {
        "rounds": rounds, "chatters": chatters, "chats_per_thread": chats, "others": others,
        "requests": sum(rec.statuses.values()), "statuses": dict(sorted(rec.statuses.items())),
        "server_errors": sum(n for s, n in rec.statuses.items() if s >= 500), "errors": rec.errors[:20],
        "signup_again": [r["signup"] for r in results[1:]] + [final],
        "delete_status": [r.get("delete") for r in results], "delete_ms": [round(r.get("delete_ms", 0)) for r in results],
        "chat_ms_p50": round(statistics.median(ms), 1) if ms else None,
        "chat_ms_p95": round(ms[int(0.95 * (len(ms) - 1))], 1) if ms else None,
        "wall_s": round(time.perf_counter() - t0, 1), "leftover_files": leftover,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--roots", nargs="*", default=[], help="folders to grep afterwards (the run, the cache)")
    parser.add_argument("--state", default=None, help="the service's state folder, when it is not inside a root "
                                                       "(persrag serve --state)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chatters", type=int, default=6)
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--others", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    roots = [Path(r) for r in args.roots]
    if args.state:
        roots.append(Path(args.state))
    history = [{"id": f"race-{i}", "date": f"2024-03-0{i + 1}", "fields": {"description": f"a quiet film {i}"}}
               for i in range(3)]
    report = race_rounds(args.url, args.rounds, args.chatters, args.chats, args.others, roots, history)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
