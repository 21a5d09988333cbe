"""`persrag serve --run checkpoints/<run> [--host 127.0.0.1] [--port 8000]`: the personalized chat
service."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from typing import TYPE_CHECKING

from persrag_lightning.reading.decision import CALIBRATIONS, check_reading
from persrag_lightning.serving.bank_encoder import BANK_BATCHING, BANK_RUNTIMES, BatchedEncoder, bank_encoder
from persrag_lightning.serving.batcher import ANSWER_BATCHING, REPLY_BATCHING, Batching, ReplyBatching
from persrag_lightning.serving.served import RECORD_SAYS
from persrag_lightning.utils import ConfigError, one_flag_style

if TYPE_CHECKING:
    from persrag_lightning.serving.service import ChatService

__all__ = ["serve_command"]

LLM_DTYPES = ("float32", "bfloat16", "bf16_if_native")  # llm/hf_device.resolve_device_dtype's names


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="persrag serve", description=__doc__)
    _add_run_options(parser)
    _add_llm_options(parser)
    _add_retrieval_options(parser)
    _add_reading_options(parser)
    _add_operation_options(parser)
    return one_flag_style(parser)


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """The run served, the address it is served on and the service's state folder."""
    parser.add_argument(
        "--run", required=True, help="an exported run, e.g. checkpoints/synthlamp-quick"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--state", default=None, help="service state folder (default: <run>/serve)")


def _add_llm_options(parser: argparse.ArgumentParser) -> None:
    """The LLM that answers and extracts memories, and the memory bank's encoder."""
    parser.add_argument(
        "--llm_backend", default="hf", help="hf (default), llamacpp, openai or vllm"
    )
    parser.add_argument("--llm_model", default="smollm2")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--llm_dtype", choices=LLM_DTYPES, default=None,
                        help="with --llm_backend hf: what the LLM computes in. Default: the backend's (float32 on a "
                             "CPU, as the main job's feedback and evaluation; bfloat16 on CUDA). bf16_if_native: "
                             "bfloat16 where the CPU computes it natively (AVX512-BF16, AMX), float32 elsewhere; "
                             "replies then differ from float32's (docs/serving/chat-service.md measures both)")
    parser.add_argument("--no_llm", action="store_true",
                        help="answer without an LLM (retrieval, memories and provenance only)")
    parser.add_argument("--extraction", choices=("llm", "verbatim"), default="llm",
                        help="memory extraction: the LLM (the seed's) or the message stored verbatim")
    parser.add_argument("--encoder", default="minilm", help="the memory bank's text encoder")
    parser.add_argument("--bank_runtime", choices=BANK_RUNTIMES, default="fp32",
                        help="what runs the bank's encoder: fp32 (torch, the default), onnx or openvino (float32; "
                             "faster alone, no faster under concurrent chats); their vectors agree, so a bank keeps "
                             "its memories")
    parser.add_argument("--bank_max_batch", type=int, default=BANK_BATCHING.max_batch,
                        help="the most concurrent chats whose texts the bank's encoder embeds in one call (1: each "
                             "alone)")
    parser.add_argument("--bank_max_wait_ms", type=float, default=BANK_BATCHING.max_wait_ms,
                        help="how long a chat's text waits for batch-mates (0: only those already queued)")


def _add_retrieval_options(parser: argparse.ArgumentParser) -> None:
    """CFRAG's retrieval: similar users, the neighbour gate, k, the cohorts and the reranker."""
    parser.add_argument("--m", type=int, default=None,
                        help="similar users (CFRAG m; default: the run's pipeline.json's configuration, else 6)")
    parser.add_argument("--neighbour_slots", default=RECORD_SAYS,
                        help="the neighbour gate: at most N of the k docs neighbours', or none; default: the run's "
                             "pipeline.json's configuration (without one: none)")
    parser.add_argument("--k", type=int, default=5, help="docs per prompt (CFRAG k)")
    parser.add_argument("--users", choices=("encoder", "cluster"), default="encoder",
                        help="similar users: the user encoder's top-m (the paper) or the cohorts of `persrag "
                             "cluster` (CFRAG's `users: cluster`; new users join the nearest cohort)")
    parser.add_argument("--cohorts", default=None, help="the cohort export for --users cluster (default <run>/clusters)")
    parser.add_argument("--reranker", default=RECORD_SAYS,
                        help="the run's reranker bundle: reranker (stage 3), reranker_distilled (its one-layer "
                             "student, cfrag_reranker_distilled.yaml: faster reranking, docs/performance/serving.md), "
                             "reranker_split_l5 / reranker_split (every layer, the doc side computed once per doc: "
                             "a preset's split_reranker, configs/overlays/reranker_split.yaml) or none (the "
                             "first-stage order); default: "
                             "the order the run's pipeline.json chose on "
                             "dev (without one: reranker where exported)")
    parser.add_argument("--precompute_doc_states", action=argparse.BooleanOptionalAction, default=None,
                        help="a split reranker (reranker_split_l5, reranker_split): every stored doc's states "
                             "computed at start and each new user's at sign-up, so that no chat pays for them; "
                             "default: on wherever the reranker served is a split one")
    parser.add_argument("--reader_doc_vectors", action=argparse.BooleanOptionalAction, default=True,
                        help="a trained reader: its text vectors of every stored doc made at start (cached under "
                             "--cache_dir) and of each new user's at sign-up, so that no question waits for "
                             "them; --no-reader_doc_vectors: each on the first question that reads it")


def _add_reading_options(parser: argparse.ArgumentParser) -> None:
    """Who answers label questions, and how label scores become an answer."""
    parser.add_argument("--reader", default=RECORD_SAYS,
                        help="who answers label questions (POST /v1/answers): llm, reader (the run's trained "
                             "reader) or a reader's folder; default: the reader the run's pipeline.json chose on "
                             "dev (without one: llm)")
    parser.add_argument("--calibration", choices=CALIBRATIONS, default=None,
                        help="the LLM reader's label calibration (default: the run's pipeline.json, else none)")
    parser.add_argument("--decision", type=_decision, default=None,
                        help="the answer taken from label scores: auto, argmax, median, mean or quantile:<level> "
                             "(default: the run's pipeline.json, else auto)")


def _decision(text: str) -> str:
    """`--decision` checked as every reader's decision is (reading/decision.py), misspellings named."""
    try:
        check_reading("none", text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _add_operation_options(parser: argparse.ArgumentParser) -> None:
    """How the server runs: the cache, the Host names it answers, rate limits, batching, the admin token."""
    parser.add_argument("--cache_dir", default=".cache/persrag",
                        help="the cache the run's corpus embeddings are in (resolved once at start: a deletion "
                             "purges this one, wherever the process runs from)")
    parser.add_argument("--allowed_host", action="append", default=None,
                        help="a Host name this server answers (repeatable; default: the --host address, and the "
                             "loopback names when it is loopback; any when --host is 0.0.0.0 or :: without it)")
    parser.add_argument("--signup_rate", type=int, default=10,
                        help="sign-ups per minute per client address (0: unlimited)")
    parser.add_argument("--request_rate", type=int, default=600,
                        help="requests per minute per client address (0: unlimited)")
    parser.add_argument("--max_batch", type=int, default=Batching.max_batch,
                        help="concurrent chats whose retrievals share one encoder call (1: each alone; "
                             "docs/serving/chat-service.md)")
    parser.add_argument("--max_wait_ms", type=float, default=Batching.max_wait_ms,
                        help="how long a chat waits for batch-mates before its retrieval runs (0: only those "
                             "already queued)")
    parser.add_argument("--llm_max_batch", type=int, default=REPLY_BATCHING.max_batch,
                        help="the most chats whose LLM replies are generated together (1: each alone)")
    parser.add_argument("--llm_batching", choices=["continuous", "batches"],
                        default="continuous" if REPLY_BATCHING.continuous else "batches",
                        help="continuous: a reply joins those in flight between two tokens and leaves when it ends; "
                             "batches: the replies of chats that arrive together, generated from first token to "
                             "last (docs/serving/chat-service.md)")
    parser.add_argument("--llm_max_wait_ms", type=float, default=REPLY_BATCHING.max_wait_ms,
                        help="with --llm_batching batches: how long a chat's reply waits for batch-mates")
    parser.add_argument("--answers_max_batch", type=int, default=ANSWER_BATCHING.max_batch,
                        help="concurrent label questions (POST /v1/answers) retrieved in one call and read in one "
                             "call (1: each alone)")
    parser.add_argument("--answers_max_wait_ms", type=float, default=ANSWER_BATCHING.max_wait_ms,
                        help="how long a question waits for batch-mates (0: only those already queued)")
    parser.add_argument("--admin_token_env", default="PERSRAG_ADMIN_TOKEN",
                        help="environment variable holding the admin token (default: generated, in <state>/admin.token)")


def _slots(parser: argparse.ArgumentParser, value: str) -> int | str | None:
    """`--neighbour_slots`: a count, `none` (no gate) or `record`; anything else is refused."""
    if value in (RECORD_SAYS, "none"):
        return None if value == "none" else value
    if not value.isdigit():
        parser.error(f"--neighbour_slots must be a count, none or {RECORD_SAYS}, got {value!r}")
    return int(value)


def serve_command(argv: list[str]) -> None:
    parser = serve_parser()
    args = parser.parse_args(argv)
    if args.cohorts is not None and args.users != "cluster":
        parser.error("--cohorts is read only with --users cluster")
    if args.llm_dtype is not None and args.llm_backend != "hf":
        parser.error(f"--llm_dtype is an hf option; the {args.llm_backend} backend sets its own precision")
    try:
        batchings = {"batching": Batching(args.max_batch, args.max_wait_ms),
                     "generation": ReplyBatching(args.llm_max_batch, args.llm_max_wait_ms,
                                                 continuous=args.llm_batching == "continuous"),
                     "answering": Batching(args.answers_max_batch, args.answers_max_wait_ms),
                     "bank": Batching(args.bank_max_batch, args.bank_max_wait_ms)}
    except ValueError as e:
        parser.error(str(e))
    _require_web_stack()
    logging.basicConfig(level=logging.WARNING)
    service, generated = _open_service(parser, args, batchings)
    if generated:
        print(f"persrag serve: admin token written to {service.state / 'admin.token'}", file=sys.stderr)
    print(f"persrag serve: http://{args.host}:{args.port}/ ({service.health()['users']} users)", file=sys.stderr,
          flush=True)
    _serve_until_stopped(service, args)


def _require_web_stack() -> None:
    """The main job's install leaves the web stack out: one line naming the extra, exit code 2."""
    missing = [m for m in ("fastapi", "uvicorn", "lancedb") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"persrag serve needs {', '.join(missing)}: pip install -e \".[serve]\"")


def _open_service(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  batchings: dict[str, Batching]) -> tuple[ChatService, bool]:
    """The chat service over the run, as the command line sets it, its retrievals, LLM replies, label
    questions and bank texts batched as `batchings` say (ChatService's `batching`, `generation` and
    `answering`; `bank`, taken out here, the bank encoder's); (service, whether the admin token was
    generated)."""
    from persrag_lightning.llm.registry import LLMConfig
    from persrag_lightning.serving.service import ChatService

    llm = LLMConfig(backend=args.llm_backend, model=args.llm_model, max_new_tokens=args.max_new_tokens,
                    options={} if args.llm_dtype is None else {"dtype": args.llm_dtype})
    encoder = bank_encoder(args.encoder, args.cache_dir, args.bank_runtime, batchings.pop("bank"))
    return ChatService.open(args.run, args.state, llm=llm, encoder=encoder,
                            admin_token=os.environ.get(args.admin_token_env) or None,
                            use_llm=not args.no_llm, extraction=args.extraction, k=args.k,
                            m=RECORD_SAYS if args.m is None else args.m,
                            neighbour_slots=_slots(parser, args.neighbour_slots),
                            users=args.users, cohort_export=args.cohorts,
                            reranker=None if args.reranker == "none" else args.reranker,
                            precompute_doc_states=args.precompute_doc_states, reader=args.reader,
                            reader_doc_vectors=args.reader_doc_vectors,
                            calibration=args.calibration, decision=args.decision,
                            cache_dir=args.cache_dir, **batchings)


def _serve_until_stopped(service: ChatService, args: argparse.Namespace) -> None:
    """Serve the app on the address until the server stops, then close the service and print its
    retrieval and LLM reply batches."""
    import uvicorn

    from persrag_lightning.serving.app import allowed_hosts_for, create_app
    from persrag_lightning.serving.limits import Limits

    hosts = allowed_hosts_for(args.host, args.allowed_host)
    if hosts is None:
        print("persrag serve: bound to every address with no --allowed_host: the Host header is not checked",
              file=sys.stderr)
    app = create_app(
        service, limits=Limits(args.signup_rate, args.request_rate), allowed_hosts=hosts
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        service.close()  # the batchers' workers: queued chats answered, then stopped; the usage marks written
        batchers = [("retrieval", service.retrieval, "chats"), ("LLM reply", service.answerer.generation, "chats"),
                    ("answers", service.answering, "questions")]
        if isinstance(service.bank.encoder, BatchedEncoder):  # the last: the chats above embed with it
            service.bank.encoder.close()
            batchers.append(("bank encoder", service.bank.encoder.batcher, "embedding calls"))
        for what, batcher, items in batchers:
            print(f"persrag serve: {what} batches: {batcher.stats.describe(items)}", file=sys.stderr)
